"""Starting and stopping worker processes, each in its own process group; finding orphans.

The only module of the supervisor that sends signals or forks: the rest
decides, this acts.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the pid,
    an identity that survives pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclasses.dataclass
class Worker:
    role: str                 # "scheduler" or "rank"
    rank: int                 # -1 for the scheduler
    popen: subprocess.Popen
    log_path: Path
    log_start: int = 0        # the log's size when this process started: its own output follows

    @property
    def pid(self) -> int:
        return self.popen.pid

    def record(self) -> dict:
        return {"role": self.role, "rank": self.rank, "pid": self.pid, "pgid": self.pid,
                "start_ticks": start_ticks(self.pid)}


def spawn(cmd: Sequence[str], *, env: Mapping[str, str], log_path: Path, role: str, rank: int,
          cwd: str | None = None, before_exec: Callable[[], None] | None = None) -> Worker:
    """Starts `cmd` as the leader of a new process group (and session), stdout and stderr to `log_path`;
    `before_exec` runs in the child before it execs (joining a memory cgroup)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab", buffering=0)
    start = log.seek(0, os.SEEK_END)
    popen = subprocess.Popen(list(cmd), env=dict(env), stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                             stdin=subprocess.DEVNULL, start_new_session=True,
                             preexec_fn=before_exec)
    log.close()
    return Worker(role=role, rank=rank, popen=popen, log_path=log_path, log_start=start)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(workers: Sequence[Worker], *, grace_s: float, poll_s: float = 0.05) -> None:
    """SIGTERM to every group, up to `grace_s` to exit, then SIGKILL to what is left; reaps them all."""
    for w in workers:
        if w.popen.poll() is None:
            _signal_group(w.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(w.popen.poll() is None for w in workers):
        time.sleep(poll_s)
    for w in workers:
        _signal_group(w.pid, signal.SIGKILL)     # also any children left in the group
        if w.popen.poll() is None:
            w.popen.wait()


def kill_orphans(records: Sequence[dict]) -> list[dict]:
    """Kills the process groups of a previous daemon's workers that are still alive (same pid and
    start time as recorded); returns the records it killed."""
    killed = []
    for rec in records:
        ticks = start_ticks(rec["pid"])
        if ticks is not None and ticks == rec.get("start_ticks"):
            _signal_group(rec["pgid"], signal.SIGKILL)
            killed.append(rec)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(start_ticks(r["pid"]) == r.get("start_ticks") for r in killed):
        time.sleep(0.05)
    return killed
