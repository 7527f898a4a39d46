"""`python -m tests.ascend.old_step ARGS`: `python -m cli ARGS` with the semi-auto step's gradients and global norm
taken the way they were before issue 47 (`value_and_grad(scaled_loss, None, params, has_aux=True)`, the loss an
auxiliary output; each square sum marked `grad_scale` for MindSpore's HandleGlobalNormScale), so a test can show
the partitioned graph's checks failing on it: no loss divisor, a norm left to the compiler's search. Test-only."""
import sys

import mindspore as ms
from mindspore import ops

from engine.training import sharded_step

_init = sharded_step.ShardedStep.__init__


def _patched_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)

    def scaled_loss(tokens, multiplier):
        loss = self.loss_of(tokens)
        return loss * multiplier, loss

    self.old_grad = ms.value_and_grad(scaled_loss, None, self.params, has_aux=True)
    self.old_expand = ops.ExpandDims().add_prim_attr("grad_scale", True)


def _old_gradients(self, tokens, poison):
    (_, loss), grads = self.old_grad(tokens, self.scaler.scale * poison)
    return loss, grads


def _old_global_norm(self, grads):
    squares = [self.old_expand(ops.reduce_sum(ops.square(g.astype(ms.float32))), 0) for g in grads]
    return ops.sqrt(ops.addn(squares))[0]


sharded_step.ShardedStep.__init__ = _patched_init
sharded_step.ShardedStep._global_norm = _old_global_norm
sharded_step.ShardedStep.gradients = _old_gradients

from cli.main import main  # noqa: E402

sys.exit(main())
