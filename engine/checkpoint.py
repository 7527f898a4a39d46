"""The trainer's state as a checkpoint: what is saved, from which rank, and how it comes back.

Owns the adaptation between engine.worker.Trainer and the `checkpointing`
package: the tensors (model parameters, AdamW moments and count, loss-scaler
state; named as in the model, `adam_m.<name>`, `adam_v.<name>`, …), which
rank writes which (a size-balanced split every rank computes alike), the run
state rank 0 adds (step, data cursor and skip ranges, lr overrides, config
hash and trajectory, seeds, metrics at save), and restoring all of it — into
any data-parallel world size, since every rank loads every tensor.
"""
from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any, Callable

import mindspore as ms
import numpy as np
import safetensors

import checkpointing
from checkpointing import layout, partition, reader, retention
from checkpointing.writer import ShardWriter
from daemon.protocol import CheckpointEvent
from engine import schedule
from engine.config import Config, ConfigError, config_hash, trajectory_dict

RUN_STATE_VERSION = 1
TEARDOWN_SLACK_STEPS = 50    # steps a rank may still make between an incident's detection and its teardown


def set_parameters(params, tensors: dict[str, np.ndarray], *, source: str, error: type[Exception]) -> None:
    """Sets each parameter from the array of its name, after checking them all (nothing is half
    loaded): a missing name or a wrong shape raises `error` naming the parameter and `source`."""
    missing = [p.name for p in params if p.name not in tensors]
    if missing:
        raise error(f"{source} lacks {len(missing)} tensor(s) this model needs, e.g. {', '.join(missing[:3])}; "
                    "was it saved by another model?")
    for p in params:
        if tuple(tensors[p.name].shape) != tuple(p.shape):
            raise error(f"{source}: tensor {p.name!r} has shape {tuple(tensors[p.name].shape)}, "
                        f"the model needs {tuple(p.shape)}")
    for p in params:
        p.set_data(ms.Tensor(tensors[p.name]))


