"""The watch over one generation: a pure state machine from what the ranks do to how the generation ends.

Owns every judgement the supervisor makes while ranks run — which events
count, the pause states, what a control request becomes, stop and its
timeout, an exit told as finished / crash / out of memory / final error, a
hang by phase, a numerical incident from the health detectors — and nothing
else. No clock (every call takes `now`), no processes, no files: the
supervisor feeds it

    on_event(ev, now)  on_exit(rank, code, now, ...)  on_control(request, now)  request_stop(reason, now)

then asks `tick(now)` for an `Outcome`, and carries out the `Effect`s that
`drain()` hands it (commands for the ranks, log events, status, stack dumps).
Between generations, `idle_control` says what a request means with no ranks.
"""
from __future__ import annotations

import dataclasses
import enum
import signal
from typing import Any, Mapping, Sequence

from contracts.config import Config
from contracts.protocol import (FINAL_WORKER_CODES, CheckpointEvent, DataFaultEvent, EvalEvent, ExitEvent,
                                FingerprintEvent, PhaseEvent, StepEvent)
from contracts.phase_board import Slot
from daemon.judging import hang, stall
from daemon.judging.health import HealthMonitor
from daemon.judging.incidents import Incident, Kind
from daemon.judging.policy import NUMERIC
from daemon.judging.replicas import ReplicaCheck
from daemon.judging.requests import VERBS, Request
from daemon.judging.straggler import StragglerDetector
from daemon.judging.triage import RerunCheck, observed_values, suspects

STATUS_EVERY_S = 2.0        # sd_notify STATUS= at most this often
PROGRESS_LOG_EVERY_S = 10.0  # a `progress` event (and state.json's last_progress) at most this often
# Exit codes after which restarting a worker cannot help: pass them on.


# The incidents each fault drill is expected to cause (a drill's incident is labelled as such).
DRILL_KINDS = {"nan": {Kind.NON_FINITE, Kind.OVERFLOW_STORM}, "bitflip": {Kind.NON_FINITE, Kind.OVERFLOW_STORM},
               "corrupt-weight": {Kind.REPLICA_MISMATCH},
               "faulty-rank": {Kind.RANK_OUTLIER, Kind.GRAD_NORM_SPIKE, Kind.GRAD_NORM_BURST, Kind.LOSS_SPIKE},
               "spike": {Kind.LOSS_SPIKE, Kind.LOSS_COLLAPSE, Kind.GRAD_NORM_SPIKE, Kind.GRAD_NORM_BURST,
                         Kind.RANK_OUTLIER},
               "hang": {Kind.HANG}, "crash": {Kind.CRASH}, "oom": {Kind.OOM},
               "slow": {Kind.STRAGGLER, Kind.THROUGHPUT_REGRESSION, Kind.HANG}}


class Pause(enum.Enum):
    RUNNING = "running"
    PAUSING = "pausing"        # `pause` sent; waiting for every rank to hold at the agreed step
    PAUSED = "paused"          # every rank holds
    RELEASING = "releasing"    # paused too long: `release` sent, the ranks exit and free their devices


_PAUSE_MOVES = {Pause.RUNNING: {Pause.PAUSING}, Pause.PAUSING: {Pause.PAUSED, Pause.RUNNING},
                Pause.PAUSED: {Pause.RUNNING, Pause.RELEASING}, Pause.RELEASING: set()}


class IllegalTransitionError(RuntimeError):
    """A pause transition the table does not allow: a bug, never user input."""


# Effects: what the supervisor is asked to do ------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Send:
    """Append a command for the ranks (applied by all after the same step)."""
    name: str
    args: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Note:
    """Log one event."""
    event: str
    level: str = "info"
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Status:
    """The run's status changed (state.json); `text`, if any, for systemd's STATUS=."""
    status: str
    text: str = ""


@dataclasses.dataclass(frozen=True)
class Validated:
    """The validation loss the ranks measured after a step: an event, the metrics and status keep it."""
    event: EvalEvent


@dataclasses.dataclass(frozen=True)
class Progress:
    """A step of the watched rank: metrics always; `log` a progress event, `notify` systemd's STATUS=."""
    event: StepEvent
    log: bool
    notify: bool
    compiled: bool = False        # the generation's first step: its time is compilation, not a step time


@dataclasses.dataclass(frozen=True)
class Phase:
    """The watched rank entered a phase of its start: restore or compile (the goodput ledger times them)."""
    phase: str
    step: int = 0


@dataclasses.dataclass(frozen=True)
class Warned:
    """A health warning to record (no action)."""
    incident: Incident


