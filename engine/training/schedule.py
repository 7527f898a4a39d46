"""The learning rate as a pure function of the step: linear warmup, cosine to a floor, overrides.

Owns: `lr_at`. (LrOverride, which the supervisor decides and the schedule
applies, is a message: it lives in contracts.protocol.) No MindSpore, no state:
a resumed run gets exactly the same lr at every step as an uninterrupted one,
given the same overrides (which checkpoints and run state carry as plain JSON).
"""
from __future__ import annotations

import math
from typing import Iterable

from contracts.protocol import LrOverride  # the supervisor decides overrides; the schedule applies them


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
