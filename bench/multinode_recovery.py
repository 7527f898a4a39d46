"""How fast a multi-node run comes back, in network namespaces on this machine (tests/netns.py: one
host per namespace on a bridge, one daemon and one MindSpore CPU rank each, the tiny config, lease
TTL 3 s, rejoin timeout 0 s), three ways, rounds interleaved:

    default   what a run does by default: the ranks sum gradients through a TCP hub on the decider's
              machine (a local group across machines: no MindSpore cluster to form), and each machine
              keeps a late warm standby (imported, waiting to be told its generation)
    cold      the same without the standby (`run.standby = false`): every generation starts its ranks
    cluster   MindSpore's cluster with the standby (`parallel.local_reduce = false`): the collective
              every multi-node CPU run used before the hub (the "before" of issue 33 is this bench's
              previous results, bench/results/multinode_recovery.json in git history)

    rank crash    2 hosts, etcd on host 0: rank 1 (host 1) SIGKILLed → the first step of the next
                  generation on every host (the later of the two)
    host lost     3 hosts (min_nodes 2), etcd on host 0: every process on host 2 killed and its link
                  cut → the first step of the smaller generation on both survivors
    host 0 lost   the same with host 0 (the decider, the scheduler's machine) on an embedded etcd of
                  three members, so etcd outlives it; the survivors' ranks are renumbered

Each figure is seconds from the fault, the median of --rounds with the range; the targets (issue 33):
rank crash ≤ 3 s, host lost ≤ lease + 3 s. The elastic run keeps its micro-batch on two hosts (global
batch 24: 3 x 4 x 2 becomes 2 x 4 x 3), so a local group's smaller generation reuses the compiled step
(daemon/processes/run_files.py); MindSpore's cluster compiles its new shape. Needs root (network namespaces).
Writes bench/results/multinode_recovery.json.

    sudo python bench/multinode_recovery.py [--rounds 3] [--cases rank_crash,host_lost,host0_lost]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_file  # bench/results_file.py: the one writer of bench/results

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.etcd_server import EtcdServer  # noqa: E402
from tests.netns import Hosts  # noqa: E402

LEASE_S = 3
ENV = dict(os.environ, GLOG_v="3")


def _at(event: dict) -> float:
    return datetime.datetime.fromisoformat(event["ts"].replace("Z", "+00:00")).timestamp()


def _events(run: Path, node: int) -> list[dict]:
    path = run / "logs" / f"node-{node}" / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def _named(run: Path, node: int, name: str) -> list[dict]:
    return [e for e in _events(run, node) if e["event"] == name]


def _wait(ready, timeout_s: float, what: str, procs=(), out: Path | None = None, lost=()):
    """Polls `ready` until true; raises naming `what` (and a daemon that exited meanwhile, but those of the
    `lost` hosts, with the end of its output) when it is not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (got := ready()):
        ended = [i for i, p in enumerate(procs) if p.poll() is not None and i not in lost]
        if ended or time.monotonic() > deadline:
            tail = (out / f"node-{ended[0]}.out").read_text()[-1500:] if ended and out else ""
            raise TimeoutError(f"timed out waiting for {what}" + (f"; host {ended[0]}'s daemon ended:\n{tail}"
                                                                  if ended else ""))
        time.sleep(0.05)
    return got


VARIANTS = {"default": [], "cold": ["run.standby=false"], "cluster": ["parallel.local_reduce=false"]}


def _start(hosts: Hosts, i: int, run: Path, corpus: Path, coordinator: list[str], variant: str, extra: list[str],
           out: Path) -> subprocess.Popen:
    sets = [f'data.path="{corpus}"', "train.steps=100000", "optim.cosine_steps=2000", "checkpoint.interval_steps=10",
            "train.micro_batch=4", f'run.dir="{run}"', f"run.nodes={hosts.count}", f"run.node_rank={i}",
            "run.master_port=29555", f"run.node_lease_ttl_s={LEASE_S}", *VARIANTS[variant],
            "run.kill_grace_s=5",
            *coordinator, *extra]
    log = open(out / f"node-{i}.out", "a")
    return subprocess.Popen([*hosts.prefix(i), sys.executable, "-m", "cli", "run", "--log-format", "json",
                             *sum((["--set", s] for s in sets), [])], cwd=ROOT, env=ENV, stdout=log,
                            stderr=subprocess.STDOUT)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _first_step_after(run: Path, nodes, since: float) -> float | None:
    """The latest of `nodes`' first steps in a generation opened after `since` (None until all have one)."""
    times = []
    for n in nodes:
        opened = {e["generation"] for e in _named(run, n, "generation_start") if _at(e) > since}
        steps = [_at(e) for e in _named(run, n, "first_step") if e["generation"] in opened]
        if not steps:
            return None
        times.append(min(steps))
    return max(times)


