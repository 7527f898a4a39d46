"""How fast a multi-node run comes back, in network namespaces on this machine (tests/netns.py: one
host per namespace on a bridge, one daemon and one MindSpore CPU rank each, the tiny config, lease
TTL 3 s, rejoin timeout 0 s), five ways, rounds interleaved:

    default   what a run does by default: the ranks sum gradients through a TCP hub on the decider's
              machine (a local group across machines: no MindSpore cluster to form), and each machine
              keeps a late warm standby (imported, waiting to be told its generation); checkpoints at the
              config's own interval (every 50 steps, to the disk)
    ram       the same with the RAM tier on every machine, every step (`checkpoint.memory_interval_steps
              = 1`): the survivors resume from the newest RAM step they all hold (issue 50, item 1)
    buddy     the RAM tier every step in buddy placement (`checkpoint.memory_placement = "buddy"`): each
              machine's RAM holds its own part of a step and a copy of one peer's; the survivors make a step
              whole from their parts and the lost machine's copy (issue 50, item 3)
    cold      the default without the standby (`run.standby = false`): every generation starts its ranks
    cluster   MindSpore's cluster with the standby (`parallel.local_reduce = false`): the collective
              every multi-node CPU run used before the hub (the "before" of issue 33 is this bench's
              previous results, bench/results/multinode_recovery.json in git history)

    rank crash    2 hosts, etcd on host 0: rank 1 (host 1) SIGKILLed → the first step of the next
                  generation on every host (the later of the two)
    host lost     3 hosts (min_nodes 2), etcd on host 0: every process on host 2 killed and its link
                  cut → the first step of the smaller generation on both survivors
    host 0 lost   the same with host 0 (the decider, the scheduler's machine) on an embedded etcd of
                  three members, so etcd outlives it; the survivors' ranks are renumbered

Each figure is seconds from the fault, the median of --rounds with the range, and beside it the steps lost:
the newest step the survivors' ranks had trained when the fault came, less the step the next generation resumed
from (what is trained again). The fault comes a random number of steps (5-44, seeded, the same for every variant
of a round) after a disk checkpoint, as faults come anywhere in the interval. Targets: rank crash ≤ 3 s, host lost ≤ lease + 3 s (issue 33); ≤ 1 step lost with
the RAM tier every step (issue 50). The elastic run keeps its micro-batch on two hosts (global
batch 24: 3 x 4 x 2 becomes 2 x 4 x 3), so a local group's smaller generation reuses the compiled step
(daemon/processes/run_files.py); MindSpore's cluster compiles its new shape. Needs root (network namespaces).
Writes bench/results/multinode_recovery.json; with --cases, the cases not run keep their figures there (each
case says its own sitting: `when`, `rounds`).

    sudo python bench/multinode_recovery.py [--rounds 3] [--cases rank_crash,host_lost,host0_lost]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
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


VARIANTS = {"default": [], "ram": ["checkpoint.memory_interval_steps=1"], "cold": ["run.standby=false"],
            "cluster": ["parallel.local_reduce=false"],
            # each machine's RAM its own part and a copy of a buddy's (checkpoint.memory_placement, issue 50 item 3)
            "buddy": ["checkpoint.memory_interval_steps=1", 'checkpoint.memory_placement="buddy"']}


def _start(hosts: Hosts, i: int, run: Path, corpus: Path, coordinator: list[str], variant: str, extra: list[str],
           out: Path) -> subprocess.Popen:
    sets = [f'data.path="{corpus}"', "train.steps=100000", "optim.cosine_steps=2000", "train.log_interval_steps=1",
            "train.micro_batch=4", f'checkpoint.memory_dir="{out / "shm"}"', f'run.dir="{run}"', f"run.nodes={hosts.count}", f"run.node_rank={i}",
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


def _steps_lost(run: Path, nodes, since: float) -> int:
    """The newest step any of `nodes`' ranks trained in the generation a fault after `since` ended, less the step
    the next generation (its first opened after `since`, on the first of `nodes`) resumed from."""
    opened = [e for e in _named(run, nodes[0], "generation_start") if _at(e) > since]
    ended = opened[0]["generation"] - 1
    trained = [e["step"] for e in _step_events(run, nodes) if e["generation"] == ended]
    return max(trained) - opened[0]["resume_step"]


def _ready(run: Path, nodes, standby: bool) -> bool:
    return all(_named(run, n, "first_step") and (not standby or _named(run, n, "standby_ready")) for n in nodes)


def _step_events(run: Path, nodes) -> list[dict]:
    """The step events in `nodes`' rank logs (whole lines: a log is being written)."""
    found = []
    for log in (path for n in nodes for path in (run / "logs" / f"node-{n}").glob("rank-*.log")):
        for line in log.read_text().splitlines():
            if line.startswith("{") and line.endswith("}"):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("kind") == "step":
                    found.append(event)
    return found


