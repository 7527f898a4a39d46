"""Starting real MindSpore ranks the way msrun (and our supervisor) does, for the e2e tests."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from daemon.processes.mindspore_env import SCHEDULER, WORKER, free_port, process_env


def events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def daemon_events(run: Path) -> list[dict]:
    """The daemon's events.jsonl of a run (complete lines; none yet: []), each checked for the
    common fields every event carries."""
    from daemon.records.eventlog import COMMON

    path = run / "logs" / "events.jsonl"
    out = [json.loads(l) for l in path.read_text().splitlines() if l.endswith("}")] if path.exists() else []
    assert all(list(e)[:5] == list(COMMON) for e in out), "an event without the common fields"
    return out


def mount_tmpfs(path: Path, size: str) -> None:
    """A fresh tmpfs of `size` at `path` (created); skips the test where mounting is not allowed."""
    import os

    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")


def wait_for(predicate, timeout_s: float = 240, what: str = "condition", poll_s: float = 0.2) -> None:
    """Polls `predicate` every `poll_s`; fails the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


class Cluster:
    """A scheduler plus `ranks` workers running `llm-pretrain train` with the given arguments."""

    def __init__(self, cli: list[str], env: dict, workdir: Path, args: list[str], ranks: int = 2):
        self.workdir, self.ranks = workdir, ranks
        common = dict(sched_host="127.0.0.1", sched_port=free_port(), worker_num=ranks, local_worker_num=ranks)
        self.scheduler = subprocess.Popen([sys.executable, "-m", "engine.rank.scheduler"], cwd=workdir,
                                          env=process_env(env, role=SCHEDULER, **common),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.logs = [workdir / f"rank{r}.log" for r in range(ranks)]
        self.outs = [workdir / f"rank{r}.out" for r in range(ranks)]
        self.workers = [subprocess.Popen([*cli, "train", *args], cwd=workdir,
                                         env=process_env(env, role=WORKER, node_id=r, **common),
                                         stdout=open(self.outs[r], "w"), stderr=open(self.logs[r], "w"))
                        for r in range(ranks)]

    def wait(self, timeout_s: float = 300) -> list[int]:
        try:
            codes = [w.wait(timeout=timeout_s) for w in self.workers]
            self.scheduler.wait(timeout=60)
        finally:
            self.kill()
        return codes

    def kill(self) -> None:
        for p in [*self.workers, self.scheduler]:
            if p.poll() is None:
                p.kill()
                p.wait()

    def events(self, rank: int) -> list[dict]:
        return events(self.outs[rank].read_text())

    def tail(self) -> str:
        return "\n".join(log.read_text()[-4000:] for log in self.logs)   # a crash's stacks too


def run_cluster(cli, env, workdir, args, ranks=2, timeout_s=300) -> list[list[dict]]:
    cluster = Cluster(cli, env, workdir, args, ranks)
    codes = cluster.wait(timeout_s)
    assert codes == [0] * ranks, (codes, cluster.tail())
    return [cluster.events(r) for r in range(ranks)]
