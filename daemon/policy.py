"""The recovery policy: a pure function from (incident, run history, config) to an action.

DESIGN.md's ladder:
- crash, hang: restart from the latest committed checkpoint; after
  `max_restarts_without_progress` restarts without a new checkpoint, give up (exit 3);
- loss spike (and grad-norm spike when set to act), non-finite in fp32/bf16: roll back to the
  newest healthy checkpoint before the incident began, skip the sample window the incident's
  steps consumed, and cut the lr (× lr_cut_factor, held, then ramped back); a recurrence within
  `recur_window_steps` compounds the cut; below `lr_floor_factor`, give up (exit 4);
- fp16 overflow storm: roll back and restart at a lower loss scale (the storm's starting scale ×
  loss_scale_cut, compounding likewise) with its growth capped for a while; below the scale floor,
  handle it as a non-finite incident of fp32;
- out of memory: restart with recompute on; if it already is, halve the micro-batch and double
  accumulation (the global batch stays); with nothing smaller to try, give up (exit 3).
Warnings need no action (None). Checkpoint health is derived from the incident log, never stamped.
No clocks, files or processes here.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from daemon.protocol import ExitCode, LrOverride
from engine.config import Config

NUMERIC = ("loss_spike", "grad_norm_spike", "non_finite")


@dataclasses.dataclass(frozen=True)
class Restart:
    reason: str
    config_changes: dict[str, Any] = dataclasses.field(default_factory=dict)   # --set overrides for the ranks


@dataclasses.dataclass(frozen=True)
class Rollback:
    reason: str
    checkpoint_step: int                      # resume from this committed step (0: from scratch)
    skip: tuple[int, int] | None              # global sample range [a, b) never to train on again
    lr_overrides: tuple[LrOverride, ...]      # the complete list in force after the rollback
    loss_scale: float | None = None           # fp16: restart at this scale ...
    loss_scale_cap_until_step: int | None = None   # ... and grow no higher until this step


@dataclasses.dataclass(frozen=True)
class Halt:
    reason: str
    code: int


Action = Restart | Rollback | Halt


@dataclasses.dataclass(frozen=True)
class RunHistory:
    """What the policy may look at: facts the supervisor keeps in state.json."""

    incidents: Sequence[dict[str, Any]] = ()      # earlier incidents: kind, first_step, last_step (acted on)
    committed_steps: Sequence[int] = ()           # committed checkpoints
    restarts_without_progress: int = 0            # counting the incident being decided
    recompute: bool = False
    micro_batch: int = 1
    grad_accum_steps: int = 1
    sample_ranges: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)  # step -> [a, b)


def is_healthy(step: int, incidents: Sequence[dict[str, Any]], margin: int) -> bool:
    """A checkpoint is unhealthy if its step lies inside an incident or within `margin` before its start."""
    return not any(i["first_step"] - margin <= step <= i["last_step"] for i in incidents if i.get("numeric", True))


def newest_healthy(committed: Sequence[int], incidents: Sequence[dict[str, Any]], margin: int,
                   before_step: int | None = None) -> int:
    """The newest healthy committed step (below `before_step` if given); 0 when none (start over)."""
    healthy = [s for s in committed if is_healthy(s, incidents, margin) and (before_step is None or s < before_step)]
    return max(healthy, default=0)


def _recurrences(kinds: Sequence[str], incident: dict[str, Any], history: RunHistory, window: int) -> int:
    # absolute distance: after a rollback the run replays steps, so a recurrence may start earlier
    return sum(1 for h in history.incidents
               if h["kind"] in kinds and abs(incident["first_step"] - h["first_step"]) <= window)


def decide(incident: dict[str, Any], history: RunHistory, cfg: Config) -> Action | None:
    h = cfg.health
    kind = incident["kind"]
    if not incident.get("action_needed", True):
        return None
    if kind in ("crash", "hang"):
        if history.restarts_without_progress >= h.max_restarts_without_progress:
            return Halt(f"{history.restarts_without_progress} restarts without a new checkpoint",
                        ExitCode.GAVE_UP_CRASH_LOOP)
        return Restart(f"{kind}: restart from the latest committed checkpoint")
    if kind == "oom":
        if not history.recompute:
            return Restart("out of memory: recompute on", {"train.recompute": True})
        if history.micro_batch > 1 and history.micro_batch % 2 == 0:
            micro, accum = history.micro_batch // 2, history.grad_accum_steps * 2
            return Restart(f"out of memory with recompute on: micro-batch {history.micro_batch} -> {micro}, "
                           f"accumulation {history.grad_accum_steps} -> {accum}",
                           {"train.micro_batch": micro, "train.grad_accum_steps": accum})
        return Halt(f"out of memory at micro-batch {history.micro_batch} with recompute on: nothing smaller fits",
                    ExitCode.GAVE_UP_CRASH_LOOP)
    everything = [*history.incidents, {**incident, "numeric": True}]
    target = newest_healthy(history.committed_steps, everything, h.rollback_margin_steps,
                            before_step=incident["first_step"] - h.rollback_margin_steps)
    if kind == "overflow_storm":
        n = _recurrences(("overflow_storm",), incident, history, h.recur_window_steps) + 1
        start_scale = incident.get("evidence", {}).get("storm_start_scale") or cfg.train.loss_scale_init
        scale = start_scale * h.loss_scale_cut ** n
        if scale >= cfg.train.loss_scale_min:
            return Rollback(f"fp16 overflow storm #{n}: loss scale {start_scale:g} -> {scale:g}, growth capped",
                            checkpoint_step=target, skip=None, lr_overrides=(), loss_scale=scale,
                            loss_scale_cap_until_step=target + h.loss_scale_cap_steps)
        kind = "non_finite"               # no scale left to lower: treat it like fp32's non-finite
    if kind in NUMERIC:
        n = _recurrences(NUMERIC, incident, history, h.recur_window_steps) + 1
        factor = h.lr_cut_factor ** n
        if factor < h.lr_floor_factor:
            return Halt(f"{kind} #{n} within {h.recur_window_steps} steps: an lr cut to x{factor:g} would pass "
                        f"the floor x{h.lr_floor_factor:g}", ExitCode.GAVE_UP_NUMERICS)
        first, last = incident["first_step"], incident["last_step"]
        seen = [r for step, r in history.sample_ranges.items() if first <= step <= last]
        skip = (min(a for a, _ in seen), max(b for _, b in seen)) if seen else None
        override = LrOverride(start_step=target + 1, factor=factor, hold_steps=h.lr_hold_steps,
                              ramp_steps=h.lr_ramp_steps)
        return Rollback(f"{kind} #{n}: roll back to step {target}, skip samples {skip}, lr x{factor:g}",
                        checkpoint_step=target, skip=skip, lr_overrides=(override,))
    raise ValueError(f"no policy for incident kind {kind!r}")
