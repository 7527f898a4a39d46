"""Many machines of one run on this one machine: a real supervisor per simulated machine (its own node
rank, its own node directory), fake ranks (tests/integration/fake_worker.py) in place of MindSpore's,
and one real etcd — the multi-node protocol at a scale no test machine has.

Used by tests/integration/test_many_machines.py (8 machines, behaviour) and bench/multinode_scale.py
(4, 16 and 64 machines, figures). What it measures is the protocol and the daemons, not the ranks:
a fake rank starts in ~50 ms where MindSpore's takes seconds, and every simulated machine shares this
machine's cores, so times grow with the total processes started, not only with the protocol. To keep
the simulation from measuring only that, the fake ranks run at niceness 10 and (as root) etcd at -10:
on real machines the ranks' host work does not starve the daemon, nor a machine's load its etcd.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parents[2]
WRITES = ("Put", "Txn", "DeleteRange")          # etcd KV methods that change keys
_CRASHED = re.compile(r"crashing, as asked, at unix time ([0-9.]+)")
_STARTED = re.compile(r'grpc_server_started_total\{grpc_method="(\w+)",grpc_service="([\w.]+)",grpc_type="\w+"\} (\d+)')


def unix_s(ts: str) -> float:
    """An event's `ts` (ISO 8601, UTC, milliseconds) as seconds since the epoch."""
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def etcd_requests(etcd_url: str) -> dict[str, int]:
    """etcd's count of requests started since it started, by method (its /metrics: every call of the
    JSON gateway reaches etcd's gRPC server and is counted there, streams once per stream)."""
    host_port = etcd_url.split("://", 1)[1].split(",")[0]
    with urllib.request.urlopen(f"http://{host_port}/metrics", timeout=60) as r:
        text = r.read().decode()
    counts: dict[str, int] = {}
    for method, _, n in _STARTED.findall(text):
        counts[method] = counts.get(method, 0) + int(n)
    return counts


