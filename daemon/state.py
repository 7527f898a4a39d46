"""The run's persistent state, `<run.dir>/state.json`: what a restarted daemon continues from.

Written atomically (temporary file, fsync, rename, fsync the directory)
before each decision is acted on, as strict JSON (a non-finite loss is
written "nan", as in the event log). Read back strictly too: a file that is
not what this module writes (not JSON, not an object, a field of the wrong
type, an incident that cannot be parsed) is a `StateCorruptError`, never a
half-loaded state; the daemon then sets it aside (`set_aside`) and rebuilds
it from the event log (daemon.rebuild).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
import types
import typing
from pathlib import Path
from typing import Any, Mapping

from contracts.errors import DataError
from contracts.protocol import Recovery
from daemon.eventlog import non_finite_floats, strict_json
from daemon.incidents import IncidentRecord
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
    last_committed_step: int = 0         # newest committed checkpoint when the last generation began
    status: str = "new"                  # new, running, restarting, finished, stopped, gave_up, failed
    incidents: list[IncidentRecord] = dataclasses.field(default_factory=list)   # with the action taken
    recovery: Recovery | None = None     # the policy's directive in force
    config_changes: dict[str, Any] = dataclasses.field(default_factory=dict)  # "section.key" -> value, by policy
    pending_rollback: int | None = None  # a rollback target decided and recorded, its renames not yet done
    undecided: dict[str, Any] | None = None   # an incident that ended a generation, not yet decided (an Incident)
    checkpoints_failing_since: int | None = None   # the step of the first failed save since the last commit
    processes: list[dict[str, Any]] = dataclasses.field(default_factory=list)   # this generation's, for orphans
    last_control: dict[str, Any] = dataclasses.field(default_factory=dict)   # the last request taken: name, file, unix_s
    log_dir: str = ""                    # where events.jsonl and the rank logs are
    total_steps: int = 0                 # train.steps of the run
    last_progress: dict[str, Any] = dataclasses.field(default_factory=dict)   # step, loss, tokens_per_s, unix_s
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
                incidents.append(IncidentRecord.from_dict({**record, "evidence": non_finite_floats(
                    record.get("evidence") or {})}))
            except (KeyError, TypeError, ValueError) as e:
                raise _Invalid(f"incidents[{i}] is not an incident record: {_reason(e)}") from None
        fields["incidents"] = incidents
        try:
            fields["recovery"] = Recovery.from_dict(fields["recovery"]) if fields.get("recovery") else None
        except (KeyError, TypeError, ValueError) as e:
            raise _Invalid(f"recovery is not a recovery directive: {_reason(e)}") from None
        fields["last_progress"] = non_finite_floats(fields.get("last_progress") or {})
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["incidents"] = [r.to_dict() for r in self.incidents]
        out["recovery"] = self.recovery.to_dict() if self.recovery else None
        return out

    def save(self, run_dir: Path) -> None:
        self.updated_unix_s = time.time()
        write_atomically(run_dir / STATE_FILE, json.dumps(strict_json(self.to_dict()), indent=1, sort_keys=True,
                                                          allow_nan=False))


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
