"""The TCP gradient sum of CPU ranks on several machines (engine/training/hub_reduce.py), in real
processes over real sockets on this machine: the hub (as the daemon starts it, `python -m
engine.rank.scheduler` with the hub's environment) and ranks that connect before or after it listens.
No MindSpore."""
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from daemon.processes import mindspore_env
from daemon.processes.mindspore_env import free_port
from engine.training.hub_reduce import GroupRefused, HubAllReduce

pytestmark = pytest.mark.integration

SIZE = 100_003
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _contribution(rank: int, call: int) -> np.ndarray:
    return np.random.default_rng(1000 * call + rank).normal(size=SIZE).astype(np.float32)


def _hub(port: int, world: int, generation: int = 1) -> subprocess.Popen:
    env = mindspore_env.hub_env(os.environ, host="127.0.0.1", port=port, world=world, generation=generation)
    return subprocess.Popen([sys.executable, "-m", "engine.rank.scheduler"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _rank(rank, world, port, calls, results, delay_s, token):
    time.sleep(delay_s)
    try:
        reduce = HubAllReduce(rank=rank, world=world, size=SIZE, hub=f"127.0.0.1:{port}", token=token)
    except GroupRefused as e:
        results.put((rank, str(e)))
        return
    sums = [reduce.all_reduce(_contribution(rank, call)).tobytes() for call in range(calls)]
    results.put((rank, sums))
    reduce.close()


def _token(port: int, generation: int = 1) -> str:
    return mindspore_env.group_name(host="127.0.0.1", port=port, generation=generation)


@pytest.mark.parametrize("world, delays, hub_delay_s", [(2, [0.0, 0.0], 0.0), (3, [0.3, 0.0, 0.1], 0.0),
                                                       (3, [0.0, 0.0, 0.0], 0.5)])   # ranks before the hub
def test_every_rank_gets_the_rank_order_sum_the_shared_memory_group_computes(world, delays, hub_delay_s):
    port = free_port()
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, 4, results, delays[r], _token(port)))
             for r in range(world)]
    for p in procs:
        p.start()
    time.sleep(hub_delay_s)
    hub = _hub(port, world)
    got = dict(results.get(timeout=60) for _ in range(world))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert hub.wait(timeout=30) == 0                    # every rank closed: the hub ends by itself
    assert f"{world} ranks joined, {SIZE} values a sum" in hub.stdout.read()
    for call in range(4):
        expected = _contribution(0, call)
        for r in range(1, world):
            expected = expected + _contribution(r, call)     # rank order, as the shared-memory group sums
        for r in range(world):
            assert got[r][call] == expected.tobytes()        # the same bits on every rank


def test_a_rank_of_another_generation_is_refused_in_one_line_and_the_group_still_forms():
    port = free_port()
    hub = _hub(port, 2, generation=7)
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    stranger = ctx.Process(target=_rank, args=(0, 2, port, 1, results, 0.0, _token(port, generation=6)))
    stranger.start()
    rank, error = results.get(timeout=30)
    stranger.join(timeout=10)
    assert rank == 0 and "refused rank 0: another group's rank" in error and "\n" not in error
    members = [ctx.Process(target=_rank, args=(r, 2, port, 2, results, 0.0, _token(port, generation=7)))
               for r in range(2)]
    for p in members:
        p.start()
    got = dict(results.get(timeout=60) for _ in range(2))
    assert got[0] == got[1] and len(got[0]) == 2
    for p in members:
        p.join(timeout=10)
    assert hub.wait(timeout=30) == 0


def test_the_hub_ends_when_a_rank_goes_away_and_leaves_the_others_waiting_as_in_a_collective():
    port = free_port()
    hub = _hub(port, 2)
    ctx = mp.get_context("fork")
    results = ctx.Queue()

    def one_sum_then_gone(rank):
        reduce = HubAllReduce(rank=rank, world=2, size=SIZE, hub=f"127.0.0.1:{port}", token=_token(port))
        reduce.all_reduce(_contribution(rank, 0))
        results.put(rank)
        if rank == 1:
            results.close(), results.join_thread()      # what it put is sent before it goes
            os._exit(0)                                 # gone, as a killed rank is
        reduce.all_reduce(_contribution(rank, 1))       # waits for a sum that never comes
        results.put("summed without its peer")

    procs = [ctx.Process(target=one_sum_then_gone, args=(r,)) for r in range(2)]
    for p in procs:
        p.start()
    assert sorted(results.get(timeout=30) for _ in range(2)) == [0, 1]
    assert hub.wait(timeout=30) == 0
    procs[0].join(timeout=2)
    assert procs[0].is_alive() and results.empty()      # blocked until its supervisor ends it
    procs[0].kill()
    procs[0].join()
