"""AdamW with bias correction and decoupled weight decay, computed like torch.optim.AdamW.

Owns: the optimizer state (first and second moments, the applied-update count)
as MindSpore Parameters named `adam_m.<param>`, `adam_v.<param>`, `adam_step`,
and the update, traced into the caller's jit-compiled step. Written here rather
than taken from MindSpore: `nn.AdamWeightDecay` has no bias correction and
`mint.optim.AdamW` has no CPU kernel; owning the state also gives checkpoints
stable names. An update is applied only where `apply` is true: a skipped step
leaves parameters, moments and the count bit-identical.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from contracts.config import OptimConfig


def decays(param: Parameter) -> bool:
    """Weight decay on matrices and embeddings, none on norm weights and biases (nanoGPT's rule)."""
    return len(param.shape) >= 2


def moments(params: list[Parameter], prefix: str) -> ParameterTuple:
    """Zeros shaped like each weight, named `<prefix>.<weight>`, made as clones of the weights: under
    semi-auto parallel MindSpore gives an optimizer state its weight's slice (tp, optimizer sharding)
    only if it is a clone (as its own AdamWeightDecay makes them); a new Parameter of the full shape
    would not match the sliced gradient at compile, and would hold the whole model per device."""
    out = []
    for p in params:
        if p.dtype != ms.float32:
            raise ValueError(f"parameter {p.name} is {p.dtype}: the optimizer keeps fp32 master weights")
        m = p.clone(init="zeros")
        m.name, m.requires_grad = f"{prefix}.{p.name}", False
        out.append(m)
    return ParameterTuple(out)


class AdamW(nn.Cell):
    def __init__(self, params: list[Parameter], cfg: OptimConfig):
        super().__init__(auto_prefix=False)
        self.params = ParameterTuple(params)
        self.cfg = cfg
        self.decays = tuple(decays(p) for p in params)
        self.exp_avg = moments(params, "adam_m")
        self.exp_avg_sq = moments(params, "adam_v")
        self.step = Parameter(Tensor(0, ms.int32), name="adam_step", requires_grad=False)
        self.adam = ops.AdamWeightDecay()

    def state(self) -> list[Parameter]:
        return [*self.exp_avg, *self.exp_avg_sq, self.step]

    def update(self, grads, lr, apply):
        """Traced inside a jit step: one AdamW update of every parameter, only if `apply`.

        Uses the fused AdamWeightDecay kernel (m/(sqrt(v)+eps) + decay*p, times lr),
        which has no bias correction; folding it into the kernel's inputs gives torch's
        update exactly: lr' = lr*sqrt(bc2)/bc1, eps' = eps*sqrt(bc2), decay' = wd*bc1/sqrt(bc2),
        so lr'*decay' = lr*wd (decoupled decay). The graph-level branch leaves every
        parameter, moment and the count untouched on a skipped step.
        """
        done = apply
        if apply:
            b1, b2 = self.cfg.beta1, self.cfg.beta2
            step = self.step + 1
            t = step.astype(ms.float32)
            bias1 = 1.0 - ops.pow(b1, t)
            bias2_sqrt = ops.sqrt(1.0 - ops.pow(b2, t))
            lr_k = lr * bias2_sqrt / bias1
            eps_k = self.cfg.eps * bias2_sqrt
            decay_k = self.cfg.weight_decay * bias1 / bias2_sqrt
            no_decay = decay_k * 0.0
            done = ops.depend(done, ops.assign(self.step, step))
            for p, g, m, v, wd_on in zip(self.params, grads, self.exp_avg, self.exp_avg_sq, self.decays):
                decay = decay_k if wd_on else no_decay
                done = ops.depend(done, self.adam(p, m, v, lr_k, b1, b2, eps_k, decay, g))
        return done
