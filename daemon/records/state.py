"""The run's persistent state, `<run.dir>/state.json`: what a restarted daemon continues from.

Written atomically (temporary file, fsync, rename, fsync the directory)
before each decision is acted on, as strict JSON (a non-finite loss is
written "nan", as in the event log). Read back strictly too: a file that is
not what this module writes (not JSON, not an object, a field of the wrong
type, an incident that cannot be parsed) is a `StateCorruptError`, never a
half-loaded state; the daemon then sets it aside (`set_aside`) and rebuilds
it from the event log (daemon.records.state_rebuild).

Owns RunState and every change to it: its fields are assigned only by its
own methods, here (tests/unit/test_state_owner.py holds the other modules to
that). The live daemon (daemon.records.ledger, daemon.acting.decisions, the supervisor) and
the rebuild from the event log call the same methods, so an incident, a
generation or a control request changes a live state and a rebuilt one alike.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence

from contracts import strict_json
from contracts.errors import DataError
from contracts.protocol import DATA_FAULTS, RecoveryDirective, RerunDirective
from daemon.judging.incidents import Incident, IncidentRecord, Rerun, Restart, Rollback
from daemon.judging.policy import merge_recovery
from daemon.judging.quarantine import as_device, key as quarantine_key
from durable import fsync_path, write_atomically

STATE_FILE = "state.json"


class StateCorruptError(DataError):
    """state.json exists but is not a state this module wrote (exit 65 from the CLI)."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path} is corrupt ({why}); the daemon sets it aside and rebuilds it from the "
                         "event log when it next starts")
        self.path, self.why = path, why


