"""Which samples a step trains on, where the data can be positioned: the global sample order with the
daemon's skip ranges stepped over, each rank's share of a step's global batch, and the spike drill's bad data.

Pure (numpy only), so a dataset reads it ahead of the step: a sample is found by its own index, not by when it
is read. A position is a sample's place in the run's order (step s trains positions (s-1)·B .. s·B-1); its
index is what the script's source is asked for: the position moved past every skip range at or before it, as
the engine's order does (engine.data.order), so a skipped window is never read and the run's later samples
keep their order.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np


def merged(ranges: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping or touching ranges joined."""
    out: list[tuple[int, int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in ranges if int(b) > int(a)):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def index_of(position: int, skips: Sequence[tuple[int, int]]) -> int:
    """The sample index at `position` of the order, every skip range (merged, sorted) stepped over."""
    index = position
    for a, b in skips:
        if index >= a:
            index += b - a
    return index


def step_range(step: int, global_batch: int, skips: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """[first, last + 1) of the indices step `step` (1-based) trains on, every rank together."""
    first = index_of((step - 1) * global_batch, skips)
    return first, index_of(step * global_batch - 1, skips) + 1


def rank_positions(step: int, global_batch: int, rank: int, world: int) -> range:
    """The positions of step `step` that rank `rank` trains on: its contiguous share of the global batch."""
    share = global_batch // world
    start = (step - 1) * global_batch + rank * share
    return range(start, start + share)


def bad_data(sample: Any, index: int, vocab_size: int) -> Any:
    """The spike drill's bad data: every integer array of the sample replaced by uniformly random token ids
    (seeded by the index, so a rerun reads the same bad data): a corrupt shard, a real loss spike."""
    rng = np.random.default_rng(index)
    swap = lambda a: (rng.integers(0, vocab_size, np.shape(a)).astype(np.asarray(a).dtype)
                      if np.issubdtype(np.asarray(a).dtype, np.integer) else a)
    return tuple(swap(a) for a in sample) if isinstance(sample, tuple) else swap(sample)


class SupervisedSource:
    """A random-access source (`__getitem__`, `__len__`: what MindSpore's GeneratorDataset takes) seen as this
    rank's samples for the rest of the run, in step order from the step the run resumes at: item i is sample
    i % share of this rank's share of step (start + i // share + 1). Skip ranges, the resume position and the
    spike drill's bad data are applied here, so a script that reads its data through it can skip a window and
    resume where it was (its client reports "data_position" and "skip_data")."""

    def __init__(self, source, *, step_of: Callable[[], int], global_batch: int, rank: int, world: int,
                 steps: int, skips: Callable[[], list[tuple[int, int]]], corrupt: Callable[[int], bool],
                 vocab_size: int | None):
        if global_batch % world:
            raise ValueError(f"global batch {global_batch} does not split over {world} ranks")
        self.source, self.global_batch, self.rank, self.world = source, global_batch, rank, world
        self.share = global_batch // world
        self.start = step_of()                 # the step the run resumes from (read once: the source is built after)
        self.steps, self._skips, self._corrupt, self.vocab_size = steps, skips, corrupt, vocab_size

    def __len__(self) -> int:
        return max(0, self.steps - self.start) * self.share

    def __getitem__(self, i: int):
        if not 0 <= i < len(self):
            raise IndexError(i)
        step = self.start + i // self.share + 1
        position = rank_positions(step, self.global_batch, self.rank, self.world)[i % self.share]
        index = index_of(position, self._skips())
        sample = self.source[index % len(self.source)]
        if self.vocab_size and self._corrupt(step):
            sample = bad_data(sample, index, self.vocab_size)
        return sample