def _newest_step(run: Path, nodes) -> int:
    """The newest step any of `nodes`' ranks has logged."""
    return max((e["step"] for e in _step_events(run, nodes)), default=0)


def _into_the_interval(run: Path, nodes, since: float, after: int, procs, work: Path) -> None:
    """Waits for a checkpoint committed after `since`, then `after` steps more: the fault comes that far into the
    disk interval (a random moment of it, the same in every variant of a round), not just after a save."""
    _wait(lambda: _committed_since(run, since), 300, "a checkpoint committed", procs, work)
    committed = max(e["step"] for e in _named(run, 0, "checkpoint_committed") if _at(e) > since)
    _wait(lambda: _newest_step(run, nodes) >= committed + after, 300, f"{after} steps after step {committed}",
          procs, work)


def _committed_since(run: Path, since: float) -> bool:
    """A checkpoint committed (by the decider, node 0) after `since`: the fault then comes after progress, as
    in a run that has trained a while (a restart without progress waits out a backoff, by design)."""
    return any(_at(e) > since for e in _named(run, 0, "checkpoint_committed"))


def rank_crash(work: Path, corpus: Path, variant: str, after: int) -> tuple[float, int]:
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
            _into_the_interval(run, (0, 1), time.time(), after, procs, work)
            victim = _named(run, 1, "generation_start")[-1]["pids"]["1"]
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            back = _wait(lambda: _first_step_after(run, (0, 1), killed), 300, "the next generation's first steps",
                         procs, work)
            return back - killed, _steps_lost(run, (0, 1), killed)
        finally:
            _stop(procs)
            etcd.stop()


def host_lost(work: Path, corpus: Path, variant: str, victim: int, after: int) -> tuple[float, int]:
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
            _into_the_interval(run, range(3), time.time(), after, procs, work)
            lost = time.time()
            hosts.lose(victim)
            hosts.cut(victim)
            back = _wait(lambda: _first_step_after(run, survivors, lost), 300, "the smaller generation's first steps",
                         procs, work, lost=(victim,))
            return back - lost, _steps_lost(run, survivors, lost)
        finally:
            hosts.restore(victim)
            _stop(procs)
            if etcd is not None:
                etcd.stop()


CASES = {"rank_crash": rank_crash, "host_lost": lambda w, c, s, a: host_lost(w, c, s, 2, a),
         "host0_lost": lambda w, c, s, a: host_lost(w, c, s, 0, a)}
INTERVAL = 50                 # the config's own disk interval (checkpoint.interval_steps' default)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/multinode_recovery.py: skipped: network namespaces need root")
        return
    from engine.data.prepare import STDLIB, prepare

    cases, variants = args.cases.split(","), args.variants.split(",")
    seconds: dict[str, dict[str, list[float]]] = {c: {v: [] for v in variants} for c in cases}
    lost: dict[str, dict[str, list[int]]] = {c: {v: [] for v in variants} for c in cases}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = work / "stdlib"
        prepare([STDLIB], corpus, log=open(os.devnull, "w"))
        rng = random.Random(50)
        for _ in range(args.rounds):                          # interleaved: the machine's load hits all alike
            for case in cases:
                after = rng.randrange(5, INTERVAL - 5)        # where in the disk interval the fault comes
                for variant in variants:
                    s, steps = CASES[case](work, corpus, variant, after)
                    seconds[case][variant].append(round(s, 2))
                    lost[case][variant].append(steps)
                    print(f"{case:11s} {variant:8s} {s:6.2f} s {steps:4d} steps lost (fault {after} steps after a "
                          "disk checkpoint)", flush=True)
    summary = {c: {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v), "runs": v,
                       "median_steps_lost": statistics.median(lost[c][k]), "steps_lost": lost[c][k]}
                   for k, v in by.items()} for c, by in seconds.items()}
    for c, by in summary.items():
        print(f"{c:11s} " + "   ".join(f"{k}: {v['median_s']:.2f} s ({v['min_s']:.2f}–{v['max_s']:.2f}), "
                                       f"{v['median_steps_lost']:g} steps lost" for k, v in by.items()))
    when = datetime.datetime.now(datetime.timezone.utc).isoformat()
    for by in summary.values():
        by.update(when=when, rounds=args.rounds)     # each case its own sitting: --cases keeps the others'
    kept = {c: by for c, by in results_file.read("multinode_recovery").get("cases", {}).items() if c not in summary}
    path = results_file.write("multinode_recovery", {
        "when": when, "cpus": len(os.sched_getaffinity(0)), "lease_ttl_s": LEASE_S, "rounds": args.rounds,
        "checkpoint_interval_steps": INTERVAL, "cases": {**kept, **summary}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
