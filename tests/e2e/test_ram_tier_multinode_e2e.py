"""The RAM tier on every machine (issue 50, item 1): two hosts as network namespaces, one real MindSpore rank
each, a real etcd outside both; a RAM checkpoint every step, the disk's interval beyond the test's length (so
the RAM tier is always the newer state: with the disk's every 50, a loss that lands on a disk step resumes from
the disk, rightly, and the test would assert a race's outcome). A host lost at a random moment
(every process on it killed) costs the survivor at most one step: it resumes from the newest RAM step it holds,
agreed by the decider — whether the lost host was a follower or the decider itself. A host rebooted (its tmpfs
emptied) and back within the rejoin timeout takes the run's newest RAM step from its peer (item 2), and nobody
rolls back. (Before: the RAM tier was refused on several machines, and every such fault rolled every machine back
to the disk's newest, up to 49 steps.)"""
import random
import shutil
import time

from checkpointing import layout
from tests.e2e.cluster import wait_for
from tests.e2e.test_multinode_e2e import _events, _start_node, _steps
from tests.etcd_server import EtcdServer
from tests.netns import Hosts



def _generation_with(run, node, event, after):
    """The first `event` of node `node` in a generation after `after` (None: not yet)."""
    return next((e for e in _events(run, node) if e["event"] == event and e["generation"] > after), None)


def test_a_host_lost_at_a_random_moment_costs_the_survivor_at_most_one_step_follower_or_decider(
        cli, quiet_env, tmp_path, stdlib_corpus):
    settings = ["train.steps=100000", "train.global_batch=8", "checkpoint.interval_steps=100000",
                "checkpoint.memory_interval_steps=1",
                f'checkpoint.memory_dir="{tmp_path / "shm"}"', "run.min_nodes=1", "run.node_rejoin_timeout_s=0",
                "health.hang_floor_s=30"]
    run, rng = tmp_path / "run", random.Random()
    with Hosts(2) as hosts:
        etcd = EtcdServer(tmp_path / "etcd", host=f"{hosts.subnet}.254").start()     # outside both hosts
        start = lambda i: _start_node(cli, quiet_env, hosts, etcd, i, run, stdlib_corpus, tmp_path, *settings)  # noqa: E731
        nodes = [start(0), start(1)]
        logs = lambda node, rank: run / "logs" / f"node-{node}" / f"rank-{rank}.log"   # noqa: E731
        lost = []
        try:
            since = 1                                   # the generation of both hosts the loss comes in
            for victim, survivor in ((1, 0), (0, 1)):
                rank = 0 if survivor == 0 else 1        # the survivor's rank in that generation
                wait_for(lambda: len([e for e in _steps(logs(survivor, rank)) if e["generation"] >= since]) >= 12,
                         300, f"12 steps on host {survivor}")
                time.sleep(rng.uniform(0.0, 2.0))                 # a random moment of a step, or of a save
                hosts.lose(victim)
                nodes[victim].wait()
                gen = max(e["generation"] for e in _steps(logs(survivor, rank)))
                wait_for(lambda: _generation_with(run, survivor, "first_step", gen), 180,
                         f"host {survivor} stepping again without host {victim}")
                started = _generation_with(run, survivor, "generation_start", gen)
                last = max(e["step"] for e in _steps(logs(survivor, rank)) if e["generation"] == gen)
                restored = _generation_with(run, survivor, "checkpoint_restored", gen)
                lost.append((victim, last, started["resume_step"], started["resume_tier"], restored))
                if victim == 1:            # host 1 back: taken in again (after the ranks' save), then host 0 lost
                    nodes[1] = start(1)
                    wait_for(lambda: [e for e in _events(run, 0) if e["event"] == "nodes_rejoined"], 240,
                             "host 1 taken back")
                    since = next(e for e in _events(run, 0) if e["event"] == "nodes_rejoined")["generation"]
            from daemon.processes import control

            control.write_request(run / "nodes" / "node-1" / "control", "stop", {"reason": "the test is over"})
            nodes[1].wait(timeout=200)
        finally:
            for p in nodes:
                if p.poll() is None:
                    p.kill()
            etcd.stop()
    print("host lost -> (its peer's last step, resumed from, tier):", [(v, last, s, t) for v, last, s, t, _ in lost])
    for victim, last, resumed, tier, restored in lost:
        assert tier == "ram" and restored is not None and restored["tier"] == "ram", (victim, tier, restored)
        assert restored["step"] == resumed and last - 1 <= resumed <= last, (victim, last, resumed)
    assert nodes[1].returncode == 0, (tmp_path / "node-1.out").read_text()[-3000:]
    # the same sample order throughout: a step trained again after a loss trained the same 8 samples
    every = [e for node, rank in ((0, 0), (1, 1), (1, 0)) for e in _steps(logs(node, rank))]
    assert all(e["sample_end"] - e["sample_start"] == 8 and e["sample_start"] == 8 * (e["step"] - 1) for e in every)


