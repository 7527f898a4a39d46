"""The multi-node protocol at 4, 16 and 64 machines, simulated on this one: a real supervisor per
machine (its own node rank), 8 fake ranks each (tests/integration/fake_worker.py: they step, save and
crash on cue; no MindSpore), one real etcd (tests/integration/simulated_machines.py).

For each size:

    etcd while training   requests per second by kind over a 20 s window of steady training, per
                          machine; writes (Put, Txn, DeleteRange) apart: none should come per step
    status                `llm-pretrain status --json` of the whole run, wall seconds (median of 3)
    rank crash            a rank on machine 37/64 of the way in crashes on cue: seconds from its crash
                          until each machine opened the next generation (its ranks spawned) and until
                          its ranks first stepped in it, p50 and p99 over the machines; median of
                          --rounds crashes
    decider killed        node 0's daemon SIGKILLed: its lease expires 0.75 to 1 TTL later (renewed every
                          TTL / 4); from when etcd deleted its key (the bench's own watch), seconds until another
                          daemon is elected, and until every survivor's ranks step in the smaller
                          generation (p50, p99)

What it measures is the protocol and the daemons on one shared machine, not a cluster: a fake rank
starts in ~50 ms where MindSpore's takes seconds; every simulated machine shares this machine's
cores (fake ranks at niceness 10, etcd at -10 as root, its data and the run on /dev/shm), so a
generation's start grows with the total processes spawned. The lease TTL is 30 s (run.node_lease_ttl_s):
shorter ones were lost at 64 machines to CPU starvation while 512 ranks started at once on 2 cores,
which no real machine sees. Growth worse than linear in machines would be a bug.

    python bench/multinode_scale.py [--sizes 4,16,64] [--rounds 3]

Writes bench/results/multinode_scale.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
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
from tests.integration.simulated_machines import (  # noqa: E402
    WRITES,
    KeyDeletion,
    SimulatedRun,
    etcd_requests,
    favoured,
    percentile,
    unix_s,
)

PER_MACHINE = 8
LEASE_S = 30
WINDOW_S = 20.0


def _spread(values: list[float]) -> dict:
    return {"p50": round(percentile(values, 50), 2), "p99": round(percentile(values, 99), 2)}


def _median(rounds: list[dict], key: str) -> dict:
    return {q: round(statistics.median(r[key][q] for r in rounds), 2) for q in ("p50", "p99")}


def traffic(sim: SimulatedRun, url: str) -> dict:
    before, t0 = etcd_requests(url), time.monotonic()
    time.sleep(WINDOW_S)
    after, seconds = etcd_requests(url), time.monotonic() - t0
    per_s = {k: round((v - before.get(k, 0)) / seconds, 2) for k, v in after.items() if v != before.get(k, 0)}
    total = sum(per_s.values())
    return {"per_s": per_s, "total_per_s": round(total, 2), "per_machine_per_s": round(total / sim.machines, 2),
            "writes_per_s": round(sum(per_s.get(k, 0.0) for k in WRITES), 2),
            "steps_per_s": round(sim.machines * PER_MACHINE / sim.step_s, 1)}


def status_s(sim: SimulatedRun) -> float:
    times = []
    for _ in range(3):
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "cli", "status", "--json", str(sim.run)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        times.append(time.monotonic() - t0)
        shown = json.loads(out.stdout)
        assert len(shown["nodes"]) == sim.machines, out.stdout[-500:]
    return round(statistics.median(times), 2)


def crash_round(sim: SimulatedRun, machine: int) -> dict:
    g = max(sim.generation(m) for m in range(sim.machines))
    # progress first (a checkpoint in this generation): else the third crash is a crash loop, and halts
    sim.wait(lambda: sim.saved_in(g), 900, f"a checkpoint in generation {g}")
    sim.crash(g)
    sim.wait(lambda: sim.all_stepping(g + 1), 900, f"every machine stepping in generation {g + 1}")
    crashed = sim.crashed_at(machine)
    return {"opened_s": _spread([sim.opened_s(m, g + 1) - crashed for m in range(sim.machines)]),
            "first_step_s": _spread([sim.first_step_s(m, g + 1) - crashed for m in range(sim.machines)])}


def decider_killed(sim: SimulatedRun) -> dict:
    g = max(sim.generation(m) for m in range(sim.machines))
    sim.expect_ended = True
    lease = KeyDeletion(sim.etcd_url, sim.key_prefix() + "nodes/0")
    killed = sim.kill(0)
    survivors = range(1, sim.machines)
    sim.wait(lambda: sim.all_stepping(g + 1, survivors), 900, "the survivors stepping in a smaller generation")
    elected = min(unix_s(e["ts"]) for m in survivors for e in sim.events(m, "elected"))
    # the lease expires 0.75 to 1 TTL after the kill (renewed every TTL / 4): timed from when etcd
    # deleted node 0's key (seen by a watch of this bench's own)
    sim.wait(lambda: lease.at, 60, "etcd to say node 0's key is gone")
    expired = lease.at
    steps = [sim.first_step_s(m, g + 1) - expired for m in survivors]
    return {"lease_expired_s": round(expired - killed, 2), "elected_s": round(elected - expired, 2),
            "first_step_s": _spread(steps)}


def one_size(machines: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as tmp:
        root = Path(tmp)
        etcd = EtcdServer(root / "etcd", prefix=favoured()).start()
        crashing = machines * 37 // 64
        sim = SimulatedRun(root, etcd.url, machines=machines, ranks_per_machine=PER_MACHINE, lease_s=LEASE_S,
                           step_s=max(0.2, 0.005 * machines * PER_MACHINE), crash_rank=crashing * PER_MACHINE + 1,
                           checkpoint_every=5)
        t0 = time.monotonic()
        sim.start()
        try:
            sim.wait(lambda: sim.all_stepping(1), 900, "every machine stepping")
            started = round(time.monotonic() - t0, 1)
            time.sleep(3)
            row = {"machines": machines, "ranks": machines * PER_MACHINE, "step_s": sim.step_s,
                   "all_stepping_s": started, "etcd": traffic(sim, etcd.url), "status_s": status_s(sim)}
            crashes = [crash_round(sim, crashing) for _ in range(rounds)]
            row["rank_crash"] = {"rounds": crashes, "opened_s": _median(crashes, "opened_s"),
                                 "first_step_s": _median(crashes, "first_step_s")}
            row["decider_killed"] = decider_killed(sim)
        finally:
            sim.stop()
            etcd.stop()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4,16,64")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from daemon.machines.embedded_etcd import INSTALL_ETCD, find_etcd

    if find_etcd() is None:
        print(f"bench/multinode_scale.py: skipped: no etcd binary: {INSTALL_ETCD}")
        return
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        rows.append(one_size(n, args.rounds))
        r = rows[-1]
        print(f"{n:3d} machines: start {r['all_stepping_s']:5.1f} s; etcd {r['etcd']['per_machine_per_s']:.2f} req/s "
              f"per machine ({r['etcd']['writes_per_s']:.2f} writes/s, {r['etcd']['steps_per_s']:.0f} steps/s); "
              f"status {r['status_s']:.2f} s; crash → opened p50/p99 {r['rank_crash']['opened_s']['p50']:.2f}/"
              f"{r['rank_crash']['opened_s']['p99']:.2f} s, → first step {r['rank_crash']['first_step_s']['p50']:.2f}/"
              f"{r['rank_crash']['first_step_s']['p99']:.2f} s; decider's lease expired → elected "
              f"{r['decider_killed']['elected_s']:.2f} s, → first step {r['decider_killed']['first_step_s']['p50']:.2f}/"
              f"{r['decider_killed']['first_step_s']['p99']:.2f} s", flush=True)
    path = results_file.write("multinode_scale", {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "ranks_per_machine": PER_MACHINE, "lease_ttl_s": LEASE_S, "window_s": WINDOW_S, "sizes": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
