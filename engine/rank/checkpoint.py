"""The trainer's state as a checkpoint: what is saved, from which rank, and how it comes back.

Owns the adaptation between the trainer's state and the `checkpointing`
package: the tensors it is given (model parameters, AdamW moments and count,
loss-scaler state; named as in the model, `adam_m.<name>`, `adam_v.<name>`, …),
which rank writes which (a size-balanced split every rank computes alike), the
manifest's run state (the trainer's own — step, data cursor and epoch, skip
ranges, lr overrides, from its `run_state()` — plus what this adapter adds:
format version, config hash and trajectory, seeds, world size, metrics at
save, the parallel layout), restoring all of it — into any data-parallel world
size, since every rank loads every tensor — and, when asked to, retention after
each commit. Under semi-auto parallel (engine.layout.parallel) each rank holds slices:
it saves all of its own, named `rank<r>/<name>`, and loads them back only into
the same layout, after the step has been compiled (which slices the
parameters); whole tensors load into any layout before that compile.
It never touches the trainer itself: it is handed its parameters and its
run_state/load_run_state pair.
"""
from __future__ import annotations

import platform
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import mindspore as ms
import numpy as np
import safetensors

import checkpointing
from checkpointing import checksums, layout, partition, parts, reader, retention
from checkpointing.staging_copy import StagingCopier
from checkpointing.writer import ShardWriter
from checkpointing.writer_process import ProcessShardWriter
from contracts.config import Config, config_hash, trajectory_dict
from contracts.errors import ConfigError
from contracts.protocol import CheckpointEvent
from engine.layout import parallel
from engine.model import fused_cpu
from engine.rank.resume_check import changed_keys

RUN_STATE_VERSION = 1
MEMORY_KEEP = 2          # RAM checkpoints kept alone: the newest, and the one before while the next is written


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
        p.set_data(ms.Tensor(tensors[p.name]), p.sliced)    # a slice stays a slice: a recompile must not cut it again


def held(params: Sequence[ms.Parameter]) -> list[ms.Parameter]:
    """The parameters a rank holds under semi-auto, once its step is compiled: MindSpore marks each of
    its stage's parameters `sliced` (split or replicated alike); another pipeline stage's are never
    trained here and stay unmarked (MindSpore's own saver passes over them too)."""
    return [p for p in params if p.sliced and not p.param_info.is_pipeline_shared_param]


