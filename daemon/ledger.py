"""What the daemon records and tells about its run: state.json, the event log, metrics, systemd's STATUS=.

Owns the bookkeeping every part of the supervisor loop shares — each change
of status saved, each incident recorded (on disk before anything is done
about it), each step's progress fed to the metrics and, now and then, to
the log and state.json — so that the loop itself only decides what happens.
No processes, no policy.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from daemon.control import ControlDir, Rejected, Request
from daemon.eventlog import EventLog
from daemon.incidents import Incident, IncidentRecord
from daemon.metrics import Metrics
from daemon.notify import Notifier
from daemon.protocol import StepEvent
from daemon.state import RunState

SAMPLE_RANGES_KEPT = 20000  # recent steps whose sample ranges are remembered (a skip window's source)


class Ledger:
    def __init__(self, run_dir: Path, log: EventLog, metrics: Metrics, notify: Notifier, total_steps: int):
        self.run_dir, self.log, self.metrics, self.notify = run_dir, log, metrics, notify
        self.total_steps = total_steps
        self.state = RunState.load(run_dir)
        self.sample_ranges: dict[int, tuple[int, int]] = {}   # step -> global sample range [a, b)
        self.reopen_requested = False      # set by SIGHUP (from a signal handler: only a flag)

    def tick(self, now: float | None = None) -> None:
        """From the loop, every tick: systemd's watchdog; the log files reopened after a SIGHUP."""
        self.notify.tick(now)
        if self.reopen_requested:
            self.reopen_requested = False
            self.log.reopen()
            self.emit("log_reopened", detail="SIGHUP: the log file was reopened (logrotate); the run goes on")

    def begin(self, *, total_steps: int, log_dir: Path) -> None:
        """This daemon now runs the run: its pid, the run's length and where its logs are, saved."""
        self.state.processes = []
        self.state.daemon_pid, self.state.total_steps, self.state.log_dir = os.getpid(), total_steps, str(log_dir)
        self.save()

    def save(self) -> None:
        self.state.save(self.run_dir)

    def emit(self, event: str, level: str = "info", **fields: Any) -> None:
        self.log.emit(event, level=level, **fields)

    def set_status(self, status: str, text: str = "") -> None:
        self.state.status = status
        self.save()
        if text:
            self.notify.status(text)

    def exit(self, code: int, status: str, reason: str, level: str = "info", **fields: Any) -> int:
        """The daemon ends with `code`: its status saved, a `daemon_exit` event."""
        self.set_status(status)
        self.emit("daemon_exit", level=level, code=int(code), reason=reason, **fields)
        return code

    def record(self, record: IncidentRecord, event: str, level: str) -> None:
        """An incident (with its decision, if any) into state.json, the metrics and the log."""
        self.metrics.count_incident(record.kind.value)
        self.state.incidents.append(record)
        self.save()
        self.emit(event, level=level, **record.log_fields())

    def warn(self, incident: Incident) -> None:
        """A health warning: recorded and reported, never acted on."""
        self.record(IncidentRecord(incident=incident, generation=self.state.generation, unix_s=time.time()),
                    "health_warning", "warning")

    def take_control(self, control_dir: ControlDir) -> list[Request]:
        """New control requests, each logged and remembered as the last request; rejected files reported."""
        taken = []
        for req in control_dir.poll(time.monotonic()):
            if isinstance(req, Rejected):
                self.emit("control_rejected", level="warning", file=req.file, detail=req.reason)
                continue
            self.emit("control", name=req.name, file=req.file, body=req.body or None)
            self.state.last_control = {"name": req.name, "file": req.file, "unix_s": time.time(),
                                       "reason": req.body.get("reason")}
            self.save()
            taken.append(req)
        return taken

    def progress(self, ev: StepEvent, *, log: bool, notify: bool) -> None:
        """A step of the watched rank: its sample range (a later skip's source) and the metrics always;
        systemd's STATUS= and a `progress` event (with state.json's last_progress) when asked."""
        # re-inserted (a replayed step moves to the end), so the first key is always the oldest seen
        self.sample_ranges.pop(ev.step, None)
        self.sample_ranges[ev.step] = (ev.sample_start, ev.sample_end)
        if len(self.sample_ranges) > SAMPLE_RANGES_KEPT:
            del self.sample_ranges[next(iter(self.sample_ranges))]
        self.metrics.update(step=ev.step, loss=ev.loss, tokens_per_s=ev.tokens_per_s)
        self.metrics.flush()
        if notify:
            self.notify.status(f"step {ev.step}/{self.total_steps} loss {ev.loss:.4f} {ev.tokens_per_s:.0f} tokens/s "
                               f"generation {self.state.generation}")
        if log:
            self.emit("progress", step=ev.step, loss=ev.loss, lr=ev.lr, tokens_per_s=round(ev.tokens_per_s, 1),
                      skipped=ev.skipped)
            self.state.last_progress = {"step": ev.step, "loss": ev.loss, "lr": ev.lr, "tokens": ev.tokens,
                                        "tokens_per_s": ev.tokens_per_s, "unix_s": time.time()}
            self.save()
