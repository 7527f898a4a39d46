"""The accumulated gradients of a step with micro-batches under semi-auto parallel.

Owns: `GradReducer`, MindSpore 2.10's `PipelineGradReducer` with its `construct`
written out. 2.10's refers to `grads` before assigning it when optimizer sharding
is off (NameError at compile: "The name 'grads' is not defined"), so a layout with
micro-batches or accumulation and `parallel.optimizer_shard = false` could not
compile; this is the construct of `mindspore.nn.PipelineGradReducer` (2.3+), whose
two branches are each 2.10's: with optimizer sharding, the gradients themselves
(MindSpore accumulated them into the shards); without, the accumulators, read and
zeroed. tests/e2e/test_strategy_lint.py checks it against the MindSpore installed.
"""
from __future__ import annotations

from mindspore.ops import functional as F
from mindspore.parallel.nn import PipelineGradReducer
from mindspore.parallel.nn.parallel_grad_reducer import grad_scale, shard_grad_scale


class GradReducer(PipelineGradReducer):
    def construct(self, grads):
        if self.opt_shard:
            grads = self.grad_reducer(grads)
            return self.hyper_map(F.partial(shard_grad_scale, self.scale_sense * self.degree), grads,
                                  self.accu_grads)
        accu_grads = self.grad_reducer(self.accu_grads)
        return self.hyper_map(F.partial(grad_scale, self.scale_sense * self.degree), grads, accu_grads)