@dataclasses.dataclass
class RunState:
    generation: int = 0                  # generations started so far (the next is generation + 1)
    restarts: int = 0                    # restarts after crashes and hangs, in all
    restarts_without_progress: int = 0   # consecutive restarts with no new committed checkpoint
    last_committed_step: int = 0         # the step the last generation resumed from (either tier's checkpoint)
    resumed: dict[str, Any] = dataclasses.field(default_factory=dict)   # where the last generation resumed from:
                                         # step, tier (ram, disk, none), generation, restored (the ranks said so)
    status: str = "new"                  # new, running, restarting, finished, stopped, gave_up, failed
    waiting: str = ""                    # what the daemon waits for, when it does (multi-node: a decider)
    incidents: list[IncidentRecord] = dataclasses.field(default_factory=list)   # with the action taken
    recovery: RecoveryDirective | None = None     # the policy's directive in force
    config_changes: dict[str, Any] = dataclasses.field(default_factory=dict)  # "section.key" -> value, by policy
    pending_rollback: int | None = None  # a rollback target decided and recorded, its renames not yet done
    rerun: dict[str, Any] | None = None  # a rerun decided, its verdict not yet in: a RerunDirective's fields, with
                                         # `observed` (the first run's values of its steps) and `generation`
    triage: dict[str, int] = dataclasses.field(default_factory=dict)   # reruns' verdicts so far, by verdict
    transient_steps: list[int] = dataclasses.field(default_factory=list)   # where reruns found a transient fault
    transient_by_rank: dict[str, int] = dataclasses.field(default_factory=dict)   # the ranks those faults came from
    cadence: dict[str, Any] = dataclasses.field(default_factory=dict)   # checkpoint interval "auto": daemon.judging.cadence's
    lemons: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)   # faulty devices and machines
                                         # (daemon.judging.quarantine): node, device, faults, quarantined_until_unix_s
    undecided: dict[str, Any] | None = None   # an incident that ended a generation, not yet decided (an Incident)
    checkpoints_failing_since: int | None = None   # the step of the first failed save since the last commit
    processes: list[dict[str, Any]] = dataclasses.field(default_factory=list)   # this generation's, for orphans
    last_control: dict[str, Any] = dataclasses.field(default_factory=dict)   # the last request taken: name, file, unix_s
    log_dir: str = ""                    # where events.jsonl and the rank logs are
    total_steps: int = 0                 # train.steps of the run
    last_progress: dict[str, Any] = dataclasses.field(default_factory=dict)   # step, loss, tokens_per_s, unix_s
    last_validation: dict[str, Any] = dataclasses.field(default_factory=dict)  # step, loss, perplexity, unix_s
    script_reports: dict[str, Any] = dataclasses.field(default_factory=dict)  # a script's: reports, missing, off, detail
    goodput: dict[str, Any] = dataclasses.field(default_factory=dict)   # the wall time by cause (daemon.judging.goodput)
    daemon_pid: int = 0
    started_unix_s: float = 0.0          # when the run's first daemon began (status: elapsed)
    updated_unix_s: float = 0.0

    @classmethod
    def load(cls, run_dir: Path) -> "RunState":
        """The saved state; a new one when there is none. Raises StateCorruptError for a bad file."""
        path = run_dir / STATE_FILE
        if not path.exists():
            return cls()
        try:
            return cls.from_dict(_parse(path.read_bytes()))
        except _Invalid as e:
            raise StateCorruptError(path, str(e)) from None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunState":
        """Keys this version does not know are ignored (a newer daemon's file still loads); the known
        ones must have their declared types. Raises ValueError naming the first bad field."""
        hints = typing.get_type_hints(cls)
        fields = {}
        for f in dataclasses.fields(cls):
            if f.name in data:
                _check(f.name, data[f.name], hints[f.name])
                fields[f.name] = data[f.name]
        incidents = []
        for i, record in enumerate(fields.get("incidents") or ()):
            try:
                incidents.append(IncidentRecord.from_dict({**record, "evidence": strict_json.decode(
                    record.get("evidence") or {})}))
            except (KeyError, TypeError, ValueError) as e:
                raise _Invalid(f"incidents[{i}] is not an incident record: {_reason(e)}") from None
        fields["incidents"] = incidents
        try:
            fields["recovery"] = RecoveryDirective.from_dict(fields["recovery"]) if fields.get("recovery") else None
        except (KeyError, TypeError, ValueError) as e:
            raise _Invalid(f"recovery is not a recovery directive: {_reason(e)}") from None
        if fields.get("rerun"):
            fields["rerun"] = strict_json.decode(fields["rerun"])
        fields["last_progress"] = strict_json.decode(fields.get("last_progress") or {})
        fields["last_validation"] = strict_json.decode(fields.get("last_validation") or {})
        return cls(**fields)

    # How the run's state changes ----------------------------------------------------------------------
    def begin(self, *, daemon_pid: int, total_steps: int, log_dir: str, now_s: float) -> None:
        """A daemon takes the run over: its pid, the run's length and where its logs are; it has no
        processes yet. The run's start stays its first daemon's."""
        self.processes = []
        self.daemon_pid = daemon_pid
        self.set_run(total_steps=total_steps, log_dir=log_dir)
        self.started_unix_s = self.started_unix_s or now_s

    def set_run(self, *, total_steps: int, log_dir: str) -> None:
        """The run's length and where its logs are (what a state rebuilt from the log cannot know)."""
        self.total_steps, self.log_dir = total_steps, log_dir

    def next_generation(self, number: int | None = None) -> int:
        """A generation begins: the one after the last, or `number` (a multi-node run's, as its decider
        published it; in the rebuild, the highest the log shows). Returns its number."""
        self.generation = self.generation + 1 if number is None else number
        return self.generation

    def set_status(self, status: str) -> None:
        self.status = status
        if status == "running":
            self.waiting = ""

    def set_waiting(self, what: str) -> None:
        self.waiting = what

    def set_processes(self, records: Sequence[dict[str, Any]]) -> None:
        """This node's processes now (ranks, scheduler, standby): a later daemon ends them if this one dies."""
        self.processes = list(records)

    def set_last_committed(self, step: int) -> None:
        """The newest committed checkpoint, either tier's, as the run goes on from here (a generation's start, a
        decision, a rollback carried out)."""
        self.last_committed_step = step

    def note_resumed(self, *, step: int, tier: str, generation: int, restored: bool) -> None:
        """Where generation `generation` resumes from: the daemon's word at its start (`restored` False), then the
        ranks' once they restored it (True)."""
        self.resumed = {"step": step, "tier": tier, "generation": generation, "restored": restored}

    def count_restart_progress(self, committed_step: int) -> None:
        """A process fault ended a generation: one more restart without progress, unless a checkpoint (either
        tier's: `committed_step` is the step the run would resume from) newer than `last_committed_step` was
        committed since."""
        progressed = committed_step > self.last_committed_step
        self.restarts_without_progress = 0 if progressed else self.restarts_without_progress + 1

    def count_restart(self) -> int:
        self.restarts += 1
        return self.restarts

    def restore_restarts(self, *, restarts: int, without_progress: int) -> None:
        """The rebuild: the restart counts as the event log last told them."""
        self.restarts, self.restarts_without_progress = restarts, without_progress

    def hold_undecided(self, incident: Incident) -> None:
        """The incident that ended a generation, kept until a decision on it is applied."""
        self.undecided = incident.to_dict()

    def apply_incident(self, record: IncidentRecord, *,
                       in_force: tuple[Mapping[str, Any], RecoveryDirective | None] | None = None) -> None:
        """An incident and the action taken on it (a warning: none) into the state: the one place this
        is done, for the decision just made (daemon.acting.decisions), for the decider's decision on another node,
        and for each incident of the event log in the rebuild (daemon.records.state_rebuild). A decided incident is
        no longer undecided; a restart's config changes add to those in force; a rollback merges into
        the recovery directive and is pending until its renames are done (`rollback_done`).
        `in_force`: the decider's config changes and recovery directive after its decision, which another
        node takes as they are (its own history may be shorter); the decider alone carries out rollbacks."""
        self.incidents.append(record)
        action = record.action
        if action is not None:
            self.undecided = None
        if in_force is not None:
            self.config_changes, self.recovery = dict(in_force[0]), in_force[1]
        elif isinstance(action, Restart):
            self.config_changes.update(action.config_changes)
        elif isinstance(action, Rollback):
            self.recovery = merge_recovery(self.recovery, action)
            self.pending_rollback = action.checkpoint_step
        elif isinstance(action, Rerun):          # the directive in force is kept; only the newer checkpoints go
            self.pending_rollback = action.checkpoint_step
        if isinstance(action, Rerun):
            self.rerun = rerun_of(record)
        if isinstance(action, Rollback) and action.exclude:
            homes = record.incident.evidence.get("homes") or {}
            for rank in action.exclude:
                if str(rank) in homes:
                    node, device = homes[str(rank)]
                    self.quarantine(node, device, kind=record.kind.value, step=record.incident.first_step,
                                    unix_s=record.unix_s, for_s=action.exclude_for_s, reason=action.reason)

    def note_fault(self, node: int, device: int | None, *, kind: str, step: int, unix_s: float) -> dict[str, Any]:
        """A fault counted against a device (None, or < 0: the machine) on the lemon list; its entry."""
        entry = self.lemons.setdefault(quarantine_key(node, device), {
            "node": int(node), "device": as_device(device), "faults": [], "quarantines": 0, "quarantined_until_unix_s": None})
        entry["faults"] = [*entry["faults"], {"kind": kind, "step": step, "unix_s": unix_s}][-50:]
        return entry

    def quarantine(self, node: int, device: int | None, *, kind: str, step: int, unix_s: float, for_s: float,
                   reason: str, counted: bool = False) -> None:
        """A device (machine) judged faulty: left out of the generations until unix_s + for_s (`counted`: its
        fault is on the list already)."""
        entry = self.lemons.get(quarantine_key(node, device)) if counted else None
        entry = entry or self.note_fault(node, device, kind=kind, step=step, unix_s=unix_s)
        entry.update(quarantined_until_unix_s=unix_s + for_s, quarantines=entry["quarantines"] + 1, reason=reason)

    def set_cadence(self, cadence: Mapping[str, Any]) -> None:
        """The automatic checkpoint interval's state (daemon.judging.cadence), kept for the next daemon."""
        self.cadence = dict(cadence)

    def failures(self) -> int:
        """Incidents that cost the work since a checkpoint: process faults and reruns (daemon.judging.cadence's MTBF)."""
        return sum(1 for r in self.incidents if r.action is not None
                   and (r.kind.is_process_fault or isinstance(r.action, Rerun)))

    def triaged(self, verdict: str, first_step: int, suspects: Sequence[int] = ()) -> None:
        """The pending rerun's verdict: `transient` (training went on from the rerun; counted against the
        ranks its first run pointed at) or `deterministic` (the incident is decided again, on its own row
        of the policy)."""
        self.rerun = None
        self.triage[verdict] = self.triage.get(verdict, 0) + 1
        if verdict == "transient":
            self.transient_steps.append(first_step)
            for rank in suspects:
                self.transient_by_rank[str(rank)] = self.transient_by_rank.get(str(rank), 0) + 1

    def rollback_done(self, resume_step: int | None = None) -> None:
        """The pending rollback's renames are done; the run resumes from `resume_step` (None: not known,
        as in the rebuild, which only learns that it was done)."""
        self.pending_rollback = None
        if resume_step is not None:
            self.last_committed_step = resume_step

    def set_config_changes(self, changes: Mapping[str, Any]) -> None:
        """Another node: the decider's config changes, as it published them with a generation."""
        self.config_changes = dict(changes)

    def checkpoint_failed(self, step: int) -> bool:
        """A save failed at `step`. True if it is the first since the last commit (a failing spell begins)."""
        if self.checkpoints_failing_since is not None:
            return False
        self.checkpoints_failing_since = step
        return True

    def checkpoint_committed(self) -> int | None:
        """A checkpoint was committed: a failing spell ends. Returns the step it began at (None: none)."""
        since, self.checkpoints_failing_since = self.checkpoints_failing_since, None
        return since

    def take_control(self, *, name: str, file: str, unix_s: float, reason: str | None) -> None:
        """The last control request taken (status shows it)."""
        self.last_control = {"name": name, "file": file, "unix_s": unix_s, "reason": reason}

    def note_script_reports(self, said: Mapping[str, Any]) -> None:
        """What a supervised script reports and what is off for it (daemon.judging.script_reports.describe)."""
        self.script_reports = dict(said)

    def note_validation(self, validation: Mapping[str, Any]) -> None:
        """The last validation loss measured: step, loss, perplexity, when (status shows it)."""
        self.last_validation = dict(validation)

    def note_goodput(self, ledger: Mapping[str, Any]) -> None:
        """The goodput ledger as it stands (daemon.judging.goodput.Goodput.to_dict): the next daemon continues it."""
        self.goodput = dict(ledger)

    def note_progress(self, progress: Mapping[str, Any]) -> None:
        """The last progress of the run: step, loss, lr, tokens per second, when (status's ETA)."""
        self.last_progress = dict(progress)

    # Persistence ------------------------------------------------------------------------------------
    def acted_on(self) -> list[IncidentRecord]:
        """The incidents something was done about; a health warning is recorded with no action and is not one."""
        return [r for r in self.incidents if r.action is not None]

    def warnings(self) -> list[IncidentRecord]:
        """The health warnings (throughput, a stalled loss, a grad-norm spike that only warns): never acted on."""
        return [r for r in self.incidents if r.action is None]

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["incidents"] = [r.to_dict() for r in self.incidents]
        out["recovery"] = self.recovery.to_dict() if self.recovery else None
        return out

    def save(self, run_dir: Path) -> None:
        self.updated_unix_s = time.time()
        write_atomically(run_dir / STATE_FILE, json.dumps(strict_json.encode(self.to_dict()), indent=1, sort_keys=True,
                                                          allow_nan=False))


