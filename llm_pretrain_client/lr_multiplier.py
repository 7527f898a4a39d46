"""The daemon's lr cut inside the script's optimizer: a LearningRateSchedule that is the script's own lr (a
number or a schedule cell) times a multiplier the client sets before each step (the product of the recovery
directive's lr overrides in force, contracts.protocol.LrOverride). The optimizer reads it in its graph, so the
cut is in the update itself, not only in what is reported."""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

NAME = "llm_pretrain_client.lr_multiplier"      # never saved: the directive, not a checkpoint, says what it is


class LrMultiplier(nn.learning_rate_schedule.LearningRateSchedule):
    def __init__(self, base):
        """`base`: the script's lr, a float or a LearningRateSchedule."""
        super().__init__()
        self.base = base
        self.fixed = not isinstance(base, nn.Cell)
        self.multiplier = ms.Parameter(ms.Tensor(1.0, ms.float32), name=NAME, requires_grad=False)

    def construct(self, global_step):
        base = self.base if self.fixed else self.base(global_step)
        return ops.cast(base, ms.float32) * self.multiplier

    def set(self, value: float) -> None:
        if float(self.multiplier.asnumpy()) != value:       # set_data only on a change: no copy per step
            self.multiplier.set_data(ms.Tensor(value, ms.float32))

    def base_lr(self, step: int) -> float:
        """The script's own lr at 0-based optimizer step `step` (what the report multiplies)."""
        if self.fixed:
            return float(self.base)
        return float(self.base(ms.Tensor(step, ms.int32)).asnumpy())
