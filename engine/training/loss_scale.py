"""Dynamic loss scaling for fp16; a constant scale of 1 in fp32 and bf16.

Owns: the scaler's state as Parameters (`loss_scale`, `loss_scale_good_steps`,
`loss_scale_cap`) and its update rule, traced into the jit step. The rule is
amp.DynamicLossScaler's (halve on overflow, double after a window of clean
steps) plus two things it lacks: a floor (`train.loss_scale_min`; a scale stuck
there is a health signal) and a cap on growth, which the recovery policy sets
after an overflow storm and checkpoints carry. Also owns what a recovery
directive does to that state (`after_recovery`, pure; `restart_at`, `set_cap`,
`lift_cap`): nothing outside this module writes the scaler's Parameters.
"""
from __future__ import annotations

from typing import NamedTuple

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from contracts.config import TrainConfig
from contracts.protocol import RecoveryDirective

UNCAPPED = float("inf")


class ScalePlan(NamedTuple):
    """What a recovery directive asks of a dynamic scaler, once the rank has restored."""

    restart_scale: float | None   # set the scale to this, counting clean steps afresh; None: keep the restored one
    cap: float | None             # grow no higher than this ...; None: uncapped (lifting a cap the checkpoint carried)
    cap_until_step: int           # ... until this step, when the loop lifts it; 0 when uncapped


def after_recovery(recovery: RecoveryDirective, *, restored_step: int, step: int) -> ScalePlan:
    """The scaler's part of `recovery` for a rank that restored `restored_step` and is now at `step`.

    The restart scale was chosen for the rollback target, so it applies only if this rank restored
    that very checkpoint (a later restart restores a later one, whose saved scale is newer). The
    cap applies while `step` is before its end; past it, any cap carried by the checkpoint goes."""
    restart = recovery.loss_scale if restored_step == recovery.checkpoint_step else None
    if recovery.loss_scale_cap is not None and step < recovery.loss_scale_cap_until_step:
        return ScalePlan(restart, recovery.loss_scale_cap, recovery.loss_scale_cap_until_step)
    return ScalePlan(restart, None, 0)


class LossScaler(nn.Cell):
    def __init__(self, cfg: TrainConfig):
        super().__init__(auto_prefix=False)
        self.dynamic = cfg.precision == "fp16"
        self.window = cfg.loss_scale_window_steps
        self.floor = cfg.loss_scale_min
        init = cfg.loss_scale_init if self.dynamic else 1.0
        self.scale = Parameter(Tensor(init, ms.float32), name="loss_scale", requires_grad=False)
        self.good_steps = Parameter(Tensor(0, ms.int32), name="loss_scale_good_steps", requires_grad=False)
        self.cap = Parameter(Tensor(UNCAPPED, ms.float32), name="loss_scale_cap", requires_grad=False)

    def state(self) -> list[Parameter]:
        return [self.scale, self.good_steps, self.cap]

    # Set from outside the step (recovery); a constant scale of 1 ignores them all.
    def restart_at(self, scale: float) -> None:
        """Sets the scale and restarts the count of clean steps before it may grow."""
        if self.dynamic:
            _overwrite(self.scale, scale)
            _overwrite(self.good_steps, 0)

    def set_cap(self, cap: float | None) -> None:
        """Caps the scale's growth at `cap` (None: uncapped); halving on overflow is never capped."""
        if self.dynamic:
            _overwrite(self.cap, UNCAPPED if cap is None else cap)

    def lift_cap(self) -> None:
        self.set_cap(None)

    def follow(self, plan: ScalePlan) -> int:
        """Applies a recovery's plan; returns the step at which the caller must lift_cap (0: never)."""
        if not self.dynamic:
            return 0
        if plan.restart_scale is not None:
            self.restart_at(plan.restart_scale)
        self.set_cap(plan.cap)
        return plan.cap_until_step

    def adjust(self, finite):
        """Traced inside a jit step, after the update: the scale for the next step."""
        if not self.dynamic:
            return finite
        good = self.good_steps + 1
        grow = good >= self.window
        grown = ops.minimum(ops.select(grow, self.scale * 2.0, self.scale), self.cap)
        halved = ops.maximum(self.scale * 0.5, Tensor(self.floor, ms.float32))
        new_scale = ops.select(finite, grown, halved)
        new_good = ops.select(ops.logical_and(finite, ops.logical_not(grow)), good, ops.zeros_like(good))
        done = ops.assign(self.scale, new_scale)
        return ops.depend(done, ops.assign(self.good_steps, new_good))


def _overwrite(param: Parameter, value: float) -> None:
    """Writes into the Parameter's existing tensor. set_data would swap in a new tensor, and a step
    compiled before that goes on reading the old one (MindSpore 2.10, graph mode: a cap "lifted"
    that way stayed in force, while checkpoints saved it as lifted)."""
    param.copy_(Tensor(value, param.dtype))
