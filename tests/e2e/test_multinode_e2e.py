"""Hosts as network namespaces on a bridge, one daemon and one MindSpore rank each, agreeing through
a real etcd: two hosts (etcd on host 0) train as one (losses equal one host with two ranks, through
the gradient hub, and through MindSpore's own cluster) and
ride out faults together (a rank or a daemon killed, etcd down, a NaN, a cut link, a stop on host
1); three hosts on an embedded etcd lose host 0 for good, elect another decider, go on with two at
the same global batch, and take it back; a partitioned decider stops its ranks and commits
nothing; an impostor is refused; a crash loop ends every host with 3; a faulty device on the deciding host
is found, its host quarantined, and the other host decides and trains on."""
import datetime
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.cluster import wait_for
from tests.etcd_server import EtcdServer
from tests.netns import Hosts

STEPS = 40


@pytest.fixture
def hosts():
    with Hosts(2) as h:
        yield h


@pytest.fixture
def etcd(hosts, tmp_path):
    server = EtcdServer(tmp_path / "etcd", host=hosts.addr(0), client_port=2379, peer_port=2380,
                        prefix=hosts.prefix(0)).start()
    yield server
    server.stop()


def _sets(corpus, run, *extra):
    # the lr schedule's length pinned: the same lr at each step whatever train.steps a run is given
    sets = [f'data.path="{corpus}"', f"train.steps={STEPS}", "optim.cosine_steps=2000", "checkpoint.interval_steps=10",
            "parallel.dp=2",
            "train.micro_batch=4", f'run.dir="{run}"', "train.log_interval_steps=1",
            "health.restart_backoff_initial_s=0.2", "health.restart_backoff_max_s=1", "run.kill_grace_s=5", *extra]
    return sum((["--set", s] for s in sets), [])


def _start_node(cli, env, hosts, etcd, i, run, corpus, tmp_path, *more):
    """Host i's daemon; `etcd`: an EtcdServer, or "embedded" (members on the first three hosts). No
    run.master_addr: the decider publishes where its scheduler listens."""
    coordinator = ["run.coordinator=\"embedded\"",
                   f'run.coordinator_members="{",".join(hosts.addr(h) for h in range(3))}"'] \
        if etcd == "embedded" else [f'run.coordinator="{etcd.url}"']
    extra = [f"run.nodes={hosts.count}", f"run.node_rank={i}", "run.master_port=29555", *coordinator,
             "run.node_lease_ttl_s=3", *more]
    out = open(tmp_path / f"node-{i}.out", "a")
    return subprocess.Popen([*hosts.prefix(i), *cli, "run", "--log-format", "json", *_sets(corpus, run, *extra)],
                            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)


def _events(run: Path, node: int) -> list[dict]:
    path = run / "logs" / f"node-{node}" / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]          # complete lines: it is being written


