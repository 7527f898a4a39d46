"""What both training steps share: the state every step holds (model, AdamW, loss scaler), how a
step ends (clip, update unless not finite, adjust the scale), and the result a step reports.

The data-parallel step (engine/training/step.py) and the semi-auto one
(engine/training/sharded_step.py) both build on it; neither imports the other's module for it.
"""
from __future__ import annotations

import dataclasses

from mindspore import Parameter, ParameterTuple, nn, ops

from contracts.config import Config
from engine.model.causal_lm import CausalLM
from engine.training.loss_scale import LossScaler
from engine.training.optim import AdamW


@dataclasses.dataclass(frozen=True)
class StepResult:
    loss: float          # global mean loss, unscaled
    grad_norm: float     # global norm of the unscaled, unclipped gradients
    loss_scale: float    # the scale this step ran with
    skipped: bool        # update not applied (non-finite gradients)
    control: tuple[int, ...] = ()   # the control vector, summed over ranks (see engine.rank.trainer.train)
    sync_s: float = 0.0  # seconds in the graph holding the collectives (fused step, or the finishing update)
    rank_losses: list[float] | None = None      # data parallel: each rank's own loss (its share's mean) ...
    rank_grad_norms: list[float] | None = None  # ... and its own gradients' norm, unscaled, before the sum


class StepState(nn.Cell):
    """What every step holds — the model, its parameters, AdamW, the loss scaler — and how a step
    ends: clip to the global norm, update unless the gradients were not finite, adjust the scale."""

    def __init__(self, net: CausalLM, cfg: Config):
        # auto_prefix=False keeps the model's parameter names (Hugging Face's) unprefixed.
        super().__init__(auto_prefix=False)
        self.net = net
        self.params = ParameterTuple(net.trainable_params())
        self.optimizer = AdamW(self.params, cfg.optim)
        self.scaler = LossScaler(cfg.train)
        self.grad_clip = cfg.optim.grad_clip

    def _clip_and_update(self, grads, grad_norm, finite, lr):
        """Traced: returns (done, the scale this step ran with)."""
        if self.grad_clip > 0:
            coef = ops.minimum(self.grad_clip / (grad_norm + 1e-6), 1.0)
            grads = [g * coef for g in grads]
        return self._update(grads, finite, lr)

    def _update(self, grads, finite, lr):
        """Traced: AdamW with these (clipped) gradients unless not finite; the loss scale follows."""
        scale_used = self.scaler.scale * 1.0
        done = self.optimizer.update(grads, lr, finite)
        return ops.depend(done, self.scaler.adjust(finite)), scale_used

    def state(self) -> list[Parameter]:
        """Everything a checkpoint must hold besides the model's parameters."""
        return [*self.optimizer.state(), *self.scaler.state()]