@dataclasses.dataclass(frozen=True)
class Triaged:
    """A rerun's verdict (daemon.judging.triage): transient or deterministic, with its evidence."""
    verdict: str
    first_step: int
    evidence: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ScriptReports:
    """A supervised script's rank told what its step events carry (PhaseEvent.reports): the detectors that need
    what it lacks are off (daemon.judging.script_reports)."""
    reports: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Committed:
    """A checkpoint was committed (retention, metrics, the `checkpoint_committed` event) while the
    watched rank was at `current_step`; `rank` reported it."""
    step: int
    current_step: int
    rank: int = 0
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class MemoryCommitted:
    """A RAM-tier checkpoint was committed while the detectors had judged the steps up to `current_step`: the
    daemon retires the RAM tier's checkpoints no later incident can need (daemon.processes.run_files.protected_steps,
    as for the disk's)."""
    step: int
    current_step: int


@dataclasses.dataclass(frozen=True)
class Restored:
    """The watched rank restored the checkpoint of `step` from `path` (a RAM tier's or the disk's): where this
    generation resumed from, as the ranks did it (the `checkpoint_restored` event, status)."""
    step: int
    path: str


@dataclasses.dataclass(frozen=True)
class Saving:
    """A save of the watched rank moved: `stage` staged (it blocked the step `seconds`) or committed, on the
    `tier` disk or memory (checkpoint.interval_steps = "auto" times them: daemon.judging.cadence); or waited
    (a disk save blocked `seconds` for the one before it: checkpoint time, no save of its own)."""
    tier: str
    stage: str
    step: int
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class CheckpointFailed:
    """A save failed (rank's detail says why); training goes on."""
    step: int
    detail: str


@dataclasses.dataclass(frozen=True)
class DumpStacks:
    """Ask these live ranks for their Python stacks (faulthandler on SIGUSR1), in this order; `native`: ranks
    whose kernel-side state (stopped? waiting where? /proc) is read too — a stopped process cannot answer."""
    ranks: tuple[int, ...]
    native: tuple[int, ...] = ()


Effect = (Send | Note | Status | Progress | Validated | Warned | Triaged | Committed | MemoryCommitted | Restored
          | Saving | CheckpointFailed | DumpStacks | Phase)
_SAVING = {"staged": ("disk", "staged"), "committed": ("disk", "committed"), "waited": ("disk", "waited"),
           "staged_in_memory": ("memory", "staged"), "in_memory": ("memory", "committed")}
OBSERVED_KEPT = 512          # the watched rank's recent steps whose values a rerun compares


# Outcomes: how a generation ends ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Finished:
    step: int | None


@dataclasses.dataclass(frozen=True)
class Stopped:
    step: int | None
    forced: bool = False          # the ranks did not finish their final checkpoint in time


@dataclasses.dataclass(frozen=True)
class Released:
    step: int | None              # paused too long: the ranks exited; a resume starts a new generation


@dataclasses.dataclass(frozen=True)
class Regroup:
    step: int | None              # multi-node: a lost machine is back; the ranks save on SIGTERM and the
    nodes: tuple[int, ...] = ()   # next generation takes these nodes back


@dataclasses.dataclass(frozen=True)
class WorkerFailed:
    code: int                     # an exit code restarting cannot help (usage, data, config)
    rank: int
    detail: str


@dataclasses.dataclass(frozen=True)
class Failed:
    incident: Incident            # crash, hang, out of memory, or a numerical incident


@dataclasses.dataclass(frozen=True)
class Ended:
    """Multi-node: the decider ended the run (gave up, too few nodes, a rank's fatal error): this
    daemon ends with the same code, status and reason."""
    code: int
    status: str
    reason: str
    detail: str


Outcome = Finished | Stopped | Released | Regroup | WorkerFailed | Failed | Ended


def teardown_grace_s(outcome: Outcome, kill_grace_s: float, *, saving: bool = True,
                     failed_grace_s: float = 2.0) -> float:
    """SIGTERM → SIGKILL grace: numerical incidents throw the ranks' state away, and a node cut off
    from its run must commit nothing (kill at once); after a crash or hang the survivors sit in a
    collective and never run their handler, so the only thing worth waiting for is a checkpoint they
    are still writing (`saving`): a short grace then, none otherwise (every second of it is a second
    of recovery)."""
    if not isinstance(outcome, Failed):
        return kill_grace_s
    if outcome.incident.evidence.get("cut_off"):       # multi-node: the run may have moved on without them
        return 0.0
    if not outcome.incident.kind.is_process_fault or not saving:
        return 0.0
    return min(kill_grace_s, failed_grace_s)


