"""Which samples each step and each rank train on, and where the samples' tokens come from.

Owns the data position and order — all pure, no MindSpore:
- A global sample index g names one training sequence; the pipeline state
  is the cursor (the next g to consume; its epoch is g // samples_per_epoch).
- Each optimizer step takes the next global_batch indices from the cursor,
  passing over the skip ranges [a, b) (windows a rollback discarded); every
  rank computes the same list, and data-parallel rank r trains on its r-th
  contiguous slice, split into grad_accum_steps micro-batches. So the global
  order does not depend on the world size, and a restart at any cursor
  continues exactly.
- Sample g of a corpus is the (seq_len + 1)-token window starting at token
  seq_len · perm(g mod S), packed across document boundaries, where perm is a
  pseudo-random permutation of the S samples of an epoch keyed by (seed,
  epoch), computed in O(1) memory (a cycle-walking Feistel network), so the
  order depends only on (seed, epoch) and costs nothing to restore.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from contracts.config import Config
from contracts.errors import DataError
from engine.data.corpus import Corpus


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-spread 64-bit hash (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(positions: np.ndarray, n: int, *, seed: int, epoch: int, rounds: int = 6) -> np.ndarray:
    """A bijection of [0, n) keyed by (seed, epoch), applied to `positions` (vectorised, O(1) memory)."""
    if n <= 1:
        return np.zeros_like(np.asarray(positions, dtype=np.int64))
    half = max(1, ((n - 1).bit_length() + 1) // 2)           # domain 4^half >= n, < 4n
    mask = np.uint64((1 << half) - 1)
    base = ((seed * 1_000_003 + epoch) * 0x9E3779B97F4A7C15) % (1 << 64)
    with np.errstate(over="ignore"):
        keys = _mix64(np.arange(rounds, dtype=np.uint64) + np.uint64(base))

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for key in keys:
            left, right = right, left ^ (_mix64(right ^ key) & mask)
        return (left << np.uint64(half)) | right

    with np.errstate(over="ignore"):
        out = feistel(np.asarray(positions, dtype=np.uint64))
        outside = out >= np.uint64(n)
        while outside.any():                                     # cycle-walk back into [0, n)
            out[outside] = feistel(out[outside])
            outside = out >= np.uint64(n)
    return out.astype(np.int64)


def merge_ranges(ranges: Iterable[Sequence[int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping, non-empty [a, b) ranges."""
    merged: list[tuple[int, int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in ranges):
        if a < 0 or b < a:
            raise ValueError(f"skip range [{a}, {b}) is invalid: needs 0 <= a <= b")
        if a == b:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def take(cursor: int, count: int, skips: Sequence[tuple[int, int]],
         excluded: Callable[[np.ndarray], np.ndarray] | None = None) -> tuple[np.ndarray, int]:
    """The next `count` global indices from `cursor` outside the (merged) skip ranges and, when given,
    not `excluded` (a boolean mask per index: samples overlapping a quarantined block), and the new cursor."""
    if excluded is None:
        return _take(cursor, count, skips)
    parts, need, g, scanned = [], count, cursor, 0
    while need:
        candidates, g = _take(g, need, skips)
        kept = candidates[~excluded(candidates)]
        parts.append(kept)
        need -= kept.size
        scanned = 0 if kept.size else scanned + candidates.size
        if scanned > MAX_EXCLUDED_RUN:
            raise DataError(f"no sample from index {cursor} on is usable: {scanned} in a row overlap "
                            "quarantined corpus blocks")
    return np.concatenate(parts), g


MAX_EXCLUDED_RUN = 1 << 24


def _take(cursor: int, count: int, skips: Sequence[tuple[int, int]]) -> tuple[np.ndarray, int]:
    parts, need, g = [], count, cursor
    for a, b in skips:
        if b <= g:
            continue
        if a > g:
            n = min(need, a - g)
            parts.append(np.arange(g, g + n, dtype=np.int64))
            need, g = need - n, g + n
            if need == 0:
                break
        g = max(g, b)
    if need:
        parts.append(np.arange(g, g + need, dtype=np.int64))
        g += need
    return np.concatenate(parts), g


@dataclasses.dataclass(frozen=True)
class StepSamples:
    """What one optimizer step consumes."""

    indices: np.ndarray   # (global_batch,) global sample indices, all ranks together
    cursor_after: int     # the data position once this step is done

    @property
    def sample_range(self) -> tuple[int, int]:
        """[first, last + 1): the window a rollback would skip (it may enclose skipped indices)."""
        return int(self.indices[0]), int(self.indices[-1]) + 1


def step_samples(cursor: int, *, global_batch: int, skips: Sequence[tuple[int, int]] = (),
                 excluded: Callable[[np.ndarray], np.ndarray] | None = None) -> StepSamples:
    indices, after = take(cursor, global_batch, skips, excluded)
    return StepSamples(indices=indices, cursor_after=after)


def rank_slice(indices: np.ndarray, rank: int, *, dp: int, grad_accum_steps: int) -> np.ndarray:
    """(grad_accum_steps, micro_batch) indices of rank `rank`: its contiguous share, in micro-batches."""
    per_rank = indices.size // dp
    return indices[rank * per_rank:(rank + 1) * per_rank].reshape(grad_accum_steps, -1)


class CorpusSource:
    """Training sequences from a prepared corpus, in the (seed, epoch) order. With block checksums
    (corpus v2), each block is verified when a batch first reads it in an epoch (CorruptBlockError
    names it), and samples overlapping a quarantined block are passed over (`excluded`)."""

    def __init__(self, corpus: Corpus, *, seq_len: int, seed: int):
        self.corpus, self.seq_len, self.seed = corpus, seq_len, seed
        self.quarantined: list[tuple[str, int]] = []          # (shard file, block), from the recovery directive
        self._bad_tokens = np.zeros((0, 2), dtype=np.int64)  # their token ranges in the stream
        self._epoch = -1
        self.samples_per_epoch = (corpus.num_tokens - 1) // seq_len
        if self.samples_per_epoch < 1:
            raise DataError(f"corpus {str(corpus.path)!r} has {corpus.num_tokens} tokens, fewer than one "
                            f"sequence of data.seq_len + 1 = {seq_len + 1}; use a shorter data.seq_len or more data")

    def starts(self, indices: np.ndarray) -> np.ndarray:
        """First token of each sample."""
        flat = np.asarray(indices, dtype=np.int64).reshape(-1)
        epochs, positions = np.divmod(flat, self.samples_per_epoch)
        out = np.empty_like(flat)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = permute(positions[sel], self.samples_per_epoch, seed=self.seed, epoch=int(epoch))
        return out * self.seq_len

    def quarantine(self, blocks: Iterable[Sequence]) -> None:
        """Never train again on samples that touch these (shard file, block) pairs."""
        verifier = self.corpus.verifier
        merged = sorted({*self.quarantined, *((str(f), int(b)) for f, b in blocks)})
        if merged and verifier is None:
            raise DataError(f"corpus {str(self.corpus.path)!r} has no block checksums (format version 1), "
                            "so blocks cannot be quarantined; prepare it again")
        self.quarantined = merged
        ranges = [verifier.token_range(f, b) for f, b in merged] if merged else []
        self._bad_tokens = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)

    @property
    def excluded(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """The mask of samples overlapping a quarantined block (None: nothing is quarantined)."""
        if not self.quarantined:
            return None
        width = self.seq_len + 1

        def mask(indices: np.ndarray) -> np.ndarray:
            starts = self.starts(indices)[:, None]
            lo, hi = self._bad_tokens[:, 0][None, :], self._bad_tokens[:, 1][None, :]
            return ((starts < hi) & (starts + width > lo)).any(axis=1)
        return mask

    def batch(self, indices: np.ndarray) -> np.ndarray:
        """int32 indices.shape + (seq_len + 1,); raises CorruptBlockError when a block it reads fails."""
        width = self.seq_len + 1
        starts = self.starts(indices)
        verifier = self.corpus.verifier if self.corpus.verify_blocks else None
        if verifier is not None:
            epoch = int(np.max(indices)) // self.samples_per_epoch
            if epoch != self._epoch:
                self._epoch = epoch
                verifier.new_epoch()
            for s in starts:
                verifier.verify(int(s), int(s) + width)
        rows = [self.corpus.tokens(int(s), int(s) + width) for s in starts]
        return np.stack(rows).astype(np.int32).reshape(*np.shape(indices), width)


class SyntheticSource:
    """Sequences from a sparse Markov chain: each token has `successors` possible next tokens.

    Sample i is a pure function of (seed, i). Its entropy (a little over
    ln(successors) nats per token at most) sits far below ln(vocab_size), so a
    model that learns drives the loss well down. For tests that need no files.
    """

    samples_per_epoch = 1 << 62
    excluded = None                         # no files, no blocks to quarantine
    quarantined: tuple = ()

    def quarantine(self, blocks: Iterable[Sequence]) -> None:
        if list(blocks):
            raise DataError("data.source = \"synthetic\" has no corpus blocks to quarantine")

    def __init__(self, *, vocab_size: int, seq_len: int, seed: int, successors: int):
        rng = np.random.default_rng([seed, 0x5EED])
        k = min(successors, vocab_size)
        self.next_tokens = np.stack([rng.choice(vocab_size, size=k, replace=False) for _ in range(vocab_size)])
        weights = rng.dirichlet(np.full(k, 2.0), size=vocab_size)
        self.cum_weights = np.cumsum(weights, axis=1)
        self.cum_weights[:, -1] = 1.0
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

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
        flat = np.stack([self.sample(i) for i in np.asarray(indices).reshape(-1)])
        return flat.reshape(*np.shape(indices), self.seq_len + 1)


def open_source(cfg: Config) -> CorpusSource | SyntheticSource:
    """The config's data source; data.path = "" is the embedded corpus, prepared on first use."""
    d = cfg.data
    if d.source == "synthetic":
        return SyntheticSource(vocab_size=cfg.model.vocab_size, seq_len=d.seq_len, seed=d.seed,
                               successors=d.synthetic_successors)
    path: str | Path = d.path
    if not path:
        from engine.data.prepare import ensure_default_corpus

        path = ensure_default_corpus()
    corpus = Corpus(path, verify_checksums=d.verify_checksums)
    check_vocabulary(corpus, cfg)
    return CorpusSource(corpus, seq_len=d.seq_len, seed=d.seed)


def validation_batches(cfg: Config, source: CorpusSource | SyntheticSource) -> np.ndarray | None:
    """The held-out sequences the validation loss is measured on, int32 (batches, micro_batch, seq_len + 1):
    train.eval_batches batches of train.micro_batch, the first of the validation corpus's order, the same
    ones every time. From data.validation_path, else the training corpus's own split; None when the run
    has neither (or train.eval_interval_steps = 0)."""
    t, d = cfg.train, cfg.data
    if not t.eval_interval_steps:
        return None
    path: str | Path | None = d.validation_path or None
    if path is None and isinstance(source, CorpusSource):
        path = source.corpus.validation_path
    if path is None:
        return None
    corpus = Corpus(path, verify_checksums=d.verify_checksums)
    check_vocabulary(corpus, cfg)
    held_out = CorpusSource(corpus, seq_len=d.seq_len, seed=d.seed)
    batches = min(t.eval_batches, held_out.samples_per_epoch // t.micro_batch)
    if batches < 1:
        raise DataError(f"validation corpus {str(corpus.path)!r} holds {held_out.samples_per_epoch} sequences of "
                        f"data.seq_len + 1 = {d.seq_len + 1} tokens, fewer than one batch of train.micro_batch = "
                        f"{t.micro_batch}; hold out more (prepare-data --validation-fraction) or set "
                        "train.eval_interval_steps = 0")
    n = batches * t.micro_batch
    return held_out.batch(np.arange(n)).reshape(batches, t.micro_batch, d.seq_len + 1)


def check_vocabulary(corpus: Corpus, cfg: Config) -> None:
    """The model can embed every token of the corpus (checked by `config` and the daemon before any
    rank starts, and by each rank)."""
    if corpus.vocab_size > cfg.model.vocab_size:
        raise DataError(f"corpus {str(corpus.path)!r} has a vocabulary of {corpus.vocab_size} tokens but "
                        f"model.vocab_size = {cfg.model.vocab_size}; raise model.vocab_size to at least that")