def _ready(run: Path, nodes, standby: bool) -> bool:
    return all(_named(run, n, "first_step") and (not standby or _named(run, n, "standby_ready")) for n in nodes)


def _committed_since(run: Path, since: float) -> bool:
    """A checkpoint committed (by the decider, node 0) after `since`: the fault then comes after progress, as
    in a run that has trained a while (a restart without progress waits out a backoff, by design)."""
    return any(_at(e) > since for e in _named(run, 0, "checkpoint_committed"))


def rank_crash(work: Path, corpus: Path, variant: str) -> float:
    run = work / f"crash-{variant}-{time.monotonic_ns()}"
    standby = variant != "cold"
    with Hosts(2) as hosts:
        etcd = EtcdServer(work / f"etcd-{time.monotonic_ns()}", host=hosts.addr(0), client_port=2379, peer_port=2380,
                          prefix=hosts.prefix(0)).start()
        procs = [_start(hosts, i, run, corpus, [f'run.coordinator="{etcd.url}"'], variant, ["parallel.dp=2"], work)
                 for i in range(2)]
        try:
            _wait(lambda: _ready(run, (0, 1), standby), 300, "both hosts stepping (and their standbys ready)",
                  procs, work)
            ready = time.time()
            _wait(lambda: _committed_since(run, ready), 300, "a checkpoint committed", procs, work)
            victim = _named(run, 1, "generation_start")[-1]["pids"]["1"]
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            back = _wait(lambda: _first_step_after(run, (0, 1), killed), 300, "the next generation's first steps",
                         procs, work)
            return back - killed
        finally:
            _stop(procs)
            etcd.stop()


def host_lost(work: Path, corpus: Path, variant: str, victim: int) -> float:
    run = work / f"lost{victim}-{variant}-{time.monotonic_ns()}"
    standby = variant != "cold"
    elastic = ["parallel.dp=3", "train.global_batch=24", "train.grad_accum_steps=2", "run.min_nodes=2", "run.node_rejoin_timeout_s=0"]
    with Hosts(3) as hosts:
        etcd = None
        if victim == 0:
            coordinator = ['run.coordinator="embedded"',
                           f'run.coordinator_members="{",".join(hosts.addr(h) for h in range(3))}"']
        else:
            etcd = EtcdServer(work / f"etcd-{time.monotonic_ns()}", host=hosts.addr(0), client_port=2379,
                              peer_port=2380, prefix=hosts.prefix(0)).start()
            coordinator = [f'run.coordinator="{etcd.url}"']
        procs = [_start(hosts, i, run, corpus, coordinator, variant, elastic, work) for i in range(3)]
        survivors = [n for n in range(3) if n != victim]
        try:
            _wait(lambda: _ready(run, range(3), standby), 300, "three hosts stepping", procs, work)
            ready = time.time()
            _wait(lambda: _committed_since(run, ready), 300, "a checkpoint committed", procs, work)
            lost = time.time()
            hosts.lose(victim)
            hosts.cut(victim)
            back = _wait(lambda: _first_step_after(run, survivors, lost), 300, "the smaller generation's first steps",
                         procs, work, lost=(victim,))
            return back - lost
        finally:
            hosts.restore(victim)
            _stop(procs)
            if etcd is not None:
                etcd.stop()


CASES = {"rank_crash": rank_crash, "host_lost": lambda w, c, s: host_lost(w, c, s, 2),
         "host0_lost": lambda w, c, s: host_lost(w, c, s, 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/multinode_recovery.py: skipped: network namespaces need root")
        return
    from engine.data.prepare import STDLIB, prepare

    cases = args.cases.split(",")
    seconds: dict[str, dict[str, list[float]]] = {c: {v: [] for v in VARIANTS} for c in cases}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = work / "stdlib"
        prepare([STDLIB], corpus, log=open(os.devnull, "w"))
        for _ in range(args.rounds):                          # interleaved: the machine's load hits all alike
            for case in cases:
                for variant in VARIANTS:
                    s = CASES[case](work, corpus, variant)
                    seconds[case][variant].append(round(s, 2))
                    print(f"{case:11s} {variant:8s} {s:6.2f} s", flush=True)
    summary = {c: {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "runs": v}
                   for k, v in by.items()} for c, by in seconds.items()}
    for c, by in summary.items():
        print(f"{c:11s} " + "   ".join(f"{k}: {v['median_s']:.2f} s ({v['min_s']:.2f}–{v['max_s']:.2f})"
                                       for k, v in by.items()))
    path = results_file.write("multinode_recovery", {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "cpus": len(os.sched_getaffinity(0)), "lease_ttl_s": LEASE_S, "rounds": args.rounds, "cases": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
