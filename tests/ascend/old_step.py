"""`python -m tests.ascend.old_step ARGS`: `python -m cli ARGS` with the semi-auto step's gradients taken the way
they were before issue 47 (`value_and_grad(scaled_loss, None, params, has_aux=True)`, the loss an auxiliary
output), so a test can show the partitioned graph's check failing on it: no loss divisor. Test-only."""
import sys

import mindspore as ms

from engine.training import sharded_step

_init = sharded_step.ShardedStep.__init__


def _patched_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)

    def scaled_loss(tokens, multiplier):
        loss = self.loss_of(tokens)
        return loss * multiplier, loss

    self.old_grad = ms.value_and_grad(scaled_loss, None, self.params, has_aux=True)


def _old_gradients(self, tokens, poison):
    (_, loss), grads = self.old_grad(tokens, self.scaler.scale * poison)
    return loss, grads


sharded_step.ShardedStep.__init__ = _patched_init
sharded_step.ShardedStep.gradients = _old_gradients

from cli.main import main  # noqa: E402

sys.exit(main())
