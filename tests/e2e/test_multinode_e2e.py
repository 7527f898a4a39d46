"""Two hosts (network namespaces on a bridge), one daemon and one MindSpore rank each, agreeing through
a real etcd on host 0: the run trains as one, losses equal to one host with two ranks; a rank
killed on host 1 ends the generation on both hosts, and both restart it together."""
import json
import os
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
    sets = [f'data.path="{corpus}"', f"train.steps={STEPS}", "checkpoint.interval_steps=10", "parallel.dp=2",
            "train.micro_batch=4", f'run.dir="{run}"', "train.log_interval_steps=1",
            "health.restart_backoff_initial_s=0.2", "health.restart_backoff_max_s=1", "run.kill_grace_s=5", *extra]
    return sum((["--set", s] for s in sets), [])


def _start_node(cli, env, hosts, etcd, i, run, corpus, tmp_path):
    extra = ["run.nodes=2", f"run.node_rank={i}", f'run.master_addr="{hosts.addr(0)}"', "run.master_port=29555",
             f'run.coordinator="{etcd.url}"', "run.node_lease_ttl_s=3"]
    out = open(tmp_path / f"node-{i}.out", "w")
    return subprocess.Popen([*hosts.prefix(i), *cli, "run", "--log-format", "json", *_sets(corpus, run, *extra)],
                            cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)


def _events(run: Path, node: int) -> list[dict]:
    path = run / "logs" / f"node-{node}" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _losses(log: Path) -> dict[int, float]:
    """step → loss of the last generation that logged it."""
    out = {}
    for line in log.read_text().splitlines():
        if line.startswith("{") and '"kind": "step"' in line:
            e = json.loads(line)
            out[e["step"]] = e["loss"]
    return out


def _finish(procs, timeout_s=400):
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.wait(timeout=max(1, deadline - time.monotonic()))
    return [p.returncode for p in procs]


def test_two_hosts_train_as_one_and_a_rank_killed_on_host_1_restarts_both(cli, quiet_env, tmp_path, stdlib_corpus,
                                                                          hosts, etcd):
    reference = tmp_path / "reference"
    done = subprocess.run([*cli, "run", "--log-format", "json", *_sets(stdlib_corpus, reference)], cwd=tmp_path,
                          env=quiet_env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:]
    expected = _losses(reference / "logs" / "rank-0.log")
    assert len(expected) == STEPS

    run = tmp_path / "run"
    nodes = [_start_node(cli, quiet_env, hosts, etcd, i, run, stdlib_corpus, tmp_path) for i in (0, 1)]
    try:
        rank_1_log = run / "logs" / "node-1" / "rank-1.log"
        wait_for(lambda: rank_1_log.exists() and len(_losses(rank_1_log)) >= 15, 300, "step 15 on host 1")
        pid = next(e for e in _events(run, 1) if e["event"] == "generation_start")["pids"]["1"]
        os.kill(int(pid), signal.SIGKILL)
        codes = _finish(nodes)
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    outputs = [(tmp_path / f"node-{i}.out").read_text()[-3000:] for i in (0, 1)]
    assert codes == [0, 0], outputs
    starts = [[e["generation"] for e in _events(run, i) if e["event"] == "generation_start"] for i in (0, 1)]
    assert starts[0] == starts[1] and len(starts[0]) == 2, starts          # the same generations, both hosts
    incidents = [[(e["kind"], e["generation"]) for e in _events(run, i) if e["event"] == "incident"] for i in (0, 1)]
    assert incidents[0] == incidents[1] and incidents[0][0][0] == "crash", incidents   # one decision, applied by both
    assert not [e for e in _events(run, 1) if e["event"] == "decision_mismatch"]
    for node in (0, 1):
        assert [e["reason"] for e in _events(run, node) if e["event"] == "daemon_exit"] == ["finished"]
    # the per-step losses of the last lineage equal one host with two ranks (the data order and the
    # global batch do not depend on the topology), on both ranks
    for node, rank in ((0, 0), (1, 1)):
        got = _losses(run / "logs" / f"node-{node}" / f"rank-{rank}.log")
        assert sorted(got) == sorted(expected)
        assert all(abs(got[s] - expected[s]) <= 1e-5 * max(1.0, abs(expected[s])) for s in expected), (node, rank)