def _changed_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    keys = []
    for section in sorted(set(saved) | set(current)):
        a, b = saved.get(section, {}), current.get(section, {})
        keys += [f"{section}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return keys


class TrainerCheckpoints:
    def __init__(self, trainer, cfg: Config, root: Path, *, emit: Callable[[CheckpointEvent], None]):
        self.trainer, self.cfg, self.root = trainer, cfg, Path(root)
        self.rank, self.world = trainer.rank_info.rank, trainer.rank_info.world_size
        self._emit_event = emit
        self.params = [*trainer.net.trainable_params(), *trainer.step_fn.state()]
        sizes = {p.name: int(np.prod(p.shape)) * p.data.itemsize for p in self.params}
        self.plan = partition.assign(sizes, self.world)
        self._staging: dict[str, np.ndarray] = {}
        self.writer = ShardWriter(self.root, rank=self.rank, world=self.world, emit=self._emit,
                                  keep_last=cfg.checkpoint.keep_last, keep_every=cfg.checkpoint.keep_every_steps,
                                  protected=self.protected)

    def protected(self) -> set[int]:
        """Checkpoints retention must keep: the newest one old enough that no incident detected from
        now on can make it unhealthy (an incident is detected at most hold/storm steps after its start,
        the ranks are stopped within TEARDOWN_SLACK_STEPS more, and a checkpoint within the
        rollback margin before that start is unhealthy). Checkpoints
        inside earlier incidents are no longer committed: the rollback renamed them. Called from
        the writer's thread."""
        h = self.cfg.health
        guard = h.rollback_margin_steps + max(h.loss_spike_hold_steps, h.overflow_storm_steps) + TEARDOWN_SLACK_STEPS
        return retention.newest_settled(layout.committed_steps(self.root), current_step=self.trainer.step,
                                        guard_steps=guard)

    def _emit(self, stage: str, *, step: int, seconds: float = 0.0, error: str = "", steps=(),
              detail: str = "") -> None:
        detail = detail or error or (f"deleted steps {', '.join(map(str, steps))}" if steps else "")
        self._emit_event(CheckpointEvent(rank=self.rank, generation=self.trainer.generation, step=step,
                                         stage=stage, seconds=seconds, detail=detail))

    # Saving ------------------------------------------------------------------
    def run_state(self, metrics: dict[str, float]) -> dict[str, Any]:
        t = self.trainer
        return {"version": RUN_STATE_VERSION, "step": t.step, "data_cursor": t.cursor,
                "data_epoch": t.cursor // t.source.samples_per_epoch,
                "skip_ranges": [list(r) for r in t.skips], "lr_overrides": [o.to_dict() for o in t.overrides],
                "config_hash": config_hash(self.cfg), "trajectory": trajectory_dict(self.cfg),
                "seeds": {"train": self.cfg.train.seed, "data": self.cfg.data.seed},
                "dp_world_size": self.world, "metrics": metrics}

    def save(self, metrics: dict[str, float]) -> None:
        """Copies this rank's share to host memory (the only blocking part) and hands it to the writer.

        asnumpy() is a view of the live parameter, so a copy is needed; it goes into staging
        buffers allocated once and reused, which is safe because the previous save is finished
        first (ready), and much faster than fresh allocations (no page faults)."""
        step = self.trainer.step
        self.writer.ready(step)
        started = time.monotonic()
        mine = self._staging
        for p in self.params:
            if self.plan[p.name] == self.rank:
                view = p.asnumpy()
                if p.name not in mine:
                    mine[p.name] = np.empty_like(view)
                np.copyto(mine[p.name], view)
        versions = {"llm_pretrain": "0.1.0", "mindspore": ms.__version__, "numpy": np.__version__,
                    "safetensors": safetensors.__version__, "python": platform.python_version()}
        self.writer.save(step, mine, run_state=self.run_state(metrics) if self.rank == 0 else None,
                         versions=versions)
        self._emit("staged", step=step, seconds=time.monotonic() - started)

    def wait(self) -> bool:
        """Blocks until this rank's save in flight (and, on rank 0, its commit) is done; True if it succeeded."""
        self.writer.wait()
        return self.writer.last_error is None

    # Restoring ---------------------------------------------------------------
    def restore_latest(self, *, allow_config_change: bool = False) -> dict[str, Any] | None:
        """Loads the newest verified checkpoint into the trainer; returns its run state, or None if there is none."""
        if self.rank == 0:
            for name in layout.remove_temporaries(self.root):
                self._emit("removed", step=layout.parse_step(name.removesuffix(".tmp")) or 0,
                           detail=f"removed {name}, left by an interrupted save")

        def quarantined(path: Path, problems: list[str]) -> None:
            self._emit("quarantined", step=layout.parse_step(path.name) or 0, detail="; ".join(problems))

        started = time.monotonic()
        found = reader.find_latest(self.root, on_quarantine=quarantined)
        if found is None:
            return None
        path, manifest = found
        state = manifest["run_state"]
        if state.get("config_hash") != config_hash(self.cfg) and not allow_config_change:
            changed = _changed_keys(state.get("trajectory", {}), trajectory_dict(self.cfg))
            raise ConfigError(f"checkpoint {path} was trained with other trajectory-defining settings "
                              f"({', '.join(changed) or 'config hash differs'}); restore the config or pass "
                              "--allow-config-change to resume anyway")
        set_parameters(self.params, reader.load_tensors(path, manifest), source=str(path),
                       error=checkpointing.CheckpointError)
        t = self.trainer
        t.step, t.cursor = state["step"], state["data_cursor"]
        t.set_skips([tuple(r) for r in state["skip_ranges"]])
        t.overrides = [schedule.LrOverride.from_dict(o) for o in state["lr_overrides"]]
        self._emit("restored", step=t.step, seconds=time.monotonic() - started, detail=str(path))
        return state
