"""Two real supervisors (nodes 0 and 1 of one run, one fake rank each) agreeing through a real etcd:
the same generations, one decision per incident applied by both, requests on either node acting on
both, a node's daemon lost and back, and the run directory and etcd checked at the start."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon.machines.etcd_client import Etcd
from tests.etcd_server import EtcdServer
from tests.integration.test_recovery_policy import QUICK_HEALTH

ROOT = Path(__file__).resolve().parents[2]
FAST = ["health.restart_backoff_initial_s=0.1", "health.restart_backoff_max_s=0.5", "run.kill_grace_s=2"]


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(tmp_path / "etcd").start()
    yield server
    server.stop()


def _node(i, run, etcd_url, *overrides, fake=(), log_dir=None):
    sets = [f'run.dir="{run}"', "run.nodes=2", f"run.node_rank={i}", "parallel.dp=2", "train.micro_batch=4",
            "run.master_port=29999", f'run.coordinator="{etcd_url}"', "run.node_lease_ttl_s=2", *FAST, *overrides]
    args = sum((["--set", s] for s in sets), [])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "tests.integration.supervise_fake", *args, "--", *fake],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _both(run, etcd, *overrides, fake=(), timeout=90):
    """Both nodes, their fake ranks in lockstep (a rank that fails stops its peer, as a real cluster's
    collectives would: under load, one could otherwise finish the run before the other fails)."""
    fake = [*fake, "--lockstep", str(run.parent / "lockstep"), "--lockstep-world", "2"]
    procs = [_node(i, run, etcd.url, *overrides, fake=fake) for i in (0, 1)]
    return [_finish(p, timeout) for p in procs]


def _finish(proc, timeout=90):
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, [json.loads(l) for l in out.splitlines() if l.startswith("{")], err


@contextlib.contextmanager
def _reaped(procs):
    """Every daemon in `procs` (as the list is when the block ends) still running then is killed."""
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _named(events, name):
    return [e for e in events if e["event"] == name]


def test_a_crash_on_node_1_ends_the_generation_on_both_and_one_decision_restarts_both(tmp_path, etcd):
    results = _both(tmp_path / "run", etcd, fake=["--steps", "30", "--crash-at", "12", "--rank-faults", "1",
                                                  "--fault-generations", "1"])
    (code0, ev0, err0), (code1, ev1, err1) = results
    assert (code0, code1) == (0, 0), err0[-2000:] + err1[-2000:]
    assert [e["generation"] for e in _named(ev0, "generation_start")] == [1, 2]
    assert [e["generation"] for e in _named(ev1, "generation_start")] == [1, 2]
    assert _named(ev0, "generation_start")[0]["ranks"] == [0] and _named(ev1, "generation_start")[0]["ranks"] == [1]
    inc0, inc1 = _named(ev0, "incident"), _named(ev1, "incident")
    assert len(inc0) == len(inc1) == 1 and inc0[0]["kind"] == inc1[0]["kind"] == "crash"
    assert inc0[0]["rank"] == inc1[0]["rank"] == 1 and inc0[0]["action"] == inc1[0]["action"]
    assert not _named(ev1, "decision_mismatch")
    assert _named(ev0, "daemon_exit")[0]["reason"] == _named(ev1, "daemon_exit")[0]["reason"] == "finished"
    # the node's own files: its state, lock, control directory and logs apart from the other node's
    for i in (0, 1):
        assert (tmp_path / "run" / "nodes" / f"node-{i}" / "state.json").exists()
        assert (tmp_path / "run" / "logs" / f"node-{i}" / "events.jsonl").exists()


def test_a_node_that_waits_says_what_for_in_status_until_its_ranks_run(tmp_path, etcd):
    """Node 1 started alone: its state (and `status`'s row for it) names what it waits for — the nodes
    missing once it decides — not an earlier wait's words; running again, it waits for nothing."""
    from daemon.records.state import RunState

    run = tmp_path / "run"
    node1 = _node(1, run, etcd.url, fake=["--steps", "30"])
    try:
        node_dir = run / "nodes" / "node-1"
        _wait(lambda: "missing [0]" in _waiting(node_dir), 60, "node 1 to say it waits for node 0")
        assert _waiting(node_dir).startswith("waiting for nodes"), _waiting(node_dir)
        node0 = _node(0, run, etcd.url, fake=["--steps", "30"])
        (code0, _, err0), (code1, _, err1) = _finish(node0), _finish(node1)
    finally:
        node1.kill()
    assert (code0, code1) == (0, 0), err0[-2000:] + err1[-2000:]
    assert RunState.load(node_dir).waiting == ""


def _waiting(node_dir) -> str:
    from daemon.records.state import RunState, StateCorruptError

    try:
        return RunState.load(node_dir).waiting
    except (StateCorruptError, OSError):
        return ""


def test_a_loss_spike_is_decided_once_by_node_0_and_applied_identically_by_node_1(tmp_path, etcd):
    # bad data (the fake's spike is read again by a rerun): rerun first, then, reproduced, rolled back
    (code0, ev0, err0), (code1, ev1, err1) = _both(tmp_path / "run", etcd, *QUICK_HEALTH, "health.rerun=true", fake=[
        "--steps", "60", "--interval", "5", "--spike-at", "30", "--fault-generations", "1"])
    assert (code0, code1) == (0, 0), err0[-2000:] + err1[-2000:]
    inc0, inc1 = _named(ev0, "incident"), _named(ev1, "incident")
    assert [(e["kind"], e["action"]["type"]) for e in inc0] == [("loss_spike", "rerun"), ("loss_spike", "rollback")]
    assert [(e["kind"], e["action"], e["generation"]) for e in inc1] == [(e["kind"], e["action"], e["generation"])
                                                                       for e in inc0]
    # each node judged the rerun from its own rank's steps, and both found what node 0 decided on
    assert [e["verdict"] for e in _named(ev0, "triage")] == [e["verdict"] for e in _named(ev1, "triage")] == \
        ["deterministic"]
    assert not _named(ev1, "decision_mismatch")
    assert len(_named(ev0, "rollback")) == 2 and not _named(ev1, "rollback")    # node 0 moves the files, each time


def test_a_stop_dropped_on_node_1_stops_both_nodes(tmp_path, etcd, cli):
    run = tmp_path / "run"
    procs = [_node(i, run, etcd.url, fake=["--steps", "100000", "--interval", "5"]) for i in (0, 1)]
    control = run / "nodes" / "node-1" / "control"
    logs = [run / "logs" / f"node-{i}" / f"rank-{i}.log" for i in (0, 1)]
    _wait(lambda: control.is_dir() and all(l.exists() and '"kind": "step"' in l.read_text() for l in logs), 60,
          "both nodes training")
    # `status` of a multi-node run: node 0's view, and every node with its etcd lease
    shown = subprocess.run([*cli, "status", str(run), "--json"], capture_output=True, text=True, timeout=30)
    status = json.loads(shown.stdout)
    assert status["status"] == "running" and status["coordinator"] == "ok", shown.stdout
    assert [(n["node"], n["lease"]) for n in status["nodes"]] == [(0, True), (1, True)]
    table = subprocess.run([*cli, "status", str(run)], capture_output=True, text=True, timeout=30).stdout
    assert "node 1" in table and "running, generation 1" in table
    (control / "stop").write_text(json.dumps({"reason": "maintenance"}))
    (code0, ev0, err0), (code1, ev1, err1) = [_finish(p, 60) for p in procs]
    assert (code0, code1) == (0, 0), err0[-2000:] + err1[-2000:]
    # with no daemon left, the CLI leaves a request (--queue) for node 0's next daemon
    queued = subprocess.run([*cli, "pause", str(run), "--queue"], capture_output=True, text=True, timeout=30)
    assert queued.returncode == 0 and list((run / "nodes" / "node-0" / "control").glob("*pause*")), queued.stderr
    assert _named(ev0, "daemon_exit")[0]["reason"] == _named(ev1, "daemon_exit")[0]["reason"] == "stopped"
    assert [e["args"] for e in _named(ev0, "command_sent") if e["name"] == "stop"]           # node 0 wrote it
    assert not _named(ev1, "command_sent")                                                   # node 1 never does


def test_a_pause_holds_every_node_and_the_follower_says_so_as_the_decider_does(tmp_path, etcd):
    """The decider writes the ranks' pause for all; node 1's daemon never sees the request, but says
    `paused` (by the decider) when its ranks hold and `resumed` when they step again; status follows."""
    from daemon.records.state import RunState

    run = tmp_path / "run"
    procs = [_node(i, run, etcd.url, fake=["--steps", "100000", "--interval", "5"]) for i in (0, 1)]
    try:
        control = run / "nodes" / "node-0" / "control"
        _wait(lambda: control.is_dir() and all(_node_events(run, i, "progress") or _node_events(run, i, "first_step")
                                               for i in (0, 1)), 60, "both nodes training")
        (control / "pause").write_text("{}")
        _wait(lambda: all(_node_events(run, i, "paused") for i in (0, 1)), 60, "both nodes to say paused")
        assert _node_events(run, 1, "paused")[0]["by"] == "the decider"
        assert "by" not in _node_events(run, 0, "paused")[0]                   # asked there
        assert RunState.load(run / "nodes" / "node-1").status == "paused"
        (control / "resume").write_text("{}")
        _wait(lambda: _node_events(run, 1, "resumed"), 60, "node 1 to say resumed")
        _wait(lambda: RunState.load(run / "nodes" / "node-1").status == "running", 30, "node 1 running")
        (control / "stop").write_text("{}")
        (code0, _, err0), (code1, _, err1) = [_finish(p, 60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert (code0, code1) == (0, 0), err0[-2000:] + err1[-2000:]


def test_node_1_s_daemon_killed_and_restarted_rejoins_and_the_run_finishes(tmp_path, etcd):
    run = tmp_path / "run"
    fake = ["--steps", "80", "--interval", "5", "--step-s", "0.1"]
    node0, node1 = _node(0, run, etcd.url, fake=fake), _node(1, run, etcd.url, fake=fake)
    log = run / "logs" / "node-1" / "rank-1.log"
    _wait(lambda: log.exists() and log.read_text().count('"kind": "step"') >= 10, 60, "steps on node 1")
    node1.send_signal(signal.SIGKILL)
    node1.wait()
    # back once node 0 has seen it lost (its lease, 2 s, ran out)
    _wait(lambda: any(e["kind"] == "node_lost" for e in _node_events(run, 0, "incident")), 60, "node 1 seen lost")
    node1 = _node(1, run, etcd.url, fake=fake)
    (code0, ev0, err0), (code1, ev1, err1) = _finish(node0, 120), _finish(node1, 120)
    assert (code0, code1) == (0, 0), err0[-2000:] + err1[-2000:]
    kinds = [e["kind"] for e in _named(ev0, "incident")]
    assert kinds and kinds[0] == "node_lost", kinds
    gens1 = [e["generation"] for e in _named(ev1, "generation_start")]
    assert gens1 and gens1 == [e["generation"] for e in _named(ev0, "generation_start")][-len(gens1):]
    assert _named(ev0, "daemon_exit")[0]["reason"] == _named(ev1, "daemon_exit")[0]["reason"] == "finished"


def test_a_daemon_of_another_run_directory_is_refused_before_it_writes_a_key(tmp_path, etcd):
    run = tmp_path / "run"
    node0 = _node(0, run, etcd.url, fake=["--steps", "100000"])
    try:
        _wait(lambda: _node_events(run, 0, "node_joined"), 30, "node 0 to join")
        client = Etcd.from_url(etcd.url)
        before = {kv.key: kv.mod_revision for kv in client.get_prefix("/llm-pretrain/tiny/")[0]}
        code, events, _ = _finish(_node(1, tmp_path / "elsewhere", etcd.url), 60)
        after = {kv.key: kv.mod_revision for kv in client.get_prefix("/llm-pretrain/tiny/")[0]}
    finally:
        node0.send_signal(signal.SIGTERM)
        _finish(node0, 60)
    assert code == 78
    detail = _named(events, "daemon_exit")[0]["detail"]
    ids = [(d / ".run-id").read_text().strip() for d in (tmp_path / "elsewhere", run)]
    assert "is not of the run under /llm-pretrain/tiny/" in detail and all(i in detail for i in ids), detail
    assert after == before                  # not a key written: node 0's run is untouched


def test_an_unreachable_coordinator_at_the_start_is_exit_75_in_one_line(tmp_path):
    code, events, err = _finish(_node(0, tmp_path / "run", "etcd://127.0.0.1:1"), 60)
    assert code == 75 and "etcd unreachable" in _named(events, "daemon_exit")[0]["detail"]
    assert "Traceback" not in err


def _node_events(run, i, name):
    """Node i's events named `name` so far (complete lines of its events.jsonl)."""
    path = run / "logs" / f"node-{i}" / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in (json.loads(l) for l in lines if l.endswith("}")) if e["event"] == name]


def _three(i, run, etcd_url, *overrides, fake=()):
    return _node(i, run, etcd_url, "run.nodes=3", "parallel.dp=3", "train.global_batch=12", *overrides, fake=fake)


def _configs(log: Path) -> list[str]:
    """The config each generation of a fake rank was started with, as it printed it."""
    return [line for line in log.read_text().splitlines() if line.startswith("config ")] if log.exists() else []


def _wait(ready, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


class _GatedThree:
    """Three nodes of an elastic run (min_nodes 2, rejoin timeout 2 s) whose fake ranks hold before
    step 100 until `gate` exists (the run cannot finish before the test lets it); `start(i)` starts
    (or restarts) node i."""

    def __init__(self, tmp_path, coordinator, *more):
        self.gate, self.run = tmp_path / "gate", tmp_path / "run"
        self.fake = ["--steps", "150", "--interval", "5", "--step-s", "0.05", "--gate-at", "100",
                     "--gate", str(self.gate)]
        self.coordinator, self.more = coordinator, ["run.min_nodes=2", "run.node_rejoin_timeout_s=2", *more]
        self.logs = [self.run / "logs" / f"node-{i}" / f"rank-{i}.log" for i in (0, 1, 2)]
        self.procs = [self.start(i) for i in (0, 1, 2)]

    def start(self, i):
        return _three(i, self.run, self.coordinator, *self.more, fake=self.fake)

    def stepped(self, i, steps=10) -> bool:
        return self.logs[i].exists() and self.logs[i].read_text().count('"kind": "step"') >= steps


def test_a_node_lost_past_the_rejoin_timeout_shrinks_the_run_and_is_taken_back_when_it_returns(tmp_path, etcd):
    # no rank steps past 100 until node 2 is back (or its generation is ended): the run cannot finish first
    three = _GatedThree(tmp_path, etcd.url)
    gate, run, procs, logs = three.gate, three.run, three.procs, three.logs
    with _reaped(procs):
        _wait(lambda: three.stepped(2), 30, "steps on node 2")
        procs[2].send_signal(signal.SIGKILL)          # node 2's daemon is gone; its rank ends by itself
        procs[2].wait()
        # the generation without node 2 started on both (their SIGTERM handlers set: each steps at least once)
        _wait(lambda: len(_configs(logs[0])) >= 2 and len(_configs(logs[1])) >= 2, 40, "a generation without node 2")
        procs[2] = three.start(2)                    # back: taken in at the next generation
        _wait(lambda: _node_events(run, 0, "nodes_rejoined"), 120, "node 2 taken back")
        gate.touch()
        results = [_finish(p, 120) for p in procs]
    assert [r[0] for r in results] == [0, 0, 0], [r[2][-1500:] for r in results]
    ev0 = results[0][1]
    assert [e["kind"] for e in _named(ev0, "incident")][:1] == ["node_lost"]
    shrunk = _named(ev0, "nodes_shrunk")
    assert len(shrunk) == 1 and shrunk[0]["members"] == [0, 1] and shrunk[0]["lost"] == [2]
    # the same global batch of 12 on two ranks: micro-batch 4 does not divide it over 2, so 3 x 2
    assert (shrunk[0]["dp"], shrunk[0]["micro_batch"], shrunk[0]["grad_accum_steps"]) == (2, 3, 2)
    assert _named(ev0, "nodes_rejoined")
    # every generation says when it trained again, timed from its opening
    assert {e["generation"] for e in _named(ev0, "first_step")} == {e["generation"] for e in _named(ev0, "generation_start")}
    configs = _configs(logs[1])
    assert "parallel.dp=3" in configs[0] and "train.grad_accum_steps=1" in configs[0]
    assert "parallel.dp=2" in configs[1] and "train.grad_accum_steps=2" in configs[1] and "train.micro_batch=3" in configs[1]
    assert "parallel.dp=3" in configs[-1] and "train.micro_batch=4" in configs[-1]
    starts = {i: [e["generation"] for e in _named(results[i][1], "generation_start")] for i in (0, 1, 2)}
    assert starts[0] == starts[1] and starts[2] == starts[0][-len(starts[2]):], starts
    assert [e["ranks"] for e in _named(ev0, "generation_start")][-1] == [0]
    assert _named(results[2][1], "generation_start")[-1]["ranks"] == [2]
    for _, events, _ in results:
        assert _named(events, "daemon_exit")[0]["reason"] == "finished"


def test_fewer_nodes_than_min_nodes_after_the_join_timeout_is_exit_75_in_one_line(tmp_path, etcd):
    """A fresh run waits run.node_join_timeout_s for its machines, not the (short) rejoin timeout."""
    code, events, err = _finish(_node(0, tmp_path / "run", etcd.url, "run.node_rejoin_timeout_s=0",
                                      "run.node_join_timeout_s=3", fake=["--steps", "10"]), 60)
    assert code == 75, err[-2000:]
    waited = _named(events, "waiting_for_nodes")[0]
    exit_event = _named(events, "daemon_exit")[0]
    assert exit_event["reason"] == "nodes" and "fewer than run.min_nodes = 2" in exit_event["detail"]
    assert "after run.node_join_timeout_s = 3 s" in exit_event["detail"]
    from tests.integration.simulated_machines import unix_s
    assert unix_s(exit_event["ts"]) - unix_s(waited["ts"]) >= 2.9      # not the rejoin timeout's 0 s
    assert "Traceback" not in err


def test_etcd_gone_past_the_coordinator_timeout_checkpoints_and_stops_every_node_with_exit_75(tmp_path, etcd):
    run = tmp_path / "run"
    procs = [_node(i, run, etcd.url, "run.coordinator_timeout_s=3", fake=["--steps", "100000", "--interval", "50",
                                                                           "--step-s", "0.05"]) for i in (0, 1)]
    log = run / "logs" / "node-1" / "rank-1.log"
    try:
        _wait(lambda: log.exists() and log.read_text().count('"kind": "step"') >= 10, 30, "steps on node 1")
        etcd.pause()
        results = [_finish(p, 60) for p in procs]
    finally:
        etcd.resume()
    assert [r[0] for r in results] == [75, 75], [r[2][-1500:] for r in results]
    for _, events, _ in results:
        final = _named(events, "daemon_exit")[0]
        assert final["reason"] == "stopped" and "coordinator_timeout_s" in final["detail"]
    committed = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step-*") if p.name[5:].isdigit())
    ends = [json.loads(l) for l in (run / "logs" / "node-0" / "rank-0.log").read_text().splitlines()
            if l.startswith("{") and '"kind": "exit"' in l]
    # the stop's own checkpoint: at the step rank 0 stopped at (an interval's only when that is a multiple of 50)
    assert ends[-1]["reason"] == "stopped" and committed and committed[-1] == ends[-1]["step"]


def test_ranks_stopped_by_a_sigterm_from_outside_do_not_stop_the_run(tmp_path, etcd):
    # what a dead node's ranks do to the others on a real cluster (their parent-death SIGTERM saves and
    # stops every rank): no node asked for a stop, so it is a fault to recover from, not the run's end
    run = tmp_path / "run"
    procs = [_node(i, run, etcd.url, fake=["--steps", "60", "--interval", "5", "--step-s", "0.05"]) for i in (0, 1)]
    logs = [run / "logs" / f"node-{i}" / f"rank-{i}.log" for i in (0, 1)]
    with _reaped(procs):
        _wait(lambda: all(l.exists() and l.read_text().count('"kind": "step"') >= 10 for l in logs), 30, "steps")
        for log in logs:            # every rank, as the collective stop of a real cluster would
            os.kill(int(next(l for l in log.read_text().splitlines() if l.startswith("fake worker")).split()[-1]),
                    signal.SIGTERM)
        results = [_finish(p, 90) for p in procs]
    assert [r[0] for r in results] == [0, 0], [r[2][-1500:] for r in results]
    for _, events, _ in results:
        assert [e["kind"] for e in _named(events, "incident")] == ["crash"]
        assert _named(events, "daemon_exit")[0]["reason"] == "finished"


def test_node_0_lost_for_good_another_decides_the_run_shrinks_and_node_0_returns_as_a_follower(tmp_path, etcd):
    three = _GatedThree(tmp_path, etcd.url)
    gate, run, procs = three.gate, three.run, three.procs
    with _reaped(procs):
        _wait(lambda: three.stepped(0), 30, "steps on node 0")
        assert _node_events(run, 0, "elected"), "node 0 was not the first decider"
        procs[0].send_signal(signal.SIGKILL)          # the decider's daemon is gone; its rank ends by itself
        procs[0].wait()
        _wait(lambda: _node_events(run, 1, "nodes_shrunk"), 60, "a generation of nodes 1 and 2")
        procs[0] = three.start(0)                    # back, as a follower
        _wait(lambda: _node_events(run, 1, "nodes_rejoined"), 120, "node 0 taken back")
        gate.touch()
        results = [_finish(p, 120) for p in procs]
    assert [r[0] for r in results] == [0, 0, 0], [r[2][-1500:] for r in results]
    ev = {i: results[i][1] for i in (0, 1, 2)}
    assert [e["node"] for e in _named(ev[1], "elected")] == [1] and not _named(ev[2], "elected")
    assert not _named(ev[0], "elected")                 # its second daemon returned as a follower
    assert _named(ev[1], "incident")[0]["kind"] == "node_lost"
    shrunk = _named(ev[1], "nodes_shrunk")
    assert [(e["members"], e["lost"], e["dp"], e["micro_batch"], e["grad_accum_steps"]) for e in shrunk] == [
        ([1, 2], [0], 2, 3, 2)]                      # the same global batch of 12 on two nodes
    starts = {i: [e["generation"] for e in _named(ev[i], "generation_start")] for i in (0, 1, 2)}
    assert starts[1] == starts[2] and starts[0] == starts[1][-len(starts[0]):], starts
    assert _named(ev[0], "generation_start")[-1]["ranks"] == [0]         # node 0 first again in the full run
    for i in (0, 1, 2):
        assert _named(ev[i], "daemon_exit")[0]["reason"] == "finished"


def test_a_decider_frozen_past_its_lease_is_deposed_stops_its_ranks_at_once_and_follows(tmp_path, etcd):
    run, fake = tmp_path / "run", ["--steps", "400", "--interval", "5", "--step-s", "0.05"]
    procs = [_node(i, run, etcd.url, "run.node_rejoin_timeout_s=20", fake=fake) for i in (0, 1)]
    try:
        _wait(lambda: _node_events(run, 1, "first_step"), 30, "steps on node 1")
        assert _node_events(run, 0, "elected"), "node 0 was not the first decider"
        procs[0].send_signal(signal.SIGSTOP)         # the decider frozen (its ranks go on): its lease lapses
        _wait(lambda: _node_events(run, 1, "elected"), 30, "node 1 elected")
        procs[0].send_signal(signal.SIGCONT)
        results = [_finish(p, 120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
    assert [r[0] for r in results] == [0, 0], [r[2][-1500:] for r in results]
    ev0, ev1 = results[0][1], results[1][1]
    cut = _named(ev0, "cut_off")
    assert cut and "no longer decides for the run" in cut[0]["detail"], _named(ev0, "incident")
    deposed_gen = cut[0]["generation"]
    # after it learned it no longer decides, node 0 wrote no command and published nothing
    assert not [e for e in _named(ev0, "command_sent") if e["generation"] > deposed_gen]
    assert len(_named(ev0, "elected")) == 1            # at its start only
    later = [e for e in _named(ev1, "generation_start") if e["generation"] > deposed_gen]
    assert later and [e["generation"] for e in _named(ev0, "generation_start")][-1] == later[-1]["generation"]
    for ev in (ev0, ev1):
        assert _named(ev, "daemon_exit")[0]["reason"] == "finished"


def test_with_two_nodes_the_survivor_of_node_0_decides_and_ends_with_75_below_min_nodes(tmp_path, etcd):
    run, fake = tmp_path / "run", ["--steps", "100000", "--interval", "5", "--step-s", "0.05"]
    node0 = _node(0, run, etcd.url, "run.node_rejoin_timeout_s=3", fake=fake)
    node1 = _node(1, run, etcd.url, "run.node_rejoin_timeout_s=3", fake=fake)
    log = run / "logs" / "node-1" / "rank-1.log"
    with _reaped([node0, node1]):
        _wait(lambda: log.exists() and log.read_text().count('"kind": "step"') >= 10, 30, "steps on node 1")
        node0.send_signal(signal.SIGKILL)
        node0.wait()
        code, events, err = _finish(node1, 60)
    assert code == 75, err[-2000:]
    assert _named(events, "waiting_for_decider") and _named(events, "elected")
    final = _named(events, "daemon_exit")[0]
    assert final["reason"] == "nodes" and "fewer than run.min_nodes = 2" in final["detail"]


def test_a_crash_loop_decided_by_the_decider_ends_every_node_with_3(tmp_path, etcd):
    results = _both(tmp_path / "run", etcd, "health.max_restarts_without_progress=2",
                    fake=["--steps", "100000", "--die-at-start"])
    for code, events, err in results:
        assert code == 3, err[-2000:]
        final = _named(events, "daemon_exit")[0]
        assert (final["code"], final["reason"]) == (3, "crash_loop"), final


@pytest.mark.parametrize("where", [[], ['run.node_addr="127.0.0.9"']], ids=["this machine", "another machine"])
def test_a_second_daemon_with_a_live_node_s_rank_is_refused_and_the_run_goes_on(tmp_path, etcd, where):
    run, fake = tmp_path / "run", ["--steps", "100000", "--interval", "5", "--step-s", "0.05"]
    procs = [_node(i, run, etcd.url, fake=fake) for i in (0, 1)]
    try:
        _wait(lambda: _node_events(run, 1, "first_step"), 30, "steps on node 1")
        # a copy of the run directory (its id too) and the config, started as node 0 on a spare machine
        copy = tmp_path / "copy"
        copy.mkdir()
        (copy / ".run-id").write_text((run / ".run-id").read_text())
        code, events, err = _finish(_node(0, copy, etcd.url, *where), 60)
        running = [p.poll() for p in procs]
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        results = [_finish(p, 60) for p in procs]
    assert code == 78, err[-2000:]
    assert "run.node_rank = 0 is held by a live daemon at 127.0.0.1" in _named(events, "daemon_exit")[0]["detail"]
    assert running == [None, None]
    for _, ev, _ in results:
        assert [e["generation"] for e in _named(ev, "generation_start")] == [1]


def test_an_embedded_etcd_of_three_members_outlives_node_0_with_its_member(tmp_path):
    from tests.etcd_server import _free_port, etcd_binary

    etcd_binary()                                      # skipped (or failed under CI) without one
    members = ",".join(f"127.0.0.1:{_free_port()}:{_free_port()}" for _ in range(3))
    three = _GatedThree(tmp_path, "embedded", f'run.coordinator_members="{members}"')
    gate, run, procs = three.gate, three.run, three.procs
    with _reaped(procs):
        _wait(lambda: three.stepped(0), 60, "steps on node 0")
        assert len({e["detail"] for i in (0, 1, 2) for e in _node_events(run, i, "etcd_member")}) == 3
        member0 = json.loads((run / "nodes" / "node-0" / "etcd.json").read_text())["pid"]
        procs[0].send_signal(signal.SIGKILL)          # node 0 lost: its daemon and its etcd member
        os.kill(member0, signal.SIGKILL)
        procs[0].wait()
        _wait(lambda: _node_events(run, 1, "nodes_shrunk"), 90, "a generation of nodes 1 and 2")
        gate.touch()
        results = [_finish(p, 120) for p in procs[1:]]
    assert [r[0] for r in results] == [0, 0], [r[2][-1500:] for r in results]
    ev1 = results[0][1]
    assert _named(ev1, "elected") and _named(ev1, "nodes_shrunk")[0]["members"] == [1, 2]
    for _, events, _ in results:
        assert _named(events, "daemon_exit")[0]["reason"] == "finished"


def test_each_machine_keeps_a_late_standby_and_a_rank_crash_restarts_both_on_theirs(tmp_path, etcd):
    """Several machines: each daemon's standby ranks wait, without a cluster, for the generation the
    decider publishes; after a crash on node 1 both nodes' next generation runs on them."""
    run, gate = tmp_path / "run", tmp_path / "gate"
    fake = ["--steps", "40", "--step-s", "0.05", "--interval", "5", "--crash-at", "20", "--rank-faults", "1",
            "--fault-generations", "1", "--gate-at", "20", "--gate", str(gate),
            "--lockstep", str(tmp_path / "lockstep"), "--lockstep-world", "2"]    # neither rank ends the run alone
    procs = [_node(i, run, etcd.url, fake=fake) for i in (0, 1)]
    with _reaped(procs):
        _wait(lambda: _node_events(run, 0, "standby_ready") and _node_events(run, 1, "standby_ready"), 60,
              "a standby ready on both nodes")
        gate.touch()                                 # then the crash after step 20 on node 1
        results = [_finish(p, 90) for p in procs]
    assert [r[0] for r in results] == [0, 0], [r[2][-1500:] for r in results]
    for i, (_, events, _) in enumerate(results):
        started, gens = _named(events, "standby_started")[0], _named(events, "generation_start")
        assert [g["standby"] for g in gens] == [False, True], i
        assert gens[1]["pids"] == started["pids"] and list(started["pids"]) == [str(i)]
        assert not _named(events, "standby_retired")
        assert _named(events, "daemon_exit")[0]["reason"] == "finished"
    # the activated standby took generation 2's environment: it stepped as generation 2 to the end
    steps = [json.loads(l) for l in (run / "logs" / "node-1" / "rank-1.log").read_text().splitlines()
             if l.startswith('{')]
    steps = [s for s in steps if s.get("kind") == "step"]
    assert [s["generation"] for s in steps][-1] == 2 and steps[-1]["step"] == 40


def test_a_late_standby_serves_a_run_shrunk_around_its_machine_as_its_new_rank_and_a_dead_one_is_never_used(
        tmp_path, etcd):
    """Node 0 (the decider) lost: nodes 1 and 2 go on as ranks 0 and 1. A late standby read no config and
    no rank yet: node 2's is activated as rank 1 and writes to rank 1's log; node 1's, whose rank died
    while it waited, no longer fits and is retired (that node starts cold)."""
    three = _GatedThree(tmp_path, etcd.url)
    run, procs = three.run, three.procs
    with _reaped(procs):
        _wait(lambda: all(_node_events(run, i, "standby_ready") for i in (0, 1, 2)), 60, "standbys ready")
        dead = _node_events(run, 1, "standby_started")[0]["pids"]["1"]
        os.kill(dead, signal.SIGKILL)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        _wait(lambda: _node_events(run, 1, "nodes_shrunk"), 60, "a generation of nodes 1 and 2")
        three.gate.touch()
        results = [_finish(p, 120) for p in procs[1:]]
    assert [r[0] for r in results] == [0, 0], [r[2][-1500:] for r in results]
    (_, on_1, _), (_, on_2, _) = results
    assert [g["standby"] for g in _named(on_1, "generation_start")][:2] == [False, False]
    assert f"rank 1 ended ({-signal.SIGKILL})" in _named(on_1, "standby_retired")[0]["detail"]
    gens = _named(on_2, "generation_start")
    assert [g["standby"] for g in gens][:2] == [False, True] and gens[1]["ranks"] == [1]
    assert gens[1]["pids"] == {"1": _named(on_2, "standby_started")[0]["pids"]["2"]}      # started as rank 2
    assert not _named(on_2, "standby_retired")
    # rank 2's process, rank 1 now: its steps of generation 2 are in rank 1's log, as rank 1
    steps = [json.loads(line) for line in (run / "logs" / "node-2" / "rank-1.log").read_text().splitlines()
             if line.startswith("{") and '"kind": "step"' in line]
    assert steps and {(s["generation"], s["rank"]) for s in steps} == {(2, 1)}
