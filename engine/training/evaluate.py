"""The validation loss: the model's mean next-token loss on held-out sequences, forward only.

Owns the compiled forward graph it runs (one `ms.jit` function, compiled at the first evaluation and
reused: the same micro-batch shape every time) and the mean over the batches. Nothing here touches
the parameters, the optimizer, the data order or any random state: evaluating never changes the
training trajectory (a run with and without it trains bit-identically).

Under data parallel every rank holds the whole model, so one rank (rank 0) evaluates and reports;
the others go on to the next step and wait for it in its collective. A semi-auto parallel layout
(tensor or pipeline parallel, Ascend) would need the forward compiled as a parallel graph of its
own: not built yet, and said so once (engine/rank/trainer.py).
"""
from __future__ import annotations

import math
import time

import mindspore as ms
import numpy as np
from mindspore import Tensor

from engine.model.causal_lm import CausalLM


class Evaluator:
    def __init__(self, net: CausalLM, batches: np.ndarray):
        """batches: int32 (n, micro_batch, seq_len + 1), the same held-out sequences each time."""
        self.net, self.batches = net, batches
        self._forward = ms.jit(self._loss)

    def _loss(self, tokens):
        return self.net(tokens[:, :-1], tokens[:, 1:])

    def run(self) -> tuple[float, float, float]:
        """(mean loss over every batch, its perplexity, seconds taken)."""
        started = time.perf_counter()
        losses = [float(self._forward(Tensor(batch)).asnumpy()) for batch in self.batches]
        loss = float(np.mean(losses))          # equal batches of equal length: the mean over every target token
        perplexity = math.exp(loss) if loss < 700 else math.inf
        return loss, perplexity, time.perf_counter() - started
