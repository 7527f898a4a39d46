"""When a rank counts as hung: phase-aware, adaptive timeouts. Pure: the caller passes the time.

A rank is hung when it makes no progress (no event at all) for longer than its
phase allows: from start to its first event, `hang_start_timeout_s`; while
compiling (the first step) or evaluating, `hang_compile_timeout_s`; while training,
max(hang_floor_s, hang_step_multiplier × p99 of the step times seen so far);
while saving its last checkpoint, `hang_checkpoint_timeout_s`; never while
paused. Compile, restore and checkpoint are never judged by step times, so
they raise no false alarm.
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque

from contracts.config import HealthConfig


@dataclasses.dataclass
class RankProgress:
    phase: str = "starting"       # "starting" until the first event, then the worker's PhaseEvent phases
    since_s: float = 0.0          # time of the last sign of progress (any event)
    step: int = 0


class StepTimes:
    """Recent step durations (the first step of a generation, which compiles, is left out)."""

    def __init__(self, window: int = 500):
        self._times: deque[float] = deque(maxlen=window)

    def add(self, step_s: float) -> None:
        if math.isfinite(step_s) and step_s >= 0:
            self._times.append(step_s)

    def p99(self) -> float | None:
        if not self._times:
            return None
        ordered = sorted(self._times)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def timeout_s(phase: str, cfg: HealthConfig, steps: StepTimes) -> float:
    if phase in ("starting", "restore"):
        return cfg.hang_start_timeout_s
    if phase in ("compile", "eval"):             # the validation graph compiles at its first use
        return cfg.hang_compile_timeout_s
    if phase in ("checkpoint", "exiting"):
        return cfg.hang_checkpoint_timeout_s
    if phase == "paused":
        return math.inf
    p99 = steps.p99()
    if p99 is None:                       # no clean step yet: the first one still compiles
        return max(cfg.hang_floor_s, cfg.hang_compile_timeout_s)
    return max(cfg.hang_floor_s, cfg.hang_step_multiplier * p99)


def is_hung(progress: RankProgress, now_s: float, cfg: HealthConfig, steps: StepTimes) -> tuple[bool, float]:
    """(hung?, the timeout that applied)."""
    limit = timeout_s(progress.phase, cfg, steps)
    return now_s - progress.since_s > limit, limit