def rerun_of(record: IncidentRecord) -> dict[str, Any]:
    """What the generation that reruns `record`'s incident is told (a RerunDirective: the drills its
    ranks read again are those in the data) and what its watch compares (the first run's values)."""
    incident, action = record.incident, record.action
    drill = incident.evidence.get("drill")
    drills = (dict(drill),) if isinstance(drill, dict) and drill.get("fault") in DATA_FAULTS else ()
    directive = RerunDirective(kind=incident.kind.value, first_step=action.first_step, last_step=action.last_step,
                               checkpoint_step=action.checkpoint_step, drills=drills, rotate=action.rotate)
    return {**directive.to_dict(), "observed": dict(incident.evidence.get("observed") or {}),
            "suspects": list(incident.evidence.get("suspects") or ()), "homes": dict(incident.evidence.get("homes") or {}),
            "generation": record.generation}


def set_aside(run_dir: Path, now_s: float) -> Path:
    """Renames a bad state.json to `state.json.corrupt-<unix time>` (`-1`, `-2`… if that is taken) and
    returns the new path. Never deletes it: it is the evidence of what went wrong."""
    aside = run_dir / f"{STATE_FILE}.corrupt-{int(now_s)}"
    n = 0
    while aside.exists():
        n += 1
        aside = run_dir / f"{STATE_FILE}.corrupt-{int(now_s)}-{n}"
    os.rename(run_dir / STATE_FILE, aside)
    fsync_path(run_dir)
    return aside


