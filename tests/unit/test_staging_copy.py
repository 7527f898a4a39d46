"""The blocking copy of a save on several threads: every byte lands where one thread would put it."""
import threading

import numpy as np
import pytest

from checkpointing import staging_copy
from checkpointing.staging_copy import StagingCopier, runs


def _tensors(seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(512, 1376), (7,), (3, 5), (32000, 64), (0,), (1376, 512), (64,)]
    dtypes = [np.float32, np.float32, np.float16, np.float32, np.float32, np.float32, np.int64]
    return [rng.standard_normal(s).astype(d) for s, d in zip(shapes, dtypes)]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_the_runs_cover_every_element_once_in_about_equal_bytes(n):
    src = _tensors()
    dst = [np.zeros_like(a) for a in src]
    cut = runs(list(zip(src, dst)), n)
    assert len(cut) == n
    for run in cut:
        for s, d in run:
            np.copyto(d, s)
    assert all(np.array_equal(a, b) for a, b in zip(src, dst))
    sizes = [sum(s.nbytes for s, _ in run) for run in cut]
    assert sum(sizes) == sum(a.nbytes for a in src)
    assert max(sizes) - min(sizes) <= 16                   # within two of the widest elements of equal


def test_a_non_contiguous_tensor_goes_whole():
    base = np.arange(40, dtype=np.float32).reshape(8, 5)
    src = [base[:, 1:3], np.ones(100, np.float32)]
    dst = [np.zeros((8, 2), np.float32), np.zeros(100, np.float32)]
    cut = runs(list(zip(src, dst)), 2)
    assert any(s is src[0] for run in cut for s, _ in run)
    for run in cut:
        for s, d in run:
            np.copyto(d, s)
    assert np.array_equal(dst[0], base[:, 1:3]) and np.array_equal(dst[1], src[1])


def test_a_large_save_is_copied_on_the_threads_and_lands_whole(monkeypatch):
    monkeypatch.setattr(staging_copy, "MIN_PARALLEL_BYTES", 1 << 20)
    seen = set()
    real = staging_copy._copy

    def watched(run):
        seen.add(threading.current_thread().name)
        real(run)

    monkeypatch.setattr(staging_copy, "_copy", watched)
    src = _tensors(1)
    dst = [np.zeros_like(a) for a in src]
    StagingCopier(3).copy(list(zip(src, dst)))
    assert all(np.array_equal(a, b) for a, b in zip(src, dst))
    assert len(seen) == 3 and threading.current_thread().name in seen


def test_a_small_save_stays_on_the_callers_thread(monkeypatch):
    seen = set()
    real = staging_copy._copy
    monkeypatch.setattr(staging_copy, "_copy", lambda run: (seen.add(threading.current_thread().name), real(run)))
    src = [np.ones(1000, np.float32)]
    dst = [np.zeros(1000, np.float32)]
    StagingCopier(4).copy(list(zip(src, dst)))
    assert seen == {threading.current_thread().name} and dst[0].sum() == 1000


def test_a_failed_copy_on_a_helper_thread_raises_in_the_caller(monkeypatch):
    monkeypatch.setattr(staging_copy, "MIN_PARALLEL_BYTES", 0)
    src = [np.ones(1000, np.float32), np.ones(1000, np.float32)]
    dst = [np.zeros(1000, np.float32), np.zeros(999, np.float32)]     # a buffer of the wrong size
    with pytest.raises(ValueError):
        StagingCopier(2).copy(list(zip(src, dst)))


def test_a_copy_that_fails_on_the_callers_thread_returns_only_once_its_helpers_are_done(monkeypatch):
    """The staging buffers are the next save's too: no helper may still write them once copy() has returned."""
    import time

    monkeypatch.setattr(staging_copy, "MIN_PARALLEL_BYTES", 0)
    real = staging_copy._copy

    def slow_helper_failing_caller(run):
        if threading.current_thread() is threading.main_thread():
            raise MemoryError("the caller's run")
        time.sleep(0.2)
        real(run)

    monkeypatch.setattr(staging_copy, "_copy", slow_helper_failing_caller)
    src = [np.ones(1000, np.float32), np.full(1000, 2, np.float32)]
    dst = [np.zeros(1000, np.float32), np.zeros(1000, np.float32)]
    with pytest.raises(MemoryError):
        StagingCopier(2).copy(list(zip(src, dst)))
    assert (dst[1] == 2).all()                             # the helper's half landed before the error came back