def teardown_graces(outcome: Outcome, kill_grace_s: float, *, saving: bool = True,
                    failed_grace_s: float = 2.0) -> tuple[float, float]:
    """(the ranks' grace: teardown_grace_s; how long the RAM tier's writers left after their ranks may finish
    the save they were handed). Those saves are the ranks' newest state: after a crash or hang they are waited
    for (failed_grace_s at most), so the crash loses only the step in flight; a numerical incident's state is
    thrown away and a cut-off node commits nothing (killed at once); after a stop, as long as the ranks."""
    return (teardown_grace_s(outcome, kill_grace_s, saving=saving, failed_grace_s=failed_grace_s),
            teardown_grace_s(outcome, kill_grace_s, saving=True, failed_grace_s=failed_grace_s))   # a save is there


# The watch ----------------------------------------------------------------------------------

@dataclasses.dataclass
class _Exit:
    code: int
    oom_kills: int = 0
    peak_bytes: int = 0
    device_oom_line: str | None = None
    refusal: str | None = None
    error_line: str | None = None
    hccl: tuple[Mapping[str, Any], ...] = ()


class Watch:
    def __init__(self, cfg: Config, *, generation: int, ranks: Sequence[int], monitor: HealthMonitor, now: float,
                 log_paths: Mapping[int, str] | None = None, stop_reason: str | None = None,
                 rerun: Mapping[str, Any] | None = None, homes: Mapping[str, Sequence[int]] | None = None,
                 drills: Sequence[Mapping[str, Any]] = ()):
        """`drills`: drills in force from before this generation (a device a faulty-rank drill left faulty)."""
        self.cfg, self.generation, self.monitor = cfg, generation, monitor
        self.homes = dict(homes or {})        # rank -> [node, device] (daemon.judging.quarantine.homes): where a suspect runs
        self.ranks = list(ranks)
        self.watched = self.ranks[0]          # its step events feed the detectors (the metrics are global)
        self.log_paths = dict(log_paths or {})
        self.progress = {r: hang.RankProgress(since_s=now) for r in self.ranks}
        self.step_times = hang.StepTimes()
        self.phases: dict[int, Slot] = {}    # where each rank of this machine is inside its step (its phase board)
        self.stopped: frozenset[int] = frozenset()      # its ranks whose process is stopped (SIGSTOP)
        self.stragglers = StragglerDetector(cfg.health, self.ranks)
        self.replicas = ReplicaCheck(self.ranks)
        self.pause = Pause.RUNNING
        self.paused_at = 0.0
        self._paused_elsewhere = False        # its ranks hold on another daemon's word (several machines)
        self.last_step = 0
        # the newest step the detectors judged with no incident open before it: retention's clock, which stops
        # at an incident's detection (the ranks run on until the teardown; what precedes the incident stays)
        self.judged_step = 0
        self.last_step_at = now               # when the watched rank last completed a step (or the start)
        self._committed_step = 0
        self._unsettled: set[tuple[int, int]] = set()  # (step, rank) staged and still this rank's to finish
        self.stop_reason: str | None = None
        self.stop_sent_at: float | None = None
        self.forced = False
        self._first_step_seen: set[int] = set()
        self._exit_reasons: dict[int, tuple[str, int]] = {}
        self._exits: dict[int, _Exit] = {}
        self._incident: Incident | None = None
        self._drills: list[dict[str, Any]] = []      # inject commands sent to this generation
        # a generation that reruns an incident's steps (daemon.judging.triage), its data drills read again
        self.rerun = RerunCheck(rerun, cfg.health.rerun_rtol) if rerun else None
        self._drills += [dict(d) for d in (rerun or {}).get("drills") or ()]
        self._drills += [dict(d) for d in drills]
        self._held: Incident | None = None           # the rerun's own detection of its incident, for its verdict
        self._recent: dict[int, StepEvent] = {}      # the watched rank's recent steps (what a rerun compares)
        self._status_at = self._logged_at = -1e18
        self._effects: list[Effect] = []
        if stop_reason:
            self.request_stop(stop_reason, now)

    def drain(self) -> list[Effect]:
        out, self._effects = self._effects, []
        return out

    def _do(self, *effects: Effect) -> None:
        self._effects.extend(effects)

    def _move(self, to: Pause) -> None:
        if to not in _PAUSE_MOVES[self.pause]:
            raise IllegalTransitionError(f"pause state {self.pause.value} -> {to.value}")
        self.pause = to

    # Inputs ---------------------------------------------------------------------------------
    def on_event(self, ev: StepEvent | PhaseEvent | CheckpointEvent | ExitEvent | DataFaultEvent | EvalEvent,
                 now: float) -> None:
        p = self.progress.get(ev.rank)
        if p is None or ev.generation != self.generation or getattr(ev, "phase", None) == "standby":
            return                                   # another generation's late datagram, or a standby's
        p.since_s = now
        if isinstance(ev, PhaseEvent):
            p.phase, p.step = ev.phase, ev.step or p.step
            if ev.reports is not None and ev.rank == self.watched:
                self._do(ScriptReports(tuple(ev.reports)))
            if ev.phase in ("restore", "compile") and ev.rank == self.watched:
                self._do(Phase(ev.phase, ev.step))
            if ev.phase == "compile" and ev.rank == self.watched:
                self._do(Note("compiling", fields={"step": ev.step, **({"startup_s": ev.startup_s} if ev.startup_s else {}),
                                                   "detail": "the first step compiles the step "
                                                   "graph: seconds to a minute on CPU, minutes on Ascend"}))
            if ev.phase == "paused":
                self._maybe_paused(ev.step, now)
        elif isinstance(ev, StepEvent):
            p.phase, p.step = "train", ev.step
            if self._paused_elsewhere and self.pause is Pause.PAUSED:
                self._resumed_elsewhere(ev.step)
            compiled = ev.rank not in self._first_step_seen   # a generation's first step compiles: not a step time
            self.replicas.started_at(ev.step - 1)
            if not compiled:
                self.step_times.add(ev.step_s)
            self._first_step_seen.add(ev.rank)
            if ev.rank == self.watched:
                self._observe(ev, now, compiled)
            self._judge(self.stragglers.observe(ev), ev.step)
        elif isinstance(ev, CheckpointEvent):
            self._checkpoint(ev)
        elif isinstance(ev, EvalEvent):
            self._do(Validated(ev))
        elif isinstance(ev, FingerprintEvent) and self._incident is None:
            mismatch = self.replicas.observe(ev)
            self._judge([mismatch] if mismatch else [], ev.step)
        elif isinstance(ev, ExitEvent):
            self._exit_reasons[ev.rank] = (ev.reason, ev.step)
        elif isinstance(ev, DataFaultEvent) and self._incident is None:
            self._data_fault(ev)

    def _data_fault(self, ev: DataFaultEvent) -> None:
        first = ev.blocks[0] if ev.blocks else {}
        evidence = {"corpus": ev.corpus, "blocks": list(ev.blocks), "corpus_blocks": ev.corpus_blocks}
        self._do(Note("incident_detected", "error", {"kind": Kind.DATA_CORRUPT.value, "step": ev.step,
                                                     "rank": ev.rank, "evidence": evidence}))
        self._incident = Incident(kind=Kind.DATA_CORRUPT, first_step=ev.step, last_step=ev.step, rank=ev.rank,
                                  detail=f"rank {ev.rank}: shard {first.get('file')} block {first.get('block')} "
                                         f"fails its CRC32C check ({len(ev.blocks)} bad block(s) in that shard)",
                                  evidence=evidence)

    def _maybe_paused(self, step: int, now: float) -> None:
        if not all(q.phase == "paused" for q in self.progress.values()):
            return
        by = {}
        if self.pause is Pause.RUNNING:      # not asked here: the decider of a run of several machines paused them
            self._move(Pause.PAUSING)
            self._paused_elsewhere, by = True, {"by": "the decider"}
        if self.pause is Pause.PAUSING:
            self._move(Pause.PAUSED)
            self.paused_at = now
            self._do(Status("paused", f"paused at step {step}"),
                     Note("paused", fields={"step": step, "rank_steps": {r: q.step for r, q in self.progress.items()},
                                            "release_after_s": self.cfg.run.pause_release_after_s, **by}))

    def _resumed_elsewhere(self, step: int) -> None:
        """Ranks paused by the decider step again: it resumed them."""
        self._move(Pause.RUNNING)
        self._paused_elsewhere = False
        self._do(Status("running", f"resumed at step {step}"), Note("resumed", fields={"step": step, "by": "the decider"}))

    def _observe(self, ev: StepEvent, now: float, compiled: bool = False) -> None:
        self.last_step, self.last_step_at = ev.step, now
        notify = now - self._status_at >= STATUS_EVERY_S
        log = now - self._logged_at >= PROGRESS_LOG_EVERY_S or ev.step == self.cfg.train.steps
        self._status_at = now if notify else self._status_at
        self._logged_at = now if log else self._logged_at
        self._do(Progress(ev, log=log, notify=notify, compiled=compiled))
        self._recent.pop(ev.step, None)          # a replayed step moves to the end: the first key is the oldest
        self._recent[ev.step] = ev
        if len(self._recent) > OBSERVED_KEPT:
            del self._recent[next(iter(self._recent))]
        if self._incident is None:
            found = self.monitor.observe(ev)
            if self.rerun is not None and self.rerun.verdict is None:
                found = self._triage(ev, found)
            self._judge(found, ev.step)
            self.judged_step = max(self.judged_step, ev.step)

    def _triage(self, ev: StepEvent, found: list[Incident]) -> list[Incident]:
        """While a rerun's steps run, its verdict decides: the incidents within its steps are held (one before
        them is a new incident, decided as any); `deterministic` brings the incident back (with the verdict
        as its `triage` evidence) for the policy to decide on, `transient` lets training go on."""
        check = self.rerun
        held = [i for i in found if i.needs_action and i.last_step >= check.first and i.first_step <= check.last]
        found = [i for i in found if i not in held]
        self._held = self._held or (held[0] if held else None)
        verdict = check.observe(ev)
        if verdict is None:
            return found
        evidence = {**check.evidence(self.generation), "homes": self._homes(check.suspects)}
        self._do(Triaged(verdict, check.first, evidence))
        if verdict == "transient":
            return found
        again = self._held or Incident(kind=Kind(check.kind), first_step=check.first, last_step=check.last,
                                       detail="reproduced by its rerun")
        return [dataclasses.replace(again, evidence={**again.evidence, "triage": evidence}), *found]

    def _judge(self, incidents: Sequence[Incident], step: int) -> None:
        """Warnings are recorded; the first incident that needs action ends the generation."""
        for incident in incidents:
            if self._incident is not None:
                return
            if not incident.needs_action:
                self._do(Warned(self._labelled(incident)))
                continue
            if incident.kind in NUMERIC:
                # what a rerun of its steps is compared with, and the ranks they point at (daemon.judging.triage)
                span = range(incident.first_step, incident.last_step + 1)
                seen = [self._recent[s] for s in span if s in self._recent]
                pointed = suspects([(e.rank_losses, e.rank_grad_norms) for e in seen])
                incident = dataclasses.replace(incident, evidence={
                    **incident.evidence, "observed": {str(e.step): observed_values(e) for e in seen},
                    "suspects": pointed, "ranks": max((len(e.rank_losses or ()) for e in seen), default=0)})
            named = [*incident.evidence.get("suspects", ()), *incident.evidence.get("odd_ranks", ()),
                     *([incident.rank] if incident.rank is not None else [])]
            if named and self.homes:        # where they run: a device or machine to quarantine (daemon.judging.quarantine)
                incident = dataclasses.replace(incident, evidence={**incident.evidence, "homes": self._homes(named)})
            self._do(Note("incident_detected", "error", {"kind": incident.kind.value, "step": step,
                                                         "first_step": incident.first_step,
                                                         "evidence": dict(incident.evidence)}))
            self._incident = incident

    @property
    def stepping(self) -> bool:
        """Every rank has completed a step in this generation (its compile is behind it)."""
        return set(self.ranks) <= self._first_step_seen

    def stalled_s(self, now: float) -> float:
        """How long the ranks have made no step past twice their p99 step time while they should be
        stepping: 0 before their first step (compiling), while a rank stages a save (its phase board
        says `save`), evaluating, paused or stopping, and after the run's last step. A save written in
        the background does not stop the steps: ranks waiting in the gradient sum while one is in
        flight are stalled (a partitioned machine's committer may wait on it for ever)."""
        if (not self.stepping or any(s.phase == "save" for s in self.phases.values())
                or self.pause is not Pause.RUNNING or self.stop_sent_at is not None
                or self.last_step >= self.cfg.train.steps or any(p.phase == "eval" for p in self.progress.values())):
            return 0.0
        return max(0.0, now - self.last_step_at - 2.0 * (self.step_times.p99() or 0.0))

    @property
    def saving(self) -> bool:
        """A checkpoint is being written here: staged by one of this node's ranks and not yet finished
        by it. Rank 0 commits, so its part ends with the commit (or failure); another rank's ends once its
        shard is written (durable: what is left is the committer's, on this node or another — a
        follower node's watch never sees the commit, and waited out a grace after every failure)."""
        return bool(self._unsettled)

    def _checkpoint(self, ev: CheckpointEvent) -> None:
        if ev.rank == self.watched and ev.stage in _SAVING:
            self._do(Saving(*_SAVING[ev.stage], ev.step, ev.seconds))
        if ev.stage == "staged":
            self._unsettled.add((ev.step, ev.rank))
        elif ev.stage == "written" and ev.rank != 0:
            self._unsettled.discard((ev.step, ev.rank))
        elif ev.stage in ("committed", "failed", "exists"):
            self._unsettled = {(s, r) for s, r in self._unsettled if s > ev.step}
        if ev.stage == "committed":
            self._committed_step = max(self._committed_step, ev.step)
            self._do(Committed(ev.step, self._cleared(ev.step), ev.rank, ev.detail))
        elif ev.stage == "in_memory":
            self._do(MemoryCommitted(ev.step, self._cleared()))
        elif ev.stage == "failed":
            self._do(CheckpointFailed(ev.step, ev.detail))
        elif ev.stage == "restored" and ev.rank == self.watched:
            self._do(Restored(ev.step, ev.detail))
        elif ev.stage == "in_memory_failed":
            self._do(Note("checkpoint_in_memory_failed", "warning", {"rank": ev.rank, "step": ev.step,
                                                                     "detail": ev.detail}))
        if ev.stage in ("failed", "corrupt"):
            self._do(Note(f"checkpoint_{ev.stage}", "error", {"rank": ev.rank, "step": ev.step, "detail": ev.detail}))

    def _cleared(self, committed: int = 0) -> int:
        """The step retention judges from (`current_step`): the newest step the detectors cleared, or a disk
        checkpoint's step when it is newer (as ever); once an incident is open, the step that detected it,
        whatever the ranks commit before the teardown (else the checkpoints before it could be retired)."""
        return self.judged_step if self._incident is not None else max(self.judged_step, self.last_step, committed)

    def on_exit(self, rank: int, code: int, now: float, *, oom_kills: int = 0, peak_bytes: int = 0,
                device_oom_line: str | None = None, refusal: str | None = None,
                error_line: str | None = None, hccl: Sequence[Mapping[str, Any]] = ()) -> None:
        """Rank `rank`'s process ended with `code` (negative: killed by that signal); `oom_kills` and
        `peak_bytes` from its memory cgroup, `device_oom_line` the allocator's error in its log,
        `refusal` its own one-line reason for a usage, data or config error, `error_line` the exception it
        ended with otherwise (said in the incident: why a rank crashed, without opening its log), `hccl` the faults
        HCCL located (Ascend: daemon.judging.hccl_verdicts), in the incident too."""
        self._exits.setdefault(rank, _Exit(code, oom_kills, peak_bytes, device_oom_line, refusal, error_line,
                                           tuple(hccl)))

    def on_control(self, request: Request, now: float) -> None:
        """A request from the control directory while ranks run (already logged by the supervisor)."""
        verb = VERBS[request.name]
        if request.name == "stop":
            reason = request.body.get("reason")
            self.request_stop(f"control file {request.file}" + (f": {reason}" if reason else ""), now)
            return
        try:
            args = verb.command_args(request.body, cfg=self.cfg)
        except ValueError as e:
            self._do(Note("control_rejected", "warning", {"file": request.file, "detail": str(e)}))
            return
        if request.name == "pause":
            if self.pause is not Pause.RUNNING:
                self._do(Note("control_ignored", "warning", {"name": "pause", "detail": f"already {self.pause.value}"}))
                return
            self._move(Pause.PAUSING)
            self._do(Status("pausing"))
        elif request.name == "resume":
            if self.pause not in (Pause.PAUSING, Pause.PAUSED):
                self._do(Note("control_ignored", "warning", {"name": "resume", "detail": "not paused"}))
                return
            self._move(Pause.RUNNING)
            self._do(Status("running"))
        elif request.name == "inject":
            self._drills.append(dict(args))
        self._do(Send(verb.command, args))

    def request_stop(self, reason: str, now: float, *, force: bool = False) -> None:
        """Stop at the next step with a checkpoint; `force` (a second signal) ends the generation now."""
        self.forced = self.forced or force
        if self.stop_sent_at is not None:
            return
        self.stop_reason, self.stop_sent_at = reason, now
        self._do(Note("stopping", fields={"detail": f"{reason}: checkpoint at the next step, then exit",
                                          "timeout_s": self.cfg.run.stop_timeout_s}),
                 Send("stop"))

    # The judgement --------------------------------------------------------------------------
    def tick(self, now: float, phases: Mapping[int, Slot] | None = None,
             stopped: frozenset[int] | None = None) -> Outcome | None:
        """`phases`: where each rank of this machine is inside its step now (contracts.phase_board); `stopped`:
        the ranks whose process is stopped (the kernel's word)."""
        if phases is not None:
            self.phases = dict(phases)
        if stopped is not None:
            self.stopped = frozenset(stopped)
        out = self._tick(now)
        return Failed(self._labelled(out.incident)) if isinstance(out, Failed) else out

    def _homes(self, ranks: Sequence[int]) -> dict[str, list[int]]:
        return {str(r): list(self.homes[str(r)]) for r in ranks if str(r) in self.homes}

    def _labelled(self, incident: Incident) -> Incident:
        """An incident a fault drill of this generation explains says so (evidence `drill`)."""
        for drill in reversed(self._drills):
            if incident.kind in DRILL_KINDS.get(drill.get("fault"), ()) and self._drill_covers(drill, incident):
                return dataclasses.replace(incident, evidence={**incident.evidence, "drill": drill},
                                           detail=f"{incident.detail} (a {drill['fault']} drill)".lstrip())
        return incident

    def _drill_covers(self, drill: Mapping[str, Any], incident: Incident) -> bool:
        """A faulty device left from an earlier generation explains an incident whose suspects run on it (or
        one that names no suspect); any other drill, every incident of its kinds in its generation."""
        if "device" not in drill:
            return True
        suspects = incident.evidence.get("suspects") or ([incident.rank] if incident.rank is not None else [])
        homes = {tuple(self.homes.get(str(r), ())) for r in suspects}
        return not suspects or (drill["node"], drill["device"]) in homes

    def _tick(self, now: float) -> Outcome | None:
        if self._incident is not None:
            return Failed(self._incident)
        if self.stop_sent_at is not None and (self.forced or now - self.stop_sent_at > self.cfg.run.stop_timeout_s):
            self._do(Note("stop_forced", "warning",
                          {"detail": "second signal" if self.forced else "stop timeout passed"}))
            return Stopped(self._final_step(), forced=True)
        if self.pause is Pause.PAUSED and now - self.paused_at > self.cfg.run.pause_release_after_s:
            self._move(Pause.RELEASING)
            self._do(Send("release"))
        for rank in self.ranks:
            ended = self._exits.get(rank)
            if ended is not None and ended.code != 0:
                return self._failed_exit(rank, ended)
        if all(self._exits.get(r) is not None for r in self.ranks):
            reasons = {reason for reason, _ in self._exit_reasons.values()}
            if self.stop_sent_at is not None or "stopped" in reasons:
                return Stopped(self._final_step(exited=True))
            step = self._final_step(exited=True)
            return Released(step) if "released" in reasons else Finished(step)
        return self._stall(now) or self._hang(now)

    def _final_step(self, exited: bool = False) -> int | None:
        """The step the ranks ended at, from their exit events; ranks that all `exited` without one
        reaching us (a datagram lost) ended at the last step or commit seen."""
        said = [step for _, step in self._exit_reasons.values()]
        if said or not exited:
            return max(said, default=None)
        return max(self.last_step, self._committed_step) or None

    def _failed_exit(self, rank: int, ended: _Exit) -> Outcome:
        code = ended.code
        cause = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        log = self.log_paths.get(rank, "")
        if code in FINAL_WORKER_CODES:
            said = f": {ended.refusal}" if ended.refusal else ""
            return WorkerFailed(code, rank, f"rank {rank} ended with {cause}{said} (see {log})")
        step = self.progress[rank].step
        oom = _oom_evidence(ended, self.cfg.run.worker_memory_limit_bytes)
        if oom is not None:
            self._do(Note("oom", "error", {"rank": rank, "step": step, "log": log, **oom}))
            return Failed(Incident(kind=Kind.OOM, first_step=step, last_step=step, rank=rank, exit_code=code,
                                   detail=f"rank {rank} ran out of memory ({cause})", evidence=oom))
        said = f": {ended.error_line}" if ended.error_line else ""
        hccl = [dict(v) for v in ended.hccl]
        if hccl:                         # HCCL names the root of a collective's failure, which may be another rank
            said += "; HCCL: " + ", ".join(f"rank {v['rank']} {v['exception']}" if v["rank"] >= 0
                                           else f"{v['exception']} ({v.get('reason', '')})" for v in hccl)
        self._do(Note("crash", "error", {"rank": rank, "exit_code": code, "cause": cause, "step": step, "log": log,
                                         "error": ended.error_line, **({"hccl": hccl} if hccl else {})}))
        return Failed(Incident(kind=Kind.CRASH, first_step=step, last_step=step, rank=rank, exit_code=code,
                               detail=f"rank {rank}: {cause}{said}", evidence={"hccl": hccl} if hccl else {}))

    def _stall(self, now: float) -> Outcome | None:
        """A rank stuck inside a step while the others wait for it (daemon.judging.stall): named, its stacks
        (then the others') dumped, the generation ended, in seconds where the hang check waits a minute."""
        live = [r for r in self.ranks if r not in self._exits]
        if self.pause is not Pause.RUNNING or self.stop_sent_at is not None:
            return None
        slots = {r: s for r, s in self.phases.items() if r in live and self.progress[r].phase == "train"}
        limit = stall.limit_s(self.step_times.p99(), floor_s=self.cfg.health.stall_floor_s,
                              multiplier=self.cfg.health.hang_step_multiplier)
        found = stall.judge(slots, now, limit=limit, stopped=self.stopped)
        if found is None:
            return None
        rank = found.culprits[0] if found.culprits else found.waiting[0]
        first = [*found.culprits, *(r for r in live if r not in found.culprits)]      # the culprits' stacks first
        evidence = {"phase": found.phase, "waited_s": found.stuck_s, "timeout_s": round(found.limit_s, 2),
                    "culprits": list(found.culprits), "waiting": list(found.waiting),
                    "suspects": list(found.culprits), "homes": self._homes(found.culprits)}
        self._do(DumpStacks(tuple(first), native=found.culprits),
                 Note("hang", "error", {"rank": rank, "step": found.step, "detail": found.describe(),
                                        "log": self.log_paths.get(rank, ""), **evidence}))
        return Failed(Incident(kind=Kind.HANG, first_step=found.step, last_step=found.step,
                               rank=found.culprits[0] if found.culprits else None, detail=found.describe(),
                               evidence=evidence))

    def _hang(self, now: float) -> Outcome | None:
        live = tuple(r for r in self.ranks if r not in self._exits)
        for rank in live:
            p = self.progress[rank]
            hung, limit = hang.is_hung(p, now, self.cfg.health, self.step_times)
            if not hung:
                continue
            waited = round(now - p.since_s, 2)
            # the stuck rank and those blocked in a collective waiting for it look alike from
            # here: every live rank's stacks
            self._do(DumpStacks(live),
                     Note("hang", "error", {"rank": rank, "phase": p.phase, "step": p.step, "waited_s": waited,
                                            "timeout_s": round(limit, 2), "log": self.log_paths.get(rank, "")}))
            return Failed(Incident(kind=Kind.HANG, first_step=p.step, last_step=p.step, rank=rank,
                                   detail=f"rank {rank} made no progress in {waited:.1f} s ({p.phase}, "
                                          f"limit {limit:.1f} s)",
                                   evidence={"phase": p.phase, "waited_s": waited, "timeout_s": round(limit, 2)}))
        return None