class TrainerCheckpoints:
    def __init__(self, root: Path, cfg: Config, *, params: Sequence[ms.Parameter],
                 run_state: Callable[[], dict[str, Any]], load_run_state: Callable[[dict[str, Any]], None],
                 rank: int, world: int, generation: int, emit: Callable[[CheckpointEvent], None],
                 parallelism: parallel.Parallelism, retain: bool = False, supervised: bool = False,
                 local_world: int | None = None, node: int = 0):
        """`params`: every Parameter to save and restore; `run_state()` returns the trainer's
        non-tensor state (its "step" is the step saved) and `load_run_state` takes it back.
        `parallelism`: the generation's layout (sliced saves under semi-auto). `retain`: apply checkpoint.keep_last / keep_every_steps after each commit (only rank 0
        commits) — for a rank running alone; under the supervisor, retention is the supervisor's. `supervised`: under
        the daemon, which retires the RAM tier's checkpoints too (alone, its writer keeps the newest MEMORY_KEEP).
        `local_world`: the ranks on this machine (None: all of them), `node` its index (run.node_rank): the RAM
        tier is each machine's own, a whole checkpoint its own ranks write (each a share) and its first commits."""
        self.cfg, self.root = cfg, Path(root)
        self.rank, self.world, self.generation = rank, world, generation
        self._run_state, self._load_run_state = run_state, load_run_state
        self._emit_event = emit
        self.params, self.parallelism, self.sliced = list(params), parallelism, parallelism.semi_auto
        sizes = {p.name: int(np.prod(p.shape)) * p.data.itemsize for p in self.params}
        # whole tensors: each rank writes its share of them; slices: what it holds (`held`, once compiled)
        self.plan = {} if self.sliced else partition.assign(sizes, self.world)
        # the RAM tier's writers: this machine's ranks (rank // local_world its machine's slot, in order)
        self.local_world = local_world or self.world
        self.local_rank = self.rank % self.local_world
        self.node = node
        # checkpoint.memory_placement = "buddy" on several machines: the machine's ranks write the disk's plan's shares
        # of theirs alone, its part (checkpointing.parts); a buddy machine keeps a copy of it
        self.memory_part = ({"slot": self.rank // self.local_world, "slots": self.world // self.local_world,
                             "ranks_per_slot": self.local_world}
                            if cfg.checkpoint.memory_placement == "buddy" and self.local_world < self.world else None)
        self.memory_plan = (self.plan if self.sliced or self.local_world == self.world or self.memory_part
                            else partition.assign(sizes, self.local_world))
        self._last_size = (-1, 0)          # (step, bytes) of the newest committed checkpoint
        self.writer = ShardWriter(self.root, rank=self.rank, world=self.world, emit=self._emit,
                                  on_commit=self._retire if retain else None, checksum=cfg.checkpoint.checksum,
                                  direct=cfg.checkpoint.direct_io)
        # the RAM tier: the same checkpoints on a tmpfs, between disk saves; alone the newest two are kept, under the
        # daemon it retires them (daemon.processes.run_files.retire_memory: it keeps those an incident may need)
        self.memory_root = (layout.memory_root(self.root.parent, cfg.checkpoint.memory_dir, node)
                            if cfg.checkpoint.memory_interval_steps else None)
        # memory tier or not -> (its writer's staging buffers by name, [(parameter, its buffer)])
        self._copies: dict[bool, tuple[dict, list]] = {}
        # in a process of its own: as a thread, its Python held the GIL the step needed (checkpointing.writer_process)
        self.memory_rank = self.rank if self.memory_part else self.local_rank
        self.memory_writer = (ProcessShardWriter(self.memory_root, rank=self.memory_rank,
                                          world=self.world if self.memory_part else self.local_world,
                                          part=self.memory_part,
                                          emit=self._emit_memory, keep_last=None if supervised else MEMORY_KEEP,
                                          indent_manifest=False,
                                          checksum=checksums.CRC32C, recycle=True,
                                          latest_hint=False)
                              if self.memory_root is not None else None)
        self._views: dict[int, tuple[int, np.ndarray]] = {}   # id(parameter) -> (data_ptr, view): _host_value
        self._views_live = cfg.train.device == "cpu"
        self._copier = StagingCopier(fused_cpu.threads() if self._views_live else 1)   # the step's own cores
        # what every save's run state and manifest say alike, once (config_hash alone cost a RAM save 0.7 ms)
        self._fixed_run_state = {"config_hash": config_hash(cfg), "trajectory": trajectory_dict(cfg),
                                 "seeds": {"train": cfg.train.seed, "data": cfg.data.seed},
                                 "dp_world_size": self.world, "parallel_layout": parallelism.checkpoint_layout}
        self._versions = {"llm_pretrain": "0.1.0", "mindspore": ms.__version__, "numpy": np.__version__,
                          "safetensors": safetensors.__version__, "python": platform.python_version()}

    def _retire(self, step: int) -> None:
        """After the commit of `step`, on the writer's thread."""
        c = self.cfg.checkpoint
        doomed = retention.retire_old(self.root, keep_last=c.keep_last, keep_every=c.keep_every_steps)
        if doomed:
            self._emit("retired", step=step, steps=doomed)

    def _emit(self, stage: str, *, step: int, seconds: float = 0.0, error: str = "", steps=(),
              detail: str = "") -> None:
        detail = detail or error or (f"deleted steps {', '.join(map(str, steps))}" if steps else "")
        self._emit_event(CheckpointEvent(rank=self.rank, generation=self.generation, step=step,
                                         stage=stage, seconds=seconds, detail=detail))

    def _emit_memory(self, stage: str, *, step: int, seconds: float = 0.0, error: str = "", steps=(),
                     detail: str = "") -> None:
        """The RAM tier's progress, told apart from the disk's: only its commits and failures."""
        if stage in ("committed", "failed"):
            self._emit("in_memory" if stage == "committed" else "in_memory_failed", step=step, seconds=seconds,
                       error=error, detail=detail or (str(self.memory_root) if stage == "committed" else ""))

    # Saving ------------------------------------------------------------------
    def manifest_run_state(self, trainer_state: dict[str, Any], metrics: dict[str, float]) -> dict[str, Any]:
        """The manifest's run_state: the trainer's keys (step, data_cursor, data_epoch, skip_ranges,
        lr_overrides) and this adapter's; its keys are the format old checkpoints were saved in."""
        return {"version": RUN_STATE_VERSION, **trainer_state, **self._fixed_run_state, "metrics": metrics}

    def save(self, metrics: dict[str, float], *, memory: bool = False) -> None:
        """Copies this rank's share to host memory (the only blocking part) and hands it to the writer
        (`memory`: the RAM tier's).

        asnumpy() is a view of the live parameter, so a copy is needed; it goes into the writer's
        staging buffers, allocated once and reused, which is safe because the previous save is
        finished first (ready), and much faster than fresh allocations (no page faults). The RAM
        tier's are memory its writer process shares. The copy runs on this machine's share of its
        CPUs (checkpointing.staging_copy): the step waits for it, so nothing else needs them."""
        state = self._run_state()
        step = state["step"]
        writer = self.memory_writer if memory else self.writer
        writer.ready(step)
        if not memory and (short := self._space_short()) is not None:
            self.writer.refuse(step, short)          # this save failed, said early (and to the committer)
            self._emit("failed", step=step, error=short)
            return
        started = time.monotonic()
        if memory not in self._copies:                 # this rank's parameters, each with its buffer
            plan, me = (self.memory_plan, self.memory_rank) if memory else (self.plan, self.rank)
            owned = ([(p, f"rank{self.rank}/{p.name}") for p in held(self.params)] if self.sliced else
                     [(p, p.name) for p in self.params if plan[p.name] == me])
            buffers = writer.staging({name: p.asnumpy() for p, name in owned})   # semi-auto: this rank's slices
            self._copies[memory] = (buffers, [(p, buffers[name]) for p, name in owned])
        mine, copies = self._copies[memory]
        if self._views_live:                           # the CPU: views of the live parameters, on the rank's threads
            self._copier.copy([(self._host_value(p), buffer) for p, buffer in copies])
        else:                                          # a device: each host copy gone before the next is made
            for p, buffer in copies:
                np.copyto(buffer, self._host_value(p))
        commits = (self.local_rank if memory else self.rank) == 0
        writer.save(step, mine, run_state=self.manifest_run_state(state, metrics) if commits else None,
                    versions=self._versions)
        if not memory:
            self._emit("staged", step=step, seconds=time.monotonic() - started)
        elif self.cfg.checkpoint.memory_interval_steps == "auto":     # the daemon times the RAM tier's saves too
            self._emit_event(CheckpointEvent(rank=self.rank, generation=self.generation, step=step,
                                             stage="staged_in_memory", seconds=time.monotonic() - started), log=False)

    def _host_value(self, p: ms.Parameter) -> np.ndarray:
        """p's value on the host. On the CPU, asnumpy() is a view of the parameter's live memory, which
        the step updates in place: the view is kept while p.data_ptr() says the memory is still
        where it was (0.5 us against asnumpy's 10: numpy parses the buffer's format in Python; 0.6 ms
        of a tiny RAM save's 1 ms, measured), and made again when it moved (set_data, a restore).
        On a device, asnumpy() each time: it is the copy from the device."""
        if not self._views_live:
            return p.asnumpy()
        address = p.data_ptr()
        kept = self._views.get(id(p))          # (not p.name: a Python property, 3 us)
        if kept is None or kept[0] != address:
            view = p.asnumpy()
            if view.ctypes.data != address:     # a copy, not a view: none is ever kept
                self._views_live = False
                return view
            kept = self._views[id(p)] = (address, view)
        return kept[1]

    def _space_short(self) -> str | None:
        """Why a save cannot fit, if it cannot: less space free than the last checkpoint took. Saves
        are tried again at each interval, so they resume by themselves when space comes back."""
        steps = layout.committed_steps(self.root)
        if not steps:
            return None
        if self._last_size[0] != steps[-1]:
            try:
                manifest = reader.read_manifest(layout.step_dir(self.root, steps[-1]))
            except checkpointing.CheckpointError:
                return None
            self._last_size = (steps[-1], sum(sh["size_bytes"] for sh in manifest["shards"]))
        needed, free = self._last_size[1], shutil.disk_usage(self.root).free
        if free >= needed:
            return None
        return (f"not enough free space for a checkpoint: {free:,} bytes free under {self.root}, the last one "
                f"took {needed:,}; saving is tried again at the next interval")

    def poll(self) -> None:
        """Passes on what the RAM tier's writer process has told so far (its commits), without waiting:
        once a step, so its events are as timely as a thread's (a read that finds nothing: ~2 us)."""
        if self.memory_writer is not None:
            self.memory_writer.poll()

    def wait(self) -> bool:
        """Blocks until this rank's save in flight (and, on rank 0, its commit) is done; True if it succeeded."""
        if self.memory_writer is not None:
            self.memory_writer.wait()
        self.writer.wait()
        return self.writer.last_error is None

    def drop_memory_tier(self) -> None:
        """The run ended with its final checkpoint on disk: the RAM tier only holds memory now (each machine's first
        rank)."""
        if self.memory_root is not None and self.local_rank == 0:
            if self.memory_writer is not None:
                self.memory_writer.close()
            shutil.rmtree(self.memory_root, ignore_errors=True)

    # Restoring ---------------------------------------------------------------
    def _find(self, corrupt: Callable[[Path, list[str]], None], agreed_step: int | None):
        """The checkpoint to restore (restore_latest): the newest verified one, or exactly `agreed_step`."""
        # several machines' RAM tiers may hold different newest steps: one is resumed from only where the daemons
        # agreed on it (without them, as under msrun alone, every machine resumes from the disk)
        memory = self.memory_root if agreed_step is not None or self.local_world == self.world else None
        found = reader.find_newest(self.root, memory, on_corrupt=corrupt, at_most=agreed_step, accept=lambda m: (
            parts.is_whole(m)                     # a machine's part: whole once the daemons brought the rest
            and m["run_state"].get("config_hash") == config_hash(self.cfg)
            and not parallel.resume_refusal(m["run_state"].get("parallel_layout"), self.parallelism)))
        got = found[1]["run_state"]["step"] if found else 0
        if agreed_step is not None and got != agreed_step:
            raise checkpointing.CheckpointError(
                f"the run's machines agreed to resume from step {agreed_step}, and this machine (node {self.node}) "
                f"cannot load it: " + (f"its newest is step {got}" if found else "it finds no checkpoint")
                + f" (a RAM copy that failed its checksum is set aside as step-N.corrupt under {self.memory_root}; "
                "the daemons agree on another step next)")
        return found

    def restore_latest(self, *, allow_config_change: bool = False,
                       before_slices: Callable[[], None] | None = None,
                       agreed_step: int | None = None) -> dict[str, Any] | None:
        """Loads the newest verified checkpoint into the parameters and (load_run_state) the trainer;
        returns its run state, or None if there is none. `before_slices` runs before a sliced
        checkpoint loads (it compiles the step, which slices the parameters). `agreed_step`: the step the
        run's machines agreed to resume from (ENV_RESUME_STEP): that one, from this machine's RAM tier or the
        disk; none newer is looked at, and where it cannot be loaded here (a RAM copy that fails its checksum,
        set aside) CheckpointError, for no machine may resume from another step than the others."""
        if self.rank == 0:
            for name in layout.remove_temporaries(self.root):
                self._emit("removed", step=layout.parse_step(name.removesuffix(".tmp")) or 0,
                           detail=f"removed {name}, left by an interrupted save")
        if self.local_rank == 0 and self.memory_root is not None:
            layout.remove_temporaries(self.memory_root)

        def corrupt(path: Path, problems: list[str]) -> None:
            self._emit("corrupt", step=layout.parse_step(path.name) or 0, detail="; ".join(problems))

        started = time.monotonic()
        found = self._find(corrupt, agreed_step)
        if found is None:
            return None
        path, manifest = found
        state = manifest["run_state"]
        if state.get("config_hash") != config_hash(self.cfg) and not allow_config_change:
            changed = changed_keys(state.get("trajectory", {}), trajectory_dict(self.cfg))
            raise ConfigError(f"checkpoint {path} was trained with other trajectory-defining settings "
                              f"({', '.join(changed) or 'config hash differs'}); restore the config or pass "
                              "--allow-config-change (`run` or `train`) to resume anyway")
        saved_layout = state.get("parallel_layout")
        refusal = parallel.resume_refusal(saved_layout, self.parallelism)
        if refusal:
            raise ConfigError(f"checkpoint {path} cannot be resumed: {refusal}")
        if saved_layout and saved_layout.get("sliced"):
            if before_slices is not None:
                before_slices()
            prefix = f"rank{self.rank}/"
            mine = reader.load_tensors(path, manifest, shard=layout.shard_name(self.rank, manifest["world_size"]))
            tensors = {n.removeprefix(prefix): a for n, a in mine.items() if n.startswith(prefix)}
            params = held(self.params)
            if not params:
                raise checkpointing.CheckpointError(f"{path} holds slices, and no parameter of rank {self.rank} is "
                                                    "sliced yet: the step must be compiled before it loads")
        else:
            tensors, params = reader.load_tensors(path, manifest), self.params
        set_parameters(params, tensors, source=str(path), error=checkpointing.CheckpointError)
        self._load_run_state(state)
        self._emit("restored", step=state["step"], seconds=time.monotonic() - started, detail=str(path))
        return state