def _steps(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{") and '"kind": "step"' in line]


def _losses(log: Path) -> dict[int, float]:
    """step → loss of the last generation that logged it."""
    return {e["step"]: e["loss"] for e in _steps(log)}


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-5 * max(1.0, abs(b))


def _finish(procs, timeout_s=400):
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.wait(timeout=max(1, deadline - time.monotonic()))
    return [p.returncode for p in procs]


def test_three_hosts_on_an_embedded_etcd_lose_host_0_elect_another_go_on_with_two_and_take_it_back(
        cli, quiet_env, tmp_path, stdlib_corpus):
    """Host 0 (the first decider, MindSpore's scheduler, an etcd member) lost for good: every process
    on it killed and its link cut. Hosts 1 and 2 keep etcd's quorum, elect a decider, and train at
    the same global batch and sample order; host 0 returns as a follower and the run takes it back."""
    elastic = ["parallel.dp=3", "train.global_batch=12", "run.min_nodes=2", "run.node_rejoin_timeout_s=5",
               "train.steps=60"]
    run = tmp_path / "run"
    with Hosts(3) as hosts:
        start = lambda i: _start_node(cli, quiet_env, hosts, "embedded", i, run, stdlib_corpus, tmp_path, *elastic)
        nodes = [start(i) for i in range(3)]
        try:
            wait_for(lambda: len(_steps(run / "logs" / "node-0" / "rank-0.log")) >= 15, 300, "step 15 on host 0")
            assert [e for e in _events(run, 0) if e["event"] == "elected"], "host 0 did not decide first"
            hosts.lose(0)                                        # every process on host 0: daemon, rank,
            hosts.cut(0)                                         # scheduler, etcd member; and its link
            lost_at = time.time()
            nodes[0].wait()

            def smaller_generation_trains():
                shrunk = [e for e in _events(run, 1) if e["event"] == "nodes_shrunk"]
                return shrunk and [e for e in _events(run, 1) if e["event"] == "first_step"
                                   and e["generation"] == shrunk[0]["generation"]]
            wait_for(smaller_generation_trains, 180, "the first step on two hosts")
            shrunk_gen = next(e for e in _events(run, 1) if e["event"] == "nodes_shrunk")["generation"]
            first = next(e for e in _events(run, 1) if e["event"] == "first_step" and e["generation"] == shrunk_gen)
            first_at = datetime.datetime.fromisoformat(first["ts"].replace("Z", "+00:00")).timestamp()
            print(f"host 0 lost -> first step on two hosts: {first_at - lost_at:.1f} s "
                  f"(lease ttl 3 s, rejoin timeout 5 s, generation start {first['since_open_s']} s)")
            small_log = run / "logs" / "node-1" / "rank-0.log"          # host 1 holds rank 0 on two hosts
            wait_for(lambda: len([e for e in _steps(small_log) if e["generation"] == shrunk_gen]) >= 8, 200,
                     "steps on two hosts")
            hosts.restore(0)
            nodes[0] = start(0)                                  # back: a follower, taken in after a checkpoint
            codes = _finish(nodes, 400)
        finally:
            for p in nodes:
                if p.poll() is None:
                    p.kill()
    outputs = [(tmp_path / f"node-{i}.out").read_text()[-3000:] for i in range(3)]
    assert codes == [0, 0, 0], outputs
    ev = {i: _events(run, i) for i in range(3)}
    named = lambda i, name: [e for e in ev[i] if e["event"] == name]
    assert [e["node"] for e in named(1, "elected")] == [1] and not named(2, "elected")
    assert len([e for e in named(0, "etcd_member")]) == 2                # started, then started again on return
    shrunk = named(1, "nodes_shrunk")
    assert [(e["members"], e["lost"], e["dp"], e["micro_batch"], e["grad_accum_steps"]) for e in shrunk] == [
        ([1, 2], [0], 2, 3, 2)]
    assert named(1, "nodes_rejoined")
    starts = [[e["generation"] for e in named(i, "generation_start")] for i in range(3)]
    assert starts[1] == starts[2] and starts[0][-1] == starts[1][-1], starts
    assert named(0, "generation_start")[-1]["ranks"] == [0]           # host 0 first again, as a follower
    # the same global batch and sample order on 3 and on 2 hosts: a step replayed by the smaller
    # cluster has the loss the full cluster had, and every step's samples are the same 12
    steps = _steps(run / "logs" / "node-0" / "rank-0.log") + _steps(small_log)
    by_generation: dict[int, dict[int, dict]] = {}
    for e in steps:
        by_generation.setdefault(e["generation"], {})[e["step"]] = e
    full, small = by_generation[starts[0][0]], by_generation[shrunk_gen]
    replayed = sorted(set(full) & set(small))
    assert replayed, (sorted(full), sorted(small))
    assert all(_close(small[s]["loss"], full[s]["loss"]) for s in replayed), \
        [(s, full[s]["loss"], small[s]["loss"]) for s in replayed]
    assert all(e["sample_end"] - e["sample_start"] == 12 and e["sample_start"] == 12 * (e["step"] - 1) for e in steps)
    assert max(e["step"] for e in steps) == 60
    for node in range(3):
        assert [e["reason"] for e in named(node, "daemon_exit")][-1:] == ["finished"]


def test_two_hosts_train_as_one_and_ride_out_etcd_down_a_nan_a_killed_rank_and_daemon_a_cut_link_and_a_stop(
        cli, quiet_env, tmp_path, stdlib_corpus, hosts, etcd):
    from daemon.processes import control

    reference = tmp_path / "reference"            # one host, two ranks: what the two hosts must train
    done = subprocess.run([*cli, "run", "--log-format", "json", *_sets(stdlib_corpus, reference)], cwd=tmp_path,
                          env=quiet_env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:]
    expected = _losses(reference / "logs" / "rank-0.log")
    assert len(expected) == STEPS

    faults = ["train.steps=100000", "health.allow_fault_injection=true", "health.hang_floor_s=8",
              "run.node_rejoin_timeout_s=40", "run.coordinator_timeout_s=60"]
    run = tmp_path / "run"
    start = lambda i: _start_node(cli, quiet_env, hosts, etcd, i, run, stdlib_corpus, tmp_path, *faults)
    nodes = [start(0), start(1)]
    rank_logs = [run / "logs" / f"node-{i}" / f"rank-{i}.log" for i in (0, 1)]
    named = lambda node, name: [e for e in _events(run, node) if e["event"] == name]
    last_step = lambda: max((e["step"] for e in _steps(rank_logs[0])), default=0)
    generation = lambda: max((e["generation"] for e in named(0, "generation_start")), default=0)

    def trains_on(gen_after: int, steps: int = 5):
        wait_for(lambda: len([e for e in _steps(rank_logs[1]) if e["generation"] > gen_after]) >= steps, 300,
                 f"{steps} steps on host 1 after generation {gen_after}")
        # and a checkpoint committed since: the faults that follow are separate incidents, not one crash
        # loop (three restarts without a new checkpoint end the run, exit 3, as they should)
        wait_for(lambda: any(e["generation"] > gen_after for e in named(0, "checkpoint_committed")), 300,
                 f"a checkpoint committed after generation {gen_after}")
    try:
        trains_on(0, 15)
        # etcd stopped for 20 s and started again: the generation trains on, nothing restarts
        gen, before = generation(), last_step()
        etcd.stop()
        time.sleep(20)
        etcd.start()
        wait_for(lambda: last_step() >= before + 30, 120, "steps after etcd came back")
        assert generation() == gen and not named(0, "incident") and not named(1, "incident")

        # a NaN on host 1's rank: one decision (node 0's: rerun its step), applied by both; the rerun passes
        # the step (the drill is no fault of the data), both hosts find it transient and train on, nothing cut
        at = last_step() + 50      # a drill asked for a step already passed applies at the next one: read below
        control.write_request(run / "nodes" / "node-1" / "control", "inject", {"fault": "nan", "rank": 1, "at_step": at})
        wait_for(lambda: named(1, "incident"), 120, "the NaN incident on host 1")
        wait_for(lambda: named(0, "triage") and named(1, "triage"), 300, "the rerun's verdict on both hosts")
        trains_on(named(1, "incident")[-1]["generation"], 5)
        nan0, nan1 = named(0, "incident")[-1], named(1, "incident")[-1]
        assert nan0["kind"] == nan1["kind"] == "non_finite" and nan0["action"] == nan1["action"]
        applied = re.findall(r"inject command \d+: nan at step (\d+)", rank_logs[1].read_text())
        assert nan0["action"]["type"] == "rerun" and nan0["first_step"] == int(applied[-1]) >= at
        assert [e["verdict"] for e in named(0, "triage")] == [e["verdict"] for e in named(1, "triage")] == ["transient"]
        replay = [[e for e in _steps(log) if e["generation"] == nan0["generation"] + 1] for log in rank_logs]
        assert replay[0] and replay[1] and {e["lr_multiplier"] for e in replay[0] + replay[1]} == {1.0}
        assert not any(e["skipped"] for e in replay[0] + replay[1])

        # a rank killed on host 1: both hosts end the generation and restart it together
        gen = generation()
        pid = [e for e in named(1, "generation_start")][-1]["pids"]["1"]
        os.kill(int(pid), signal.SIGKILL)
        trains_on(gen, 5)

        # host 1's daemon killed and back within the rejoin timeout: the run goes on at full size
        gen = generation()
        nodes[1].send_signal(signal.SIGKILL)
        nodes[1].wait()
        time.sleep(1)
        nodes[1] = start(1)
        trains_on(gen, 5)
        assert [e["members"] for e in named(0, "nodes_shrunk")] == []

        # host 1's link down past the hang timeout, then up: both restart together
        gen, incidents = generation(), len(named(0, "incident"))
        hosts.cut(1)
        time.sleep(12)                  # the fault's length: past the hang floor (8 s) and the lease (3 s)
        wait_for(lambda: len(named(0, "incident")) > incidents, 120, "node 0 to see the cut")   # before it heals
        hosts.restore(1)
        trains_on(gen, 5)

        # a stop dropped on host 1: both stop after one committed checkpoint
        control.write_request(run / "nodes" / "node-1" / "control", "stop", {"reason": "maintenance"})
        codes = _finish(nodes, 200)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    outputs = [(tmp_path / f"node-{i}.out").read_text()[-3000:] for i in (0, 1)]
    assert codes == [0, 0], outputs
    starts = [[e["generation"] for e in named(i, "generation_start")] for i in (0, 1)]
    assert starts[0] == starts[1], starts                       # the same generations, on both hosts
    assert not named(1, "decision_mismatch")
    for node in (0, 1):
        assert [e["reason"] for e in named(node, "daemon_exit")][-1] == "stopped"
    # nothing committed was lost: each generation resumed from the newest commit before it (a
    # rollback's or a rerun's, from the checkpoint it chose: a commit may land after the incident's step)
    newest, target, resumed = 0, None, []
    for e in _events(run, 0):
        if e["event"] == "checkpoint_committed":
            newest = max(newest, e["step"])
        elif e["event"] == "incident" and e.get("action", {}).get("type") in ("rollback", "rerun"):
            target = e["action"]["checkpoint_step"]       # a rerun, too, goes back to before its steps
        elif e["event"] == "generation_start" and e["generation"] > 1:
            resumed.append((e["resume_step"], target if target is not None else newest))
            newest, target = e["resume_step"], None
    assert len(resumed) == 4 and all(got == want for got, want in resumed), resumed
    kinds = [[e["kind"] for e in named(node, "incident")] for node in (0, 1)]
    # node 0 decided each; host 1 applied each but the one decided while its daemon was dead
    assert kinds == [["non_finite", "crash", "node_lost", "node_lost"], ["non_finite", "crash", "node_lost"]], kinds
    # the first generation's losses equal one host with two ranks (the global batch and the data
    # order do not depend on the topology), on both ranks; the gradients went through the hub
    assert "llm-pretrain hub: 2 ranks joined" in (run / "logs" / "node-0" / "scheduler.log").read_text()
    for log in rank_logs:
        got = {e["step"]: e["loss"] for e in _steps(log) if e["generation"] == 1 and e["step"] <= STEPS}
        assert sorted(got) == sorted(expected) and all(_close(got[s], expected[s]) for s in expected)
    assert named(0, "daemon_exit")[-1]["step"] == newest


def test_a_partitioned_decider_stops_its_ranks_and_commits_nothing_the_others_go_on_and_an_impostor_is_refused(
        cli, quiet_env, tmp_path, stdlib_corpus):
    """Host 0 (the decider, an embedded etcd member) cut off from the others but alive: its ranks
    stall, it stops them at once and commits nothing; hosts 1 and 2 elect a decider and go on; the
    link back, host 0 rejoins as a follower. Meanwhile a copied config started as node 0 on a spare
    machine with a run directory of its own is refused (78) and the run's generations do not move."""
    elastic = ["run.nodes=3", "parallel.dp=3", "train.global_batch=12", "run.min_nodes=2",
               "run.node_rejoin_timeout_s=5", "train.steps=120", "health.hang_floor_s=30",
               "run.coordinator_timeout_s=300"]
    run = tmp_path / "run"
    with Hosts(4) as hosts:                                  # host 3: a spare machine, no part of the run
        start = lambda i, *more: _start_node(cli, quiet_env, hosts, "embedded", i, run, stdlib_corpus, tmp_path,
                                             *elastic, *more)
        nodes = [start(i) for i in range(3)]
        try:
            wait_for(lambda: len(_steps(run / "logs" / "node-1" / "rank-1.log")) >= 15, 300, "step 15 on host 1")
            assert [e for e in _events(run, 0) if e["event"] == "elected"], "host 0 did not decide first"
            gens = [e["generation"] for e in _events(run, 1) if e["event"] == "generation_start"]
            impostor = subprocess.run(
                [*hosts.prefix(3), *cli, "run", "--log-format", "json",
                 *_sets(stdlib_corpus, tmp_path / "impostor", *elastic, "run.node_rank=0", "run.master_port=29555",
                        'run.coordinator="embedded"',
                        f'run.coordinator_members="{",".join(hosts.addr(h) for h in range(3))}"')],
                cwd=tmp_path, env=quiet_env, capture_output=True, text=True, timeout=120)
            assert [e["generation"] for e in _events(run, 1) if e["event"] == "generation_start"] == gens
            hosts.cut(0)                                         # partitioned, alive
            cut_at = time.time()
            wait_for(lambda: [e for e in _events(run, 0) if e["event"] == "cut_off"], 120, "host 0 to cut itself off")
            wait_for(lambda: [e for e in _events(run, 1) if e["event"] == "nodes_shrunk"], 180, "two hosts training")
            shrunk_gen = next(e for e in _events(run, 1) if e["event"] == "nodes_shrunk")["generation"]
            wait_for(lambda: len([e for e in _steps(run / "logs" / "node-1" / "rank-0.log")
                                  if e["generation"] == shrunk_gen]) >= 8, 200, "steps on two hosts")
            hosts.restore(0)
            codes = _finish(nodes, 400)
        finally:
            for p in nodes:
                if p.poll() is None:
                    p.kill()
    outputs = [(tmp_path / f"node-{i}.out").read_text()[-3000:] for i in range(3)]
    exits = [json.loads(line) for line in impostor.stdout.splitlines() if '"daemon_exit"' in line]
    assert impostor.returncode == 78 and "is not of the run under" in exits[0]["detail"], impostor.stdout[-2000:]
    assert codes == [0, 0, 0], outputs
    ev = {i: _events(run, i) for i in range(3)}
    named = lambda i, name: [e for e in ev[i] if e["event"] == name]
    cut = named(0, "cut_off")[0]
    cut_ts = datetime.datetime.fromisoformat(cut["ts"].replace("Z", "+00:00")).timestamp()
    print(f"link cut -> host 0 stopped its ranks: {cut_ts - cut_at:.1f} s")
    # nothing new committed on host 0's side of the cut generation after the cut: a save in flight when the
    # link went (of a step every host had trained) may still land — at most one, and of no step the others
    # lack — and no step is committed in two generations
    ts = lambda e: datetime.datetime.fromisoformat(e["ts"].replace("Z", "+00:00")).timestamp()
    late = [e for e in named(0, "checkpoint_committed") if e["generation"] == cut["generation"] and ts(e) > cut_at]
    trained = max(e["step"] for e in _steps(run / "logs" / "node-1" / "rank-1.log")
                  if e["generation"] == cut["generation"])
    assert len(late) <= 1 and all(e["step"] <= trained for e in late), (late, trained)
    committed_in: dict[int, set[int]] = {}
    for i in range(3):
        for e in named(i, "checkpoint_committed"):
            committed_in.setdefault(e["step"], set()).add(e["generation"])
    assert all(len(g) == 1 for g in committed_in.values()), committed_in
    assert [e["node"] for e in named(1, "elected")] == [1]
    assert named(1, "nodes_rejoined") and named(0, "generation_start")[-1]["ranks"] == [0]
    for node in range(3):
        assert [e["reason"] for e in named(node, "daemon_exit")][-1:] == ["finished"]


def test_two_hosts_on_mindspores_own_cluster_train_as_one_host_does(cli, quiet_env, tmp_path, stdlib_corpus, hosts,
                                                                    etcd):
    """`parallel.local_reduce = false`: MindSpore's scheduler on the decider's host and its AllReduce
    between the hosts, not the gradient hub (the default, which the test above trains with)."""
    reference = tmp_path / "reference"
    done = subprocess.run([*cli, "run", "--log-format", "json", *_sets(stdlib_corpus, reference)], cwd=tmp_path,
                          env=quiet_env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:]
    expected = _losses(reference / "logs" / "rank-0.log")
    run = tmp_path / "run"
    nodes = [_start_node(cli, quiet_env, hosts, etcd, i, run, stdlib_corpus, tmp_path, "parallel.local_reduce=false")
             for i in (0, 1)]
    try:
        assert _finish(nodes) == [0, 0], [(tmp_path / f"node-{i}.out").read_text()[-2000:] for i in (0, 1)]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    assert (run / "logs" / "node-0" / "scheduler.log").exists()          # MindSpore's scheduler ran there
    assert "hub" not in (run / "logs" / "node-0" / "scheduler.log").read_text()
    for i in (0, 1):
        got = _losses(run / "logs" / f"node-{i}" / f"rank-{i}.log")
        assert sorted(got) == sorted(expected)
        assert all(_close(got[step], expected[step]) for step in expected), (i, got, expected)


def test_a_crash_loop_ends_every_host_with_3(cli, quiet_env, tmp_path, stdlib_corpus, hosts, etcd):
    broken = tmp_path / "broken"           # a broken environment on every host: each rank dies as it starts
    broken.mkdir()
    (broken / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('LLM_PRETRAIN_GENERATION'):\n    os._exit(1)\n")
    env = dict(quiet_env, PYTHONPATH=f"{broken}{os.pathsep}{quiet_env.get('PYTHONPATH', '')}")
    run = tmp_path / "run"
    nodes = [_start_node(cli, env, hosts, etcd, i, run, stdlib_corpus, tmp_path,
                         "health.max_restarts_without_progress=2") for i in (0, 1)]
    try:
        codes = _finish(nodes, 200)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    assert codes == [3, 3], [(tmp_path / f"node-{i}.out").read_text()[-2000:] for i in (0, 1)]
    for node in (0, 1):
        final = [e for e in _events(run, node) if e["event"] == "daemon_exit"][-1]
        assert (final["code"], final["reason"]) == (3, "crash_loop"), final


def test_a_faulty_device_on_the_deciding_host_is_found_its_host_quarantined_and_the_other_decides_and_trains_on(
        cli, quiet_env, tmp_path, stdlib_corpus, hosts, etcd):
    """Host 0 (the decider) turns faulty at step 35 (its rank's gradients x32 every step). Its rank stands out;
    the rerun repeats it, the rotated rerun finds it stays with rank 0: a device fault. Host 0 is quarantined:
    it stops deciding, host 1 is elected and trains on alone at the same global batch; host 0 waits out its
    probation and ends with the run."""
    from daemon.processes import control

    run = tmp_path / "run"
    more = ["train.steps=60", "run.min_nodes=1", "health.allow_fault_injection=true", "run.node_rejoin_timeout_s=5"]
    nodes = [_start_node(cli, quiet_env, hosts, etcd, i, run, stdlib_corpus, tmp_path, *more) for i in (0, 1)]
    try:
        wait_for(lambda: len(_steps(run / "logs" / "node-0" / "rank-0.log")) >= 3, 300, "step 3 on host 0")
        control.write_request(run / "nodes" / "node-0" / "control", "inject",
                              {"fault": "faulty-rank", "rank": 0, "at_step": 35})
        codes = _finish(nodes, 500)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0], [(tmp_path / f"node-{i}.out").read_text()[-3000:] for i in (0, 1)]
    ev = {i: _events(run, i) for i in (0, 1)}
    named = lambda i, name: [e for e in ev[i] if e["event"] == name]
    assert [t["verdict"] for t in named(0, "triage")][-2:] == ["deterministic", "device"]
    [decided] = [e for e in named(0, "incident") if (e["action"] or {}).get("exclude")]
    assert decided["kind"] == "rank_outlier" and decided["action"]["exclude"] == [0]
    assert decided["action"]["skip"] is None and decided["action"]["lr_overrides"] == []
    assert [e["node"] for e in named(0, "resigned")] == [0]
    assert [e["node"] for e in named(1, "elected")] == [1]
    [shrunk] = named(1, "nodes_quarantined")
    assert shrunk["members"] == [1] and shrunk["left_out"] == [0]
    for i in (0, 1):             # both daemons hold the lemon list (a decider elected later knows it)
        lemons = json.loads((run / "nodes" / f"node-{i}" / "state.json").read_text())["lemons"]
        assert lemons["node 0"]["quarantines"] == 1 and lemons["node 0"]["device"] is None
    alone = [e for e in _steps(run / "logs" / "node-1" / "rank-0.log") if e["generation"] == shrunk["generation"]]
    assert alone and max(e["step"] for e in alone) == 60 and min(e["step"] for e in alone) == \
        decided["action"]["checkpoint_step"] + 1
    assert all(e["lr_multiplier"] == 1.0 and e["sample_end"] - e["sample_start"] == 8 for e in alone)
    assert not [e for e in named(0, "generation_start") if e["generation"] >= shrunk["generation"]]
    for node in (0, 1):
        assert [e["reason"] for e in named(node, "daemon_exit")][-1:] == ["finished"]
