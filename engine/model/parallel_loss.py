"""The next-token loss under semi-auto parallel (Ascend: tp, pp, sp or optimizer sharding).

Owns: `VocabParallelCrossEntropy`, the mean cross entropy written out of primitives each of which
keeps its single-device meaning when MindSpore splits it (engine/model/sharding.py sets their
strategies from engine.layout.parallel.loss_strategies).

Why not the CPU's fused SparseSoftmaxCrossEntropyWithLogits: MindSpore registers it as batch
parallel. It splits its rows over every device of the stage and each device returns the mean of
its own rows, with no communication; the mirror operators then sum those devices' gradients, so
the gradient would be dp·tp times the global mean's (the reported loss, averaged outside, would
still look right, and clipping would fire at grad_clip/(dp·tp)). Here every reduction is a sharded
primitive: the max and the sum of exponentials over the vocabulary split across tp (the logits are
never gathered to the full vocabulary: the compiler all-reduces the (rows, 1) partial results),
the target's logit picked by a one-hot split the same way, and the sum over rows split across dp
all-reduced; one division by the rows of the logical batch makes it the global mean, so the
gradient is the global mean's under any layout (MindFormers' CrossEntropyLoss does the same).

The max is a constant shift (logsumexp(x) = m + log Σ exp(x - m) for any m), so no gradient flows
through it. In stand-alone mode (the CPU's tests) the strategies are ignored and the cell gives the
fused op's loss and gradient to float rounding.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, nn, ops


class VocabParallelCrossEntropy(nn.Cell):
    """(B, T, vocab) logits, (B, T) targets → the mean next-token cross entropy over all B·T rows."""

    def __init__(self):
        super().__init__()
        self.max = ops.ReduceMax(keep_dims=True)       # (rows, vocab) → (rows, 1)
        self.shift = ops.Sub()                         # x − max
        self.exp = ops.Exp()
        self.sum_exp = ops.ReduceSum(keep_dims=True)   # Σ over the vocabulary
        self.log = ops.Log()                           # (rows, 1)
        self.one_hot = ops.OneHot()                    # the targets, as (rows, vocab)
        self.pick = ops.Mul()                          # shifted logits × one-hot
        self.sum_picked = ops.ReduceSum(keep_dims=True)
        self.nll = ops.Sub()                           # log Σ exp − picked, per row
        self.sum_rows = ops.ReduceSum()                # over every row: a scalar
        self.on, self.off = Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)

    def construct(self, logits, targets):
        vocab = logits.shape[-1]
        x = logits.reshape(-1, vocab).astype(ms.float32)
        shifted = self.shift(x, ops.stop_gradient(self.max(x, -1)))
        log_z = self.log(self.sum_exp(self.exp(shifted), -1))
        picked = self.sum_picked(self.pick(shifted, self.one_hot(targets.reshape(-1), vocab, self.on, self.off)), -1)
        per_row = self.nll(log_z, picked)
        return self.sum_rows(per_row) / per_row.shape[0]
