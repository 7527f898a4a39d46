"""The faults the soak injects, each a real one, and how each one's detection and recovery show.

Every fault has an `inject` that does it to the live run and a `settled` check the soak polls:
  crash        kill -9 of a random rank                  detected: incident crash
  sigstop      SIGSTOP of a random rank (never resumed)  detected: incident hang
  hang         the `hang` drill (a rank sleeps)          detected: incident hang
  daemon-kill  kill -9 of the daemon                     restarted as systemd would (or by it)
  disk-full    a ballast file leaves less free space     detected: checkpoint_failed; recovered:
               than one checkpoint needs, removed once   a checkpoint committed after the removal
               a save has failed
  nan, spike   the drills through the control directory  detected: incident non_finite / loss_spike
A fault that ends the generation is recovered when rank 0 logs a step of a later generation.
"""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Protocol

from chaos.view import RunView
from contracts.config import Config
from contracts.protocol import InjectRequest
from daemon.processes import control


class Restarter(Protocol):
    def killed(self, pid: int) -> None: ...


class Soak(Protocol):
    """What a fault needs of the soak that injects it (chaos.soak.Soak is one): the run, how to read it,
    the random source, and the daemon's keeper, told of a daemon it killed."""

    cfg: Config
    run_dir: Path
    view: RunView
    rng: random.Random
    daemon: Restarter


CRASH_ONLY = ("crash", "sigstop", "hang", "daemon-kill", "disk-full")   # recovery keeps the trajectory bit-exact
NUMERIC = ("nan", "spike")                                             # rollbacks change it by design
ALL = (*CRASH_ONLY, *NUMERIC)
BALLAST = ".chaos-ballast"


@dataclasses.dataclass
class Injection:
    fault: str
    at: float                       # Unix seconds
    generation: int                 # the generation that was running
    step: int                       # rank 0's newest step then
    rank: int | None = None
    detail: str = ""
    detected_at: float | None = None
    recovered_at: float | None = None
    resume_step: int | None = None
    lost_steps: int | None = None
    error: str | None = None
    _cleared_at: float | None = None     # disk-full: when the ballast was removed

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if not k.startswith("_")}
        out["detection_s"] = round(self.detected_at - self.at, 3) if self.detected_at else None
        out["recovery_s"] = round(self.recovered_at - self.at, 3) if self.recovered_at else None
        return out


def inject(fault: str, soak: Soak) -> Injection:
    generation, step = soak.view.last_step()
    inj = Injection(fault, time.time(), generation, step)
    {"crash": _signal_rank, "sigstop": _signal_rank, "hang": _drill, "nan": _drill, "spike": _drill,
     "daemon-kill": _kill_daemon, "disk-full": _fill_disk}[fault](soak, inj)
    return inj


def _signal_rank(soak: Soak, inj: Injection) -> None:
    pids = {r: p for r, p in soak.view.rank_pids().items() if r >= 0}      # -1 is the scheduler
    inj.rank = soak.rng.choice(sorted(pids))
    sig = signal.SIGKILL if inj.fault == "crash" else signal.SIGSTOP
    os.kill(pids[inj.rank], sig)
    inj.detail = f"{sig.name} to rank {inj.rank} (pid {pids[inj.rank]})"


def _drill(soak: Soak, inj: Injection) -> None:
    inj.rank = soak.rng.randrange(soak.cfg.parallel.world_size)
    body = {"fault": inj.fault, "rank": inj.rank}
    if inj.fault == "hang":
        body["seconds"] = 3600.0
    request = InjectRequest.from_dict(body)
    path = control.write_request(soak.run_dir / "control", "inject", {**request.to_dict(), "reason": "chaos"})
    inj.detail = f"{inj.fault} drill on rank {inj.rank} ({path.name})"


def _kill_daemon(soak: Soak, inj: Injection) -> None:
    pid = soak.view.daemon_pid()
    if pid is None:
        raise RuntimeError("no daemon pid in daemon.lock")
    os.kill(pid, signal.SIGKILL)
    inj.detected_at = inj.at
    inj.detail = f"SIGKILL to the daemon (pid {pid})"
    soak.daemon.killed(pid)


def _fill_disk(soak: Soak, inj: Injection) -> None:
    root = soak.run_dir / "checkpoints"
    keep = max(1 << 20, last_checkpoint_bytes(root) // 2)
    # before the first checkpoint there is no checkpoints/ yet: the run directory is on the same filesystem
    size = shutil.disk_usage(root if root.is_dir() else soak.run_dir).free - keep
    if size > 0:
        fd = os.open(soak.run_dir / BALLAST, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
    inj.detail = f"{max(size, 0):,} bytes of ballast: {keep:,} left free, under one checkpoint"


def clear_disk(soak: Soak) -> None:
    (soak.run_dir / BALLAST).unlink(missing_ok=True)


def last_checkpoint_bytes(root: Path) -> int:
    steps = sorted(p for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit())
    return sum(f.stat().st_size for f in steps[-1].iterdir() if f.is_file()) if steps else 0


# the daemon's first word on each: its `crash`/`hang` note, or the incident_detected of a numerical one
_DETECTED_BY = {"crash": ("crash",), "sigstop": ("hang",), "hang": ("hang",),
                "nan": ("non_finite", "overflow_storm"), "spike": ("loss_spike",)}


def _detects(event: dict, fault: str) -> bool:
    name, kinds = event.get("event"), _DETECTED_BY[fault]
    return name in kinds or (name in ("incident_detected", "incident") and event.get("kind") in kinds)


def settled(soak: Soak, inj: Injection) -> bool:
    """Polled until True: fills in detection, recovery, resume step and steps lost."""
    view, now = soak.view, time.time()
    if inj.fault == "disk-full":
        return _disk_settled(soak, inj, now)
    if inj.detected_at is None:
        for e in view.events(inj.at):
            if _detects(e, inj.fault):
                inj.detected_at = e["unix_s"]
                break
        else:
            return False
    start = view.generation_start()
    generation, _ = view.last_step()
    if start is None or int(start["generation"]) <= inj.generation or generation < int(start["generation"]):
        return False
    inj.recovered_at, inj.resume_step = now, int(start.get("resume_step") or 0)
    before = [s.step for s in view.steps() if s.generation == inj.generation]
    inj.lost_steps = max(0, max(before, default=inj.step) - inj.resume_step)
    return True


def _disk_settled(soak: Soak, inj: Injection, now: float) -> bool:
    view = soak.view
    if inj._cleared_at is None:
        failed = view.first("checkpoint_failed", inj.at)
        if failed is None:
            return False
        inj.detected_at = failed["unix_s"]
        clear_disk(soak)
        inj._cleared_at = time.time()
        return False
    committed = view.first("checkpoint_committed", inj._cleared_at)
    if committed is None:
        return False
    inj.recovered_at, inj.lost_steps = committed["unix_s"], 0
    return True
