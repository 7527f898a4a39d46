"""The shared-memory gradient sum of data-parallel ranks on one machine, in real processes (no MindSpore:
under msrun the cluster barrier it needs at start is a multiprocessing.Barrier here; a local group of
the supervisor's, whose file prefix is new, needs none)."""
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from engine.training.local_reduce import LocalAllReduce

pytestmark = pytest.mark.integration

SIZE = 100_003          # not a multiple of the rank count: uneven shares


def _contribution(rank: int, call: int) -> np.ndarray:
    return np.random.default_rng(1000 * call + rank).normal(size=SIZE).astype(np.float32)


def _rank(rank, world, directory, barrier, calls, results, start_delay_s=0.0):
    time.sleep(start_delay_s)
    reduce = LocalAllReduce(rank=rank, world=world, size=SIZE, prefix=directory / "llm-pretrain-reduce-t",
                            barrier=barrier.wait if barrier is not None else None)
    sums = []
    for call in range(calls):
        out = reduce.all_reduce(_contribution(rank, call))
        sums.append(out.copy())
    results.put((rank, [s.tobytes() for s in sums]))
    reduce.close()


def _run(world: int, directory, calls: int = 5, *, barrier: bool = True, delays=None):
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(world) if barrier else None, ctx.Queue()
    delays = delays or [0.0] * world
    procs = [ctx.Process(target=_rank, args=(r, world, directory, barrier, calls, results, delays[r]))
             for r in range(world)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=60) for _ in range(world))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return got


@pytest.mark.parametrize("world, barrier, delays", [
    (2, True, None), (3, True, None),
    # a local group: no barrier, whoever comes first creates the files, rank 0 first or last
    (2, False, [0.0, 0.3]), (3, False, [0.3, 0.0, 0.1])])
def test_every_rank_gets_the_sum_of_every_rank_on_every_call(tmp_path, world, barrier, delays):
    got = _run(world, tmp_path, barrier=barrier, delays=delays)
    for call in range(5):
        expected = _contribution(0, call)
        for r in range(1, world):
            expected = expected + _contribution(r, call)     # rank order, as the shares are summed
        for r in range(world):
            np.testing.assert_array_equal(np.frombuffer(got[r][call], np.float32), expected)
    # nothing is left behind: the segment and the FIFOs are unlinked once every rank holds them (after
    # the barrier at start, or after the first sum)
    assert list(tmp_path.iterdir()) == []


def test_a_stale_segment_of_an_earlier_cluster_is_replaced(tmp_path):
    for name in ("llm-pretrain-reduce-t.seg", "llm-pretrain-reduce-t.arrive"):
        (tmp_path / name).write_bytes(b"\xff" * 64)
    got = _run(2, tmp_path, calls=1)
    np.testing.assert_array_equal(np.frombuffer(got[1][0], np.float32), _contribution(0, 0) + _contribution(1, 0))


def _join_then_die(world, directory, barrier):
    LocalAllReduce(rank=1, world=world, size=SIZE, prefix=directory / "llm-pretrain-reduce-t", barrier=barrier.wait)
    os.kill(os.getpid(), signal.SIGKILL)         # a rank crashing before its first sum


def test_a_peer_that_dies_holds_the_others_in_the_barrier(tmp_path):
    """Like a collective: the survivor waits (the supervisor's crash and hang handling ends it)."""
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    alive = ctx.Process(target=_rank, args=(0, 2, tmp_path, barrier, 1, results))
    dying = ctx.Process(target=_join_then_die, args=(2, tmp_path, barrier))
    alive.start()
    dying.start()
    dying.join(timeout=30)
    assert dying.exitcode == -signal.SIGKILL
    alive.join(timeout=2)
    try:
        assert alive.is_alive() and results.empty()
    finally:
        alive.kill()
        alive.join()
