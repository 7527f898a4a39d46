"""Which samples each rank trains on, and the synthetic token source.

Owns: the global sample-index layout — step s (0-based) consumes the global
samples [s·G, (s+1)·G) for global batch G; data-parallel rank r takes the
contiguous slice [r·G/dp, (r+1)·G/dp) of it, split into grad_accum_steps
micro-batches in order — and a deterministic, learnable synthetic stream
(a seeded sparse Markov chain) where sample i is a pure function of (seed, i).
So any rank, after any restart or with any world size, can produce exactly
the samples a step needs. No MindSpore here.
"""
from __future__ import annotations

import numpy as np

from engine.config import Config


def step_sample_range(step_index: int, global_batch: int) -> tuple[int, int]:
    """Global sample-index range [a, b) consumed by the 0-based optimizer step `step_index`."""
    return step_index * global_batch, (step_index + 1) * global_batch


def rank_sample_indices(step_index: int, rank: int, *, dp: int, global_batch: int,
                        grad_accum_steps: int) -> np.ndarray:
    """(grad_accum_steps, micro_batch) global sample indices rank `rank` feeds in step `step_index`."""
    per_rank = global_batch // dp
    start = step_index * global_batch + rank * per_rank
    return np.arange(start, start + per_rank, dtype=np.int64).reshape(grad_accum_steps, -1)


class SyntheticSource:
    """Sequences from a sparse Markov chain: each token has `successors` possible next tokens.

    Its entropy (a little over ln(successors) nats per token at most) sits far below
    ln(vocab_size), so a model that learns drives the loss well down from the start.
    """

    def __init__(self, *, vocab_size: int, seq_len: int, seed: int, successors: int):
        rng = np.random.default_rng([seed, 0x5EED])
        k = min(successors, vocab_size)
        self.next_tokens = np.stack([rng.choice(vocab_size, size=k, replace=False) for _ in range(vocab_size)])
        weights = rng.dirichlet(np.full(k, 2.0), size=vocab_size)
        self.cum_weights = np.cumsum(weights, axis=1)
        self.cum_weights[:, -1] = 1.0
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    @classmethod
    def from_config(cls, cfg: Config) -> "SyntheticSource":
        return cls(vocab_size=cfg.model.vocab_size, seq_len=cfg.data.seq_len, seed=cfg.data.seed,
                   successors=cfg.data.synthetic_successors)

    def sample(self, index: int) -> np.ndarray:
        """int32 (seq_len + 1,): tokens and, shifted by one, their targets."""
        rng = np.random.default_rng([self.seed, int(index)])
        draws = rng.random(self.seq_len)
        out = np.empty(self.seq_len + 1, dtype=np.int32)
        out[0] = rng.integers(self.vocab_size)
        for pos in range(self.seq_len):
            row = out[pos]
            out[pos + 1] = self.next_tokens[row, np.searchsorted(self.cum_weights[row], draws[pos], side="right")]
        return out

    def batch(self, indices: np.ndarray) -> np.ndarray:
        """int32 indices.shape + (seq_len + 1,)."""
        flat = np.stack([self.sample(i) for i in indices.reshape(-1)])
        return flat.reshape(*indices.shape, self.seq_len + 1)
