"""Before anything is spawned: will this config resume the run's newest checkpoint, and on what schedule?

Owns the rules of resuming, read from the newest checkpoint that looks complete (its manifest is
JSON; no tensors are read, no MindSpore):
- training longer: `train.steps` alone never changes the trajectory. With `optim.cosine_steps = 0`
  ("decay until train.steps") the run keeps the schedule its checkpoints were trained on, as
  Megatron keeps `--lr-decay-iters` when `--train-iters` grows: raising train.steps trains on at
  `optim.min_lr` past the old end, and no step already trained changes its lr. A new decay length
  is a trajectory change: set `optim.cosine_steps` and pass --allow-config-change to `run` or `train`
  (the keys that changed are named in the note).
- a checkpoint saved in slices (semi-auto parallel) resumes only onto the layout that cut them;
- any other trajectory-defining difference is refused here, in one line naming the keys, instead
  of inside a rank after the cluster formed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from checkpointing import CheckpointError, layout, reader
from contracts.config import Config, config_hash, trajectory_dict, with_changes
from contracts.errors import ConfigError
from engine.layout.parallel import decide, resume_refusal


def newest_run_state(ckpt_root: Path) -> tuple[Path, dict[str, Any]] | None:
    for step in reversed(layout.committed_steps(ckpt_root)):
        path = layout.step_dir(ckpt_root, step)
        if reader.looks_complete(path):
            continue                     # the ranks will set it aside and load an older one
        try:
            return path, reader.read_manifest(path)["run_state"]
        except (CheckpointError, KeyError):
            continue
    return None


def changed_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    keys = []
    for section in sorted(set(saved) | set(current)):
        a, b = saved.get(section, {}), current.get(section, {})
        keys += [f"{section}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return keys


def keep_schedule(cfg: Config, saved_trajectory: dict[str, Any]) -> tuple[Config, str | None]:
    """With cosine_steps following train.steps, the checkpoint's resolved decay length instead."""
    saved = (saved_trajectory.get("optim") or {}).get("cosine_steps")
    if cfg.optim.cosine_steps or not isinstance(saved, int) or saved == cfg.cosine_steps:
        return cfg, None
    kept = with_changes(cfg, {"optim.cosine_steps": saved})
    end = cfg.optim.warmup_steps + saved
    past = f"; steps {end + 1}..{cfg.train.steps} train at optim.min_lr" if cfg.train.steps > end else ""
    return kept, (f"train.steps = {cfg.train.steps}: the lr schedule of the checkpoints is kept (cosine decay "
                  f"over {saved} steps after warmup, to step {end}){past}")


def check_resume(cfg: Config, ckpt_root: Path, *, allow_config_change: bool = False) -> tuple[Config, str | None]:
    """The config to resume with and a note for the operator; ConfigError when it cannot resume."""
    found = newest_run_state(ckpt_root)
    if found is None:
        return cfg, None
    path, state = found
    refusal = resume_refusal(state.get("parallel_layout"), decide(cfg))
    if refusal:
        raise ConfigError(f"checkpoint {path} cannot be resumed: {refusal}")
    cfg, note = keep_schedule(cfg, state.get("trajectory") or {})
    if state.get("config_hash") == config_hash(cfg):
        return cfg, note
    changed = ", ".join(changed_keys(state.get("trajectory") or {}, trajectory_dict(cfg))) or "config hash differs"
    if allow_config_change:
        allowed = f"resuming checkpoint {path} with changed trajectory-defining settings ({changed}), as allowed"
        return cfg, "; ".join(n for n in (allowed, note) if n)
    raise ConfigError(f"checkpoint {path} was trained with other trajectory-defining settings ({changed}); restore "
                      "them (`llm-pretrain config` prints what a config resolves to), start a new run.dir, or resume "
                      "with --allow-config-change (`run` or `train`)")