class SimulatedRun:
    """`machines` supervisors of one run, `ranks_per_machine` fake ranks each, one etcd at `etcd_url`.
    Every rank steps every `step_s`; the rank chosen by `crash_rank` crashes when `crash(generation)`
    asks it to, in that generation."""

    def __init__(self, root: Path, etcd_url: str, *, machines: int, ranks_per_machine: int,
                 lease_s: int = 3, step_s: float = 0.2, crash_rank: int | None = None, checkpoint_every: int = 20,
                 overrides: Sequence[str] = ()):
        self.root, self.etcd_url = root, etcd_url
        self.machines, self.per_machine, self.step_s = machines, ranks_per_machine, step_s
        self.run = root / "run"
        self.crash_cue = root / "crash"
        world = machines * ranks_per_machine
        self.sets = [f'run.dir="{self.run}"', f"run.nodes={machines}", f"parallel.dp={world}",
                     # a global batch every machine count from machines - 1 up divides (the same batch shrunk)
                     "train.micro_batch=1", f"train.grad_accum_steps={max(1, machines - 1)}",
                     f"train.global_batch={world * max(1, machines - 1)}", "run.master_port=29999",
                     f'run.coordinator="{etcd_url}"', f"run.node_lease_ttl_s={lease_s}",
                     f"run.min_nodes={max(1, machines - 1)}",
                     "run.node_rejoin_timeout_s=1", "health.restart_backoff_initial_s=0.1",
                     "health.restart_backoff_max_s=0.5", "run.kill_grace_s=2", *overrides]
        self.fake = ["--steps", "1000000", "--interval", str(checkpoint_every), "--step-s", str(step_s), "--first-step-s", "0.05"]
        if crash_rank is not None:
            self.fake += ["--crash-when", str(self.crash_cue), "--rank-faults", str(crash_rank)]
        self.procs: dict[int, subprocess.Popen] = {}
        self.expect_ended = False          # a daemon that exits while `wait` polls is a failure, unless set

    # Life ---------------------------------------------------------------------------------------
    def start(self, machine: int | None = None) -> None:
        """Starts every machine's daemon (or one machine's, again)."""
        for i in range(self.machines) if machine is None else [machine]:
            args = sum((["--set", s] for s in [*self.sets, f"run.node_rank={i}"]), [])
            out = open(self.root / f"daemon-{i}.out", "ab")
            self.procs[i] = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.supervise_fake", *args, "--", *self.fake],
                cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), FAKE_WORKER_NICE="10"), stdout=out,
                stderr=subprocess.STDOUT)
            out.close()

    def kill(self, machine: int) -> float:
        """SIGKILLs machine `machine`'s daemon (its ranks end by themselves); returns when, in unix time."""
        at = time.time()
        self.procs[machine].send_signal(signal.SIGKILL)
        self.procs[machine].wait()
        return at

    def crash(self, generation: int) -> None:
        """Cues the crashing rank to crash after its next step of `generation`."""
        tmp = self.crash_cue.with_suffix(".tmp")
        tmp.write_text(str(generation))
        tmp.replace(self.crash_cue)

    def stop(self, timeout_s: float = 60.0) -> list[int | None]:
        """SIGTERMs every daemon (each stops its ranks and exits 0), SIGKILLs what is left by the deadline;
        returns their exit codes (None: killed here)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        codes = []
        for p in self.procs.values():
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                codes.append(None)
        return codes

    # What happened ------------------------------------------------------------------------------
    def events(self, machine: int, name: str | None = None) -> list[dict]:
        path = self.run / "logs" / f"node-{machine}" / "events.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        found = [json.loads(l) for l in lines if l.endswith("}")]
        return [e for e in found if name is None or e["event"] == name]

    def first_step_s(self, machine: int, generation: int) -> float | None:
        """When machine `machine`'s ranks first stepped in `generation` (unix time), or None."""
        return next((unix_s(e["ts"]) for e in self.events(machine, "first_step") if e["generation"] == generation), None)

    def opened_s(self, machine: int, generation: int) -> float | None:
        """When machine `machine` started `generation`'s ranks (unix time), or None."""
        return next((unix_s(e["ts"]) for e in self.events(machine, "generation_start")
                     if e["generation"] == generation), None)

    def key_prefix(self) -> str:
        """The run's etcd key prefix, as node 0 said when it joined."""
        return self.events(0, "node_joined")[0]["prefix"]

    def generation(self, machine: int) -> int:
        starts = self.events(machine, "generation_start")
        return starts[-1]["generation"] if starts else 0

    def saved_in(self, generation: int) -> bool:
        """A checkpoint was committed in `generation` (rank 0, on machine 0, saves): the run progressed."""
        return any(e["generation"] == generation for e in self.events(0, "checkpoint_committed"))

    def all_stepping(self, generation: int, machines: Sequence[int] | None = None) -> bool:
        return all(self.first_step_s(m, generation) is not None
                   for m in (range(self.machines) if machines is None else machines))

    def crashed_at(self, machine: int) -> float | None:
        """When a rank on `machine` last crashed on cue (unix time, as it printed it), or None."""
        found = [float(t) for log in (self.run / "logs" / f"node-{machine}").glob("rank-*.log")
                 for t in _CRASHED.findall(log.read_text(errors="replace"))]
        return max(found, default=None)

    def wait(self, ready: Callable[[], object], timeout_s: float, what: str):
        """Polls `ready` until it returns something true; raises with `what` and the daemons' ends
        if it does not within `timeout_s`, or a daemon exits meanwhile."""
        deadline = time.monotonic() + timeout_s
        while not (got := ready()):
            ended = {i: p.returncode for i, p in self.procs.items() if p.poll() is not None}
            if time.monotonic() > deadline or (ended and not self.expect_ended):
                tails = "".join(f"\n--- daemon {i}:\n" + (self.root / f"daemon-{i}.out").read_text()[-1500:]
                                for i in list(ended)[:2])
                raise AssertionError(f"timed out waiting for {what} (ended: {ended}){tails}")
            time.sleep(0.2)
        return got


class KeyDeletion:
    """Watches etcd from now on for the deletion of `key` (a node's lease expiring deletes its key):
    `at` is when it was seen (unix time), None until then."""

    def __init__(self, etcd_url: str, key: str):
        from daemon.machines.etcd_client import Etcd

        self.client, self.key, self.at = Etcd.from_url(etcd_url, timeout_s=10.0), key.encode(), None
        _, self.revision = self.client.get_prefix(self.key)
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        from daemon.machines.etcd_client import EtcdError

        while self.at is None:
            try:
                for batch in self.client.watch_prefix(self.key, start_revision=self.revision + 1, idle_timeout_s=1.0):
                    if any(e.type == "DELETE" and e.kv.key == self.key for e in batch):
                        self.at = time.time()
                        return
                    self.revision = max(self.revision, *(e.kv.mod_revision for e in batch))
            except EtcdError:
                time.sleep(0.1)


def favoured() -> list[str]:
    """A command prefix that runs a process (etcd) ahead of the simulated machines, where this user
    may (root: niceness -10 for it and every thread it starts), else nothing."""
    return ["nice", "-n", "-10"] if os.geteuid() == 0 else []


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank: p99 of 64 values is the 64th, the slowest."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(len(ordered) * q / 100) - 1))]