class _Invalid(ValueError):
    """Why a state.json's content is not a state (the path is added by RunState.load)."""


def _parse(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise _Invalid("the file is empty")
    try:
        data = json.loads(raw.decode("utf-8"))      # a bare NaN, as older daemons wrote, still loads
    except UnicodeDecodeError:
        raise _Invalid("not UTF-8 text") from None
    except ValueError as e:
        raise _Invalid(f"not JSON: {e}") from None
    if not isinstance(data, dict):
        raise _Invalid(f"the top level is {'a list' if isinstance(data, list) else _NAMES[type(data)]}, not an object")
    return data


def _check(name: str, value: Any, hint: Any) -> None:
    """Raises _Invalid unless a JSON value fits a field's declared type. The annotations are the
    schema, so a field added to RunState is checked without a table to keep in step."""
    if typing.get_origin(hint) is list:
        if not isinstance(value, list):
            raise _Invalid(f"{name} = {_short(value)} is not a list")
        (item,) = typing.get_args(hint) or (Any,)
        for i, v in enumerate(value):
            _check(f"{name}[{i}]", v, item)
    elif not _fits(value, hint):
        raise _Invalid(f"{name} = {_short(value)} is not {_describe(hint)}")


_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (types.UnionType, typing.Union)


def _fits(value: Any, hint: Any) -> bool:
    if _is_union(hint):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if typing.get_origin(hint) is list:
        return isinstance(value, list)
    if typing.get_origin(hint) is dict or dataclasses.is_dataclass(hint):    # a dataclass is stored as an object
        return isinstance(value, dict)
    if hint in (int, float):            # JSON has no bool/int distinction Python would catch for us
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    if _is_union(hint):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return "a list"
    return _NAMES.get(hint, "an object")


def _reason(e: Exception) -> str:
    return f"no {e}" if isinstance(e, KeyError) else str(e)


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