def test_a_rebooted_host_takes_the_newest_ram_step_from_its_peer_and_nobody_rolls_back(
        cli, quiet_env, tmp_path, stdlib_corpus):
    """The run's own rejoin settings (it waits up to 60 s for the host, at full size); host 1 lost at a random
    moment, its RAM tier emptied as a reboot empties a tmpfs, and its daemon started again."""
    settings = ["train.steps=100000", "train.global_batch=8", "checkpoint.interval_steps=100000",
                "checkpoint.memory_interval_steps=1", f'checkpoint.memory_dir="{tmp_path / "shm"}"']
    run = tmp_path / "run"
    with Hosts(2) as hosts:
        etcd = EtcdServer(tmp_path / "etcd", host=f"{hosts.subnet}.254").start()
        start = lambda i: _start_node(cli, quiet_env, hosts, etcd, i, run, stdlib_corpus, tmp_path, *settings)  # noqa: E731
        nodes = [start(0), start(1)]
        log0 = run / "logs" / "node-0" / "rank-0.log"
        try:
            wait_for(lambda: len(_steps(log0)) >= 12, 300, "12 steps")
            time.sleep(random.uniform(0.0, 2.0))
            hosts.lose(1)
            nodes[1].wait()
            ram = layout.memory_root(run, tmp_path / "shm", 1)
            assert layout.committed_steps(ram), "host 1 kept no RAM checkpoint to lose"
            shutil.rmtree(ram)                                       # rebooted: its tmpfs is empty
            nodes[1] = start(1)
            wait_for(lambda: _generation_with(run, 1, "first_step", 1), 240, "both hosts stepping again")
            last = max(e["step"] for e in _steps(log0) if e["generation"] == 1)
            from daemon.processes import control

            control.write_request(run / "nodes" / "node-0" / "control", "stop", {"reason": "the test is over"})
            codes = [p.wait(timeout=200) for p in nodes]
        finally:
            for p in nodes:
                if p.poll() is None:
                    p.kill()
            etcd.stop()
    assert codes == [0, 0], [(tmp_path / f"node-{i}.out").read_text()[-3000:] for i in (0, 1)]
    taken = [e for e in _events(run, 1) if e["event"] == "ram_taken_from_peer"]
    starts = [_generation_with(run, node, "generation_start", 1) for node in (0, 1)]
    restored = _generation_with(run, 1, "checkpoint_restored", 1)
    print(f"host 0's last step {last}; host 1 took {[(e['step'], e['bytes'], e['seconds']) for e in taken]}; "
          f"resumed from {[(e['generation'], e['resume_step'], e['resume_tier']) for e in starts]}")
    assert len(taken) == 1 and starts[0]["generation"] == starts[1]["generation"]
    assert {(e["resume_step"], e["resume_tier"]) for e in starts} == {(taken[0]["step"], "ram")}
    assert last - 1 <= taken[0]["step"] <= last and restored["step"] == taken[0]["step"] and restored["tier"] == "ram"
    assert not [e for node in (0, 1) for e in _events(run, node) if e["event"] == "nodes_shrunk"]
