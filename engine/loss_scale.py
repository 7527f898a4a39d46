"""Dynamic loss scaling for fp16; a constant scale of 1 in fp32 and bf16.

Owns: the scaler's state as Parameters (`loss_scale`, `loss_scale_good_steps`,
`loss_scale_cap`) and its update rule, traced into the jit step. The rule is
amp.DynamicLossScaler's (halve on overflow, double after a window of clean
steps) plus two things it lacks: a floor (`train.loss_scale_min`; a scale stuck
there is a health signal) and a cap on growth, which the recovery policy sets
after an overflow storm and checkpoints carry.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from engine.config import TrainConfig


class LossScaler(nn.Cell):
    def __init__(self, cfg: TrainConfig):
        super().__init__(auto_prefix=False)
        self.dynamic = cfg.precision == "fp16"
        self.window = cfg.loss_scale_window_steps
        self.floor = cfg.loss_scale_min
        init = cfg.loss_scale_init if self.dynamic else 1.0
        self.scale = Parameter(Tensor(init, ms.float32), name="loss_scale", requires_grad=False)
        self.good_steps = Parameter(Tensor(0, ms.int32), name="loss_scale_good_steps", requires_grad=False)
        self.cap = Parameter(Tensor(float("inf"), ms.float32), name="loss_scale_cap", requires_grad=False)

    def state(self) -> list[Parameter]:
        return [self.scale, self.good_steps, self.cap]

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
