"""The learning rate as a pure function of the step: linear warmup, cosine to a floor, overrides.

Owns: `lr_at` and `LrOverride`. No MindSpore, no state: a resumed run gets
exactly the same lr at every step as an uninterrupted one, given the same
overrides (which checkpoints and run state carry as plain JSON).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable


@dataclasses.dataclass(frozen=True, kw_only=True)
class LrOverride:
    """A temporary lr cut: `factor` from `start_step` for `hold_steps`, then a linear ramp back to 1."""

    start_step: int
    factor: float
    hold_steps: int
    ramp_steps: int

    def __post_init__(self) -> None:
        if not 0.0 < self.factor <= 1.0 or self.start_step < 1 or self.hold_steps < 0 or self.ramp_steps < 0:
            raise ValueError(f"invalid lr override {self}: needs 0 < factor <= 1, start_step >= 1, "
                             "hold_steps >= 0, ramp_steps >= 0")

    def multiplier(self, step: int) -> float:
        held_until = self.start_step + self.hold_steps
        if step < self.start_step:
            return 1.0
        if step < held_until:
            return self.factor
        if step < held_until + self.ramp_steps:
            return self.factor + (1.0 - self.factor) * (step - held_until) / self.ramp_steps
        return 1.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LrOverride":
        return cls(**data)


def base_lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, cosine_steps: int) -> float:
    """lr of the 1-based optimizer step `step` before overrides."""
    if step < 1:
        raise ValueError(f"step numbers start at 1, got {step}")
    if step <= warmup_steps:
        return lr * step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / cosine_steps)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, cosine_steps: int,
          overrides: Iterable[LrOverride] = ()) -> tuple[float, float]:
    """(lr, multiplier) of step `step`; overrides in force compound multiplicatively."""
    multiplier = 1.0
    for override in overrides:
        multiplier *= override.multiplier(step)
    base = base_lr_at(step, lr=lr, min_lr=min_lr, warmup_steps=warmup_steps, cosine_steps=cosine_steps)
    return base * multiplier, multiplier
