"""State only one machine holds (issue 50, item 3): three hosts as network namespaces, one real MindSpore rank
each, a real etcd outside them; the RAM tier every step in buddy placement (checkpoint.memory_placement =
"buddy": each machine's RAM holds its own part of the state, as the disk's plan shares it out, and a copy of its
buddy's part), the disk's interval beyond the test's length. A host lost at a random moment takes its part with
it: the survivors make a step whole from their own parts and the copy the lost host's buddy kept, and resume
from it — from the RAM tier, not from scratch (the disk holds nothing). No machine ever held a whole step before
the loss."""
import random
import time

from checkpointing import layout, parts, reader
from tests.e2e.cluster import wait_for
from tests.e2e.test_multinode_e2e import _events, _start_node, _steps
from tests.etcd_server import EtcdServer
from tests.netns import Hosts


def test_a_lost_hosts_part_comes_back_from_its_buddy_and_the_survivors_resume_from_ram(
        cli, quiet_env, tmp_path, stdlib_corpus):
    settings = ["train.steps=100000", "parallel.dp=3", "train.global_batch=12", "checkpoint.interval_steps=100000",
                "checkpoint.memory_interval_steps=1", 'checkpoint.memory_placement="buddy"',
                f'checkpoint.memory_dir="{tmp_path / "shm"}"', "run.min_nodes=1", "run.node_rejoin_timeout_s=0",
                "health.hang_floor_s=30"]
    run = tmp_path / "run"
    log0 = run / "logs" / "node-0" / "rank-0.log"
    with Hosts(3) as hosts:
        etcd = EtcdServer(tmp_path / "etcd", host=f"{hosts.subnet}.254").start()     # outside the hosts
        nodes = [_start_node(cli, quiet_env, hosts, etcd, i, run, stdlib_corpus, tmp_path, *settings)
                 for i in range(3)]
        try:
            wait_for(lambda: len(_steps(log0)) >= 15, 300, "15 steps on host 0")
            time.sleep(random.uniform(0.0, 2.0))                   # a random moment of a step, or of a save
            ram0 = layout.memory_root(run, tmp_path / "shm", 0)
            before = [reader.read_manifest(layout.step_dir(ram0, s)) for s in layout.committed_steps(ram0)]
            hosts.lose(1)                                           # a follower: host 0 decides
            nodes[1].wait()
            gen = max(e["generation"] for e in _steps(log0))
            last = max(e["step"] for e in _steps(log0) if e["generation"] == gen)
            wait_for(lambda: [e for e in _events(run, 0) if e["event"] == "first_step" and e["generation"] > gen],
                     180, "hosts 0 and 2 stepping again without host 1")
            from daemon.processes import control

            control.write_request(run / "nodes" / "node-0" / "control", "stop", {"reason": "the test is over"})
            codes = [nodes[i].wait(timeout=200) for i in (0, 2)]
        finally:
            for p in nodes:
                if p.poll() is None:
                    p.kill()
            etcd.stop()
    assert codes == [0, 0], [(tmp_path / f"node-{i}.out").read_text()[-3000:] for i in (0, 2)]
    # before the loss every RAM step on host 0 was a part: its own, and host 2's copy (its buddy is host 2's)
    assert before and all(parts.slots(m) is not None and 0 in parts.slots(m)[0] and 1 not in parts.slots(m)[0] for m in before)
    copies = {i: [e for e in _events(run, i) if e["event"] == "buddy_copies" and e["generation"] == gen]
              for i in (0, 2)}
    assert copies[2] and copies[2][0]["peers"] == [1] and copies[2][0]["copies"] > 0, copies
    starts = {i: next(e for e in _events(run, i) if e["event"] == "generation_start" and e["generation"] > gen)
              for i in (0, 2)}
    taken = {i: [e for e in _events(run, i) if e["event"] == "ram_taken_from_peer" and e["generation"] >= gen]
             for i in (0, 2)}
    restored = next(e for e in _events(run, 0) if e["event"] == "checkpoint_restored" and e["generation"] > gen)
    resumed = starts[0]["resume_step"]
    print(f"host 1 lost at host 0's step {last}; resumed from {resumed} ({last - resumed} steps lost; "
          f"host 2 kept {copies[2][0]['copies']} copies of host 1's part); taken: "
          f"{[(i, e['step'], e['peers'], e['bytes']) for i in (0, 2) for e in taken[i]]}")
    assert {(s["resume_step"], s["resume_tier"]) for s in starts.values()} == {(resumed, "ram")} and resumed > 0
    assert restored["tier"] == "ram" and restored["step"] == resumed
    # host 2 held host 1's part (its copy): both hosts took what they lacked, host 0 from host 2
    assert [e["step"] for e in taken[0]] == [resumed] and taken[0][0]["peers"], taken
