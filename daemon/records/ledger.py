"""What the daemon records and tells about its run: state.json, the event log, metrics, systemd's STATUS=.

Owns the bookkeeping every part of the supervisor loop shares — each change
of status saved, each incident recorded (on disk before anything is done
about it), each step's progress fed to the metrics and, now and then, to
the log and state.json — so that the loop itself only decides what happens.
The state itself changes only through RunState's methods (daemon.records.state);
the Ledger calls them and saves.
A corrupt state.json is set aside and rebuilt from the log (daemon.records.state_rebuild)
when the Ledger is made, with a `state_rebuilt` error event. No processes,
no policy.
"""
from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path
from typing import Any, Sequence

from contracts.protocol import EvalEvent, RecoveryDirective, StepEvent
from daemon.judging import quarantine, script_reports
from daemon.judging.cadence import Cadence
from daemon.judging.goodput import Goodput
from daemon.judging.incidents import Incident, IncidentRecord, Kind
from daemon.judging.requests import Request
from daemon.records import state_rebuild
from daemon.records.eventlog import EventLog
from daemon.records.metrics import Metrics
from daemon.records.notify import Notifier
from daemon.records.state import RunState, StateCorruptError, set_aside
from daemon.records.state_file import StateFile

ENDED = ("finished", "stopped", "gave_up", "failed")   # a daemon that said so exited
SAMPLE_RANGES_KEPT = 20000  # recent steps whose sample ranges are remembered (a skip window's source)
STEP_TIMES_KEPT = 50        # recent step times whose mean is status's ETA


