"""The data position and order: pure functions of (seed, epoch, cursor, skip ranges, layout)."""
import numpy as np
import pytest

from contracts.config import load_config
from engine.data.order import SyntheticSource, merge_ranges, permute, rank_slice, step_samples, take


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 100, 1000, 4097])
def test_permute_is_a_bijection_per_epoch(n):
    for epoch in (0, 1):
        perm = permute(np.arange(n), n, seed=5, epoch=epoch)
        assert sorted(perm.tolist()) == list(range(n))


def test_permute_depends_only_on_seed_and_epoch():
    n = 1000
    a = permute(np.arange(n), n, seed=1, epoch=0)
    assert np.array_equal(a, permute(np.arange(n), n, seed=1, epoch=0))
    assert np.array_equal(a[[5, 900, 17]], permute(np.array([5, 900, 17]), n, seed=1, epoch=0))  # random access
    assert not np.array_equal(a, permute(np.arange(n), n, seed=1, epoch=1))
    assert not np.array_equal(a, permute(np.arange(n), n, seed=2, epoch=0))
    assert np.abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.2   # actually shuffled


@pytest.mark.parametrize("cursor,count,skips,expected,after", [
    (0, 4, [], [0, 1, 2, 3], 4),
    (0, 4, [(2, 5)], [0, 1, 5, 6], 7),
    (2, 3, [(2, 5)], [5, 6, 7], 8),
    (0, 4, [(1, 2), (3, 4)], [0, 2, 4, 5], 6),
    (10, 2, [(0, 8)], [10, 11], 12),               # ranges behind the cursor change nothing
    (0, 2, [(2, 9)], [0, 1], 2),                   # a range just ahead is passed over lazily
])
def test_take_passes_over_skip_ranges(cursor, count, skips, expected, after):
    got, new_cursor = take(cursor, count, merge_ranges(skips))
    assert got.tolist() == expected and new_cursor == after


def test_merge_ranges():
    assert merge_ranges([(5, 8), (0, 2), (1, 3), (8, 9), (4, 4)]) == [(0, 3), (5, 9)]
    with pytest.raises(ValueError):
        merge_ranges([(3, 1)])


def _run(steps, *, dp, accum, global_batch=16, skips=(), cursor=0):
    """Per step, the indices each rank trains on."""
    out = []
    skips = merge_ranges(skips)
    for _ in range(steps):
        s = step_samples(cursor, global_batch=global_batch, skips=skips)
        out.append([rank_slice(s.indices, r, dp=dp, grad_accum_steps=accum) for r in range(dp)])
        cursor = s.cursor_after
    return out, cursor


@pytest.mark.parametrize("dp,accum", [(2, 1), (2, 2), (4, 2), (1, 4), (8, 1)])
def test_ranks_interleaved_equal_the_single_rank_order(dp, accum):
    skips = [(20, 37)]
    single, _ = _run(6, dp=1, accum=1, skips=skips)
    multi, _ = _run(6, dp=dp, accum=accum, skips=skips)
    for one, many in zip(single, multi):
        assert all(m.shape == (accum, 16 // dp // accum) for m in many)
        assert np.array_equal(np.concatenate([m.ravel() for m in many]), one[0].ravel())


def test_resuming_at_any_cursor_continues_exactly():
    skips = [(40, 50), (90, 91)]
    whole, _ = _run(12, dp=2, accum=1, skips=skips)
    for k in (1, 3, 7):
        first, cursor = _run(k, dp=2, accum=1, skips=skips)
        rest, _ = _run(12 - k, dp=2, accum=1, skips=skips, cursor=cursor)
        assert all(np.array_equal(a[r], b[r]) for a, b in zip(whole[k:], rest) for r in range(2))


def test_resuming_with_another_world_size_keeps_the_global_order():
    before, cursor = _run(5, dp=4, accum=1)
    after, _ = _run(5, dp=2, accum=2, cursor=cursor)
    reference, _ = _run(10, dp=1, accum=1)
    flat = [np.concatenate([r.ravel() for r in step]) for step in before + after]
    assert all(np.array_equal(a, b[0].ravel()) for a, b in zip(flat, reference))


def test_skipped_samples_are_never_seen():
    steps, _ = _run(20, dp=2, accum=2, skips=[(33, 71)])
    seen = np.concatenate([r.ravel() for step in steps for r in step])
    assert not np.any((seen >= 33) & (seen < 71))
    assert len(np.unique(seen)) == seen.size == 20 * 16


def test_step_range_encloses_the_step():
    s = step_samples(0, global_batch=4, skips=[(2, 5)])
    assert s.indices.tolist() == [0, 1, 5, 6] and s.sample_range == (0, 7)


def test_synthetic_samples_depend_only_on_seed_and_index():
    cfg = load_config(None, ['data.source="synthetic"'])
    src = SyntheticSource(vocab_size=512, seq_len=64, seed=cfg.data.seed, successors=4)
    batch = src.batch(np.array([[5, 6], [7, 8]]))
    assert batch.shape == (2, 2, 65) and batch.dtype == np.int32
    assert np.array_equal(batch[1, 0], src.sample(7))
    other = SyntheticSource(vocab_size=512, seq_len=64, seed=9, successors=4)
    assert not np.array_equal(other.sample(7), src.sample(7))
    for a, b in zip(src.sample(3)[:-1], src.sample(3)[1:]):
        assert b in src.next_tokens[a]