def _oom_evidence(ended: _Exit, limit_bytes: int) -> dict[str, Any] | None:
    """Out of memory, not another crash: a SIGKILL its memory cgroup counted as an OOM kill, or (Ascend)
    the device allocator's error in the rank's log."""
    if ended.code in (-signal.SIGKILL, 128 + signal.SIGKILL) and ended.oom_kills:
        return {"signal": "cgroup oom_kill", "limit_bytes": limit_bytes, "oom_kills": ended.oom_kills,
                "peak_bytes": ended.peak_bytes}
    if ended.code > 0 and ended.device_oom_line is not None:
        return {"signal": "device out of memory in the rank's log", "line": ended.device_oom_line}
    return None


# Between generations ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class IdleDecision:
    resume: bool = False           # a paused run's ranks were released: start the next generation
    stop_reason: str | None = None
    note: Note | None = None


def idle_control(request: Request, *, paused: bool) -> IdleDecision:
    """What a control request means while no ranks run (a backoff, or released while paused)."""
    if request.name == "stop":
        reason = request.body.get("reason")
        return IdleDecision(stop_reason=f"control file {request.file}" + (f": {reason}" if reason else ""))
    if request.name == "resume" and paused:
        return IdleDecision(resume=True)
    return IdleDecision(note=Note("control_ignored", "warning",
                                  {"name": request.name, "detail": "no ranks are running (between generations)"}))