class Ledger:
    def __init__(self, run_dir: Path, log: EventLog, metrics: Metrics, notify: Notifier, total_steps: int):
        self.run_dir, self.log, self.metrics, self.notify = run_dir, log, metrics, notify
        self.total_steps = total_steps
        self.state = self._load()
        self.sample_ranges: dict[int, tuple[int, int]] = {}   # step -> global sample range [a, b)
        self.step_times: deque[float] = deque(maxlen=STEP_TIMES_KEPT)
        self.reopen_requested = False      # set by SIGHUP (from a signal handler: only a flag)
        self.exit_reason = ""              # why the daemon ended (its daemon_exit reason): the others follow it
        self.state_file = StateFile(run_dir, self.emit)
        self.generation_opened: float | None = None   # the current generation opened, until its first step
        self.disk_space_low = False        # said with a disk_space_low warning; cleared when space comes back
        self._cadence = None               # checkpoint.interval_steps = "auto" (daemon.judging.cadence), made when first asked
        self.rank_logs: dict[int, tuple[str, int]] = {}   # the last generation's ranks: log path, where its part begins
        self.goodput = Goodput.from_dict(self.state.goodput)   # the wall time by cause, continued from the last daemon

    def _load(self) -> RunState:
        """state.json; a corrupt one is set aside (never deleted) and rebuilt from the event log, loudly.
        The rebuilt state is saved by `begin`, before any generation starts."""
        try:
            return RunState.load(self.run_dir)
        except StateCorruptError as e:
            aside = set_aside(self.run_dir, time.time())
            events = state_rebuild.read_events(self.log.path) if self.log.path else []
            state, counts = state_rebuild.state_from_events(events)
            state.set_run(total_steps=self.total_steps, log_dir=str(self.log.path.parent) if self.log.path else "")
            self.emit("state_rebuilt", level="error", path=str(aside), detail=e.why, rebuilt=counts,
                      generations=state.generation, pending_rollback=state.pending_rollback,
                      recovery=state.recovery.to_dict() if state.recovery else None)
            return state

    def tick(self, now: float | None = None) -> None:
        """From the loop, every tick: systemd's watchdog; the log files reopened after a SIGHUP."""
        self.notify.tick(now)
        self.state_file.retry(self.state, time.monotonic())
        if self.reopen_requested:
            self.reopen_requested = False
            self.log.reopen()
            self.emit("log_reopened", detail="SIGHUP: the log file was reopened (logrotate); the run goes on")

    def begin(self, *, total_steps: int, log_dir: Path) -> None:
        """This daemon now runs the run: its pid, the run's length and where its logs are, saved."""
        ended = self.state.status in ENDED        # read before this daemon's own status is set
        self.state.begin(daemon_pid=os.getpid(), total_steps=total_steps, log_dir=str(log_dir), now_s=time.time())
        down = self.goodput.resume(time.time(), ended=ended)
        self.metrics.update(goodput=self.goodput.to_dict())
        self.save()
        self.note_goodput(**({"daemon_down_s": round(down, 3)} if down else {}))

    def next_generation(self, number: int | None = None) -> int:
        """The next generation, or generation `number` (a multi-node run's, as its decider published it)."""
        self.log.generation = self.state.next_generation(number)
        self.generation_opened = time.monotonic()
        self.goodput.open_generation(time.time())
        self.metrics.update(generation=self.state.generation)
        return self.state.generation

    def save(self) -> None:
        """state.json, atomically (a disk that refuses it never ends the daemon: daemon.records.state_file),
        with the goodput ledger as it stands."""
        self.state.note_goodput(self.goodput.to_dict())
        self.state_file.save(self.state)

    def checkpoint_failed(self, step: int, detail: str) -> None:
        """The first failed save since the last commit is a health warning (a full or read-only disk,
        most often); later ones only extend it. Training goes on; saves are tried at each interval."""
        if self.state.checkpoint_failed(step):
            self.metrics.update(checkpoints_failing_since_step=step)
            self.warn(Incident(kind=Kind.CHECKPOINT_FAILING, first_step=step, last_step=step, needs_action=False,
                               detail=f"checkpoints failing since step {step}: {detail}",
                               evidence={"detail": detail}))

    def checkpoint_committed(self, step: int) -> None:
        self.metrics.update(last_checkpoint_unix_s=time.time())
        if (failing_since := self.state.checkpoint_committed()) is not None:
            self.emit("checkpoints_resumed", step=step, failing_since_step=failing_since)
            self.metrics.update(checkpoints_failing_since_step=0)
        self.save()                        # with the step reached: `status` is never behind the checkpoints

    def command_sent(self, name: str, args: dict, append) -> None:
        """`append(name, args)` writes the command for the ranks and returns its seq; a disk that
        refuses it is an error event, not the daemon's end."""
        try:
            self.emit("command_sent", name=name, seq=append(name, args), args=args)
        except OSError as e:
            self.emit("command_failed", level="error", name=name, args=args, detail=f"{e.strerror or e}")

    def emit(self, event: str, level: str = "info", **fields: Any) -> None:
        self.log.emit(event, level=level, **fields)

    def set_status(self, status: str, text: str = "") -> None:
        self.state.set_status(status)
        self.goodput.status(status, time.time())
        self.metrics.update(status=status, goodput=self.goodput.to_dict())
        self.metrics.flush(force=True)     # a new state is in the textfile at once, not at the next step
        self.save()
        if text:
            self.notify.status(text)

    # What the others report; the Ledger writes it into the run's state (the only writer outside the rebuild)
    def note_status(self, status: str) -> None:
        """The status a decision puts the run in; saved with the decision's record."""
        self.state.set_status(status)

    def note_processes(self, records) -> None:
        """The processes of this generation (and a waiting standby's), for the next daemon to end."""
        self.state.set_processes(records)
        ranks = {r["rank"]: (r["log"], int(r.get("log_start") or 0)) for r in records
                 if r.get("role") == "rank" and not r.get("standby") and r.get("log")}
        if ranks:                          # kept past the teardown: an incident's bundle takes their tails
            self.rank_logs = ranks

    def note_committed(self, step: int, *, counts_progress: bool = False) -> None:
        """The newest committed checkpoint, either tier's (the step the run resumes from); `counts_progress`: a
        process fault's restart is counted against it."""
        if counts_progress:
            self.state.count_restart_progress(step)
        self.state.set_last_committed(step)

    def running_from(self, step: int, tier: str) -> str:
        """A generation's ranks start, resuming from `step` in `tier` (ram, disk, none): status and the STATUS line
        say so. Returns `tier`."""
        self.note_resumed(step, tier, restored=False)
        self.set_status("running", f"generation {self.state.generation}: resuming from step {step}"
                                   + (" (RAM tier)" if tier == "ram" else ""))
        return tier

    def note_resumed(self, step: int, tier: str, *, restored: bool) -> None:
        """Where this generation resumes from (status shows it): at its start, and once the ranks restored it."""
        self.state.note_resumed(step=step, tier=tier, generation=self.state.generation, restored=restored)
        if restored:
            self.save()

    def note_rollback_done(self, resume_step: int) -> None:
        self.state.rollback_done(resume_step)

    def count_restart(self) -> int:
        return self.state.count_restart()

    def note_cadence(self, cadence) -> None:
        self.state.set_cadence(cadence)

    def note_config_changes(self, changes) -> None:
        """The config changes in force, as the decider published them with a generation."""
        self.state.set_config_changes(changes)

    def set_waiting(self, what: str) -> None:
        """What the daemon waits for (`status` shows it) until its ranks run again."""
        self.state.set_waiting(what)
        self.goodput.waiting(time.time())
        self.save()
        self.notify.status(what)

    def ended_at(self, step: int) -> None:
        """The ranks ended at `step` (their exit events say so): the last progress says no less. Their last
        step datagrams may have been dropped (a full socket queue on a loaded machine), and `status` and the
        metrics must not say the run ended short of where it did."""
        last = self.state.last_progress
        if step > int(last.get("step") or 0):
            self.state.note_progress({**last, "step": step})
            self.metrics.update(step=step)

    def exit(self, code: int, status: str, reason: str, level: str = "info", **fields: Any) -> int:
        """The daemon ends with `code`: its status saved, a `daemon_exit` event."""
        self.set_status(status)
        self.exit_reason = reason
        self.note_goodput()
        self.emit("daemon_exit", level=level, code=int(code), reason=reason, **fields)
        self.metrics.update(up=0, exit_code=int(code))     # the textfile says the daemon is gone, and how
        self.metrics.flush(force=True)
        return code

    def generation_over(self, incident: Incident | None) -> None:
        """The generation's watch ended: from here to the next generation's opening is teardown (the goodput
        ledger), and the incident that ends it, if any, is saved before the teardown: a daemon killed before
        it decides leaves it for the next one to decide (never lost to a kill -9)."""
        self.goodput.generation_over(time.time())
        self.note_goodput()
        if incident is not None:
            self.state.hold_undecided(incident)
            self.save()

    def record(self, record: IncidentRecord, event: str, level: str, *,
               in_force: tuple[dict[str, Any], RecoveryDirective | None] | None = None) -> None:
        """An incident (with its decision, if any) into state.json (RunState.apply_incident, which
        `in_force` is passed to), the metrics and the log."""
        self.metrics.count_incident(record.kind.value)
        self.state.apply_incident(record, in_force=in_force)
        self.save()
        self.emit(event, level=level, **record.log_fields())

    def cadence_for(self, ck) -> Cadence | None:
        """The run's checkpoint cadence when an interval is "auto" (daemon.judging.cadence), kept across generations
        and, through state.json, daemons."""
        if self._cadence is None and "auto" in (ck.interval_steps, ck.memory_interval_steps):
            self._cadence = Cadence(ck, self.state.cadence)
        return self._cadence

    def triaged(self, verdict: str, first_step: int, evidence: dict[str, Any], health=None) -> None:
        """A rerun's verdict (daemon.judging.triage): into state.json (the pending rerun is settled), the metrics
        and the log — a transient fault as a warning (training went on past it), counted on the lemon list
        against where its suspects run: `health.transient_faults_to_quarantine` of them within
        `transient_fault_window_s` quarantine the device (machine) for the next generations."""
        self.state.triaged(verdict, first_step, evidence.get("suspects") or ())
        self.metrics.count_triage(verdict)
        detail = {"transient": "not reproduced: a transient fault; training goes on from the rerun (no rollback, no "
                               "skip, no lr cut)",
                  "device": "the fault stayed with its rank when the shares were rotated: a device fault",
                  "data": "rotated across the replicas, the fault followed the data (or cannot be told): the policy "
                          "acts on it"}.get(verdict, "reproduced: the data or the numbers; the policy acts on it")
        self.emit("triage", level="warning" if verdict in ("transient", "device") else "info", detail=detail,
                  **evidence)
        if verdict == "transient" and health is not None:
            self._count_transient(first_step, evidence.get("homes") or {}, health)
        self.save()

    def _count_transient(self, step: int, homes: dict[str, Any], health) -> None:
        now = time.time()
        for node, device in {tuple(v) for v in homes.values()}:
            entry = self.state.note_fault(node, device, kind="transient", step=step, unix_s=now)
            n = quarantine.recent_faults(entry, "transient", now, health.transient_fault_window_s)
            if health.transient_faults_to_quarantine and n >= health.transient_faults_to_quarantine \
                    and not quarantine.entry_excludes(entry, now):
                reason = (f"{n} transient faults within {health.transient_fault_window_s:g} s (health."
                          f"transient_faults_to_quarantine = {health.transient_faults_to_quarantine})")
                self.state.quarantine(node, device, kind="transient", step=step, unix_s=now,
                                      for_s=health.quarantine_probation_s, reason=reason, counted=True)
                self.emit("quarantined", level="warning", node=node, device=quarantine.as_device(device),
                          until_unix_s=now + health.quarantine_probation_s, detail=reason + ": left out from the "
                          "next generation")

    def warn(self, incident: Incident) -> None:
        """A health warning: recorded and reported, never acted on."""
        self.record(IncidentRecord(incident=incident, generation=self.state.generation, unix_s=time.time()),
                    "health_warning", "warning")

    def note_control(self, request: Request) -> None:
        """A control request taken (daemon.processes.control.intake): logged, and remembered as the run's last."""
        self.emit("control", name=request.name, file=request.file, body=request.body or None)
        self.state.take_control(name=request.name, file=request.file, unix_s=time.time(),
                                reason=request.body.get("reason"))
        self.save()

    def validated(self, ev: EvalEvent) -> None:
        """The validation loss after a step: a `validation` event, the metrics, and status (state.json)."""
        self.emit("validation", step=ev.step, loss=ev.loss, perplexity=ev.perplexity, sequences=ev.sequences,
                  tokens=ev.tokens, seconds=round(ev.seconds, 3))
        self.goodput.claim("validation", ev.seconds, time.time())
        self.metrics.update(validation_loss=ev.loss, validation_step=ev.step, goodput=self.goodput.to_dict())
        self.metrics.flush()
        self.state.note_validation({"step": ev.step, "loss": ev.loss, "perplexity": ev.perplexity,
                                    "unix_s": time.time()})
        self.save()

    def script_reports(self, reports: Sequence[str]) -> None:
        """What a supervised script reports: said once, in a `script_reports` event naming the detectors that are off
        (again only when it changes: another script version), and kept for status."""
        said = script_reports.describe(reports)
        if said == self.state.script_reports:
            return
        self.emit("script_reports", level="warning" if said["missing"] else "info", **said)
        self.state.note_script_reports(said)
        self.save()

    def progress(self, ev: StepEvent, *, log: bool, notify: bool, compiled: bool = False) -> None:
        """A step of the watched rank: its sample range (a later skip's source) and the metrics always;
        systemd's STATUS= and a `progress` event (with state.json's last_progress) when asked. The
        mean of the last STEP_TIMES_KEPT step times (never a compiling first step) makes status's ETA."""
        self.goodput.step(time.time(), step=ev.step, step_s=ev.step_s, data_wait_s=ev.data_wait_s,
                          loop_s=ev.loop_s, memory_save_s=ev.memory_save_s)
        if not compiled:
            self.step_times.append(ev.step_s)
        elif self.generation_opened is not None:      # training again: recovery's last leg, timed
            self.emit("first_step", step=ev.step, since_open_s=round(time.monotonic() - self.generation_opened, 2))
            self.generation_opened = None
        # re-inserted (a replayed step moves to the end), so the first key is always the oldest seen
        self.sample_ranges.pop(ev.step, None)
        self.sample_ranges[ev.step] = (ev.sample_start, ev.sample_end)
        if len(self.sample_ranges) > SAMPLE_RANGES_KEPT:
            del self.sample_ranges[next(iter(self.sample_ranges))]
        self.metrics.update(step=ev.step, loss=ev.loss, tokens_per_s=ev.tokens_per_s,
                            tokens_total=self.metrics.tokens_total + ev.tokens, goodput=self.goodput.to_dict())
        self.metrics.flush()
        if notify:
            self.notify.status(f"step {ev.step}/{self.total_steps} loss {ev.loss:.4f} {ev.tokens_per_s:.0f} tokens/s "
                               f"generation {self.state.generation}")
        # always in memory, so that every save (a commit, a pause, a stop, the exit) records the last step
        self.state.note_progress({"step": ev.step, "loss": ev.loss, "lr": ev.lr, "tokens": ev.tokens,
                                  "tokens_per_s": ev.tokens_per_s, "unix_s": time.time(),
                                  "mean_step_s": sum(self.step_times) / len(self.step_times)
                                  if self.step_times else None})
        if log:
            mean = self.state.last_progress["mean_step_s"]
            eta = round(max(0, self.total_steps - ev.step) * mean, 1) if mean and self.total_steps else None
            self.emit("progress", step=ev.step, total_steps=self.total_steps or None, loss=ev.loss, lr=ev.lr,
                      tokens_per_s=round(ev.tokens_per_s, 1), eta_s=eta, skipped=ev.skipped)
            self.note_goodput()
            self.save()

    # The goodput ledger (daemon.judging.goodput): fed here, saved with the state, told in `goodput` events
    def phase(self, phase: str) -> None:
        """The watched rank entered a phase (restore, compile: a restart's parts)."""
        self.goodput.phase(phase, time.time())

    def checkpoint_stall(self, seconds: float) -> None:
        """A save blocked the watched rank's steps this long (its `staged` seconds)."""
        self.goodput.claim("checkpoint", seconds, time.time())

    def note_goodput(self, **fields: Any) -> None:
        """A `goodput` event with the ledger whole (what the rebuild from the log continues from) and the
        metrics; written with each progress event, at each generation's end, the daemon's start and exit."""
        ledger = self.goodput.to_dict()
        self.metrics.update(goodput=ledger)
        self.emit("goodput", step=self.goodput.high_step, **ledger, **fields)
