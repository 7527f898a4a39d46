"""Feeding a rank's batches to the step through `mindspore.dataset`, prepared ahead in the background.

Owns: the iterator that turns (source, cursor, skip ranges, rank layout) into
one (grad_accum_steps, micro_batch, seq_len + 1) int32 batch per step, with
the step's sample range and the cursor after it. The plan itself is
engine.data.order's (pure); this module only runs it in MindSpore's pipeline so
batches are ready before the step asks for them. A corrupt block found while a
batch is prepared ahead is raised when the step that would train on it asks
for it (MindSpore's pipeline would wrap the error into a RuntimeError).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Sequence

import mindspore.dataset as msds
import numpy as np

from contracts.errors import DataError
from engine.data import order


@dataclasses.dataclass(frozen=True)
class FedStep:
    batch: np.ndarray          # (grad_accum_steps, micro_batch, seq_len + 1) int32, this rank's
    sample_start: int          # the global sample range [start, end) of the whole step
    sample_end: int
    cursor_after: int          # data position after this step


class _RankBatches:
    """The generator MindSpore's pipeline pulls from: `steps` consecutive steps from `cursor`."""

    def __init__(self, source, *, cursor: int, steps: int, share: Callable[[np.ndarray], np.ndarray],
                 global_batch: int, skips: Sequence[tuple[int, int]]):
        self.source, self.cursor, self.steps = source, cursor, steps
        self.share, self.global_batch = share, global_batch
        self.skips = order.merge_ranges(skips)
        self.error: DataError | None = None      # set, with a flagged empty batch, when a batch fails

    def __iter__(self):
        cursor = self.cursor
        for _ in range(self.steps):
            try:
                samples = order.step_samples(cursor, global_batch=self.global_batch, skips=self.skips,
                                            excluded=self.source.excluded)
                mine = self.share(samples.indices)
                batch = self.source.batch(mine)
            except DataError as e:
                self.error = e
                yield np.zeros((1, 1, 1), dtype=np.int32), np.array([0, 0, 0, 1], dtype=np.int64)
                return
            start, end = samples.sample_range
            cursor = samples.cursor_after
            yield batch, np.array([start, end, cursor, 0], dtype=np.int64)


def feed(source, *, cursor: int, steps: int, share: Callable[[np.ndarray], np.ndarray], global_batch: int,
         skips: Sequence[tuple[int, int]] = (), prefetch_steps: int = 4) -> Iterator[FedStep]:
    """Yields `steps` FedSteps; batches are produced in MindSpore's pipeline threads, ahead of use.
    `share`: a step's global sample indices → the (grad_accum_steps, rows) this rank feeds
    (Parallelism.rank_batch, engine.layout.parallel)."""
    if steps <= 0:
        return
    msds.config.set_prefetch_size(prefetch_steps)
    plan = _RankBatches(source, cursor=cursor, steps=steps, share=share, global_batch=global_batch, skips=skips)
    dataset = msds.GeneratorDataset(plan, column_names=["tokens", "position"], shuffle=False,
                                    num_parallel_workers=1, python_multiprocessing=False)
    for tokens, position in dataset.create_tuple_iterator(num_epochs=1, output_numpy=True, do_copy=False):
        if position[3]:
            raise plan.error
        yield FedStep(batch=tokens, sample_start=int(position[0]), sample_end=int(position[1]),
                      cursor_after=int(position[2]))
