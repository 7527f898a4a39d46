"""The run's persistent state, `<run.dir>/state.json`: what a restarted daemon continues from.

Written atomically (temporary file, fsync, rename, fsync the directory)
before each decision is acted on.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from daemon.incidents import IncidentRecord
from daemon.protocol import Recovery
from durable import write_atomically

STATE_FILE = "state.json"


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
    processes: list[dict[str, Any]] = dataclasses.field(default_factory=list)   # this generation's, for orphans
    last_control: dict[str, Any] = dataclasses.field(default_factory=dict)   # the last request taken: name, file, unix_s
    log_dir: str = ""                    # where events.jsonl and the rank logs are
    total_steps: int = 0                 # train.steps of the run
    last_progress: dict[str, Any] = dataclasses.field(default_factory=dict)   # step, loss, tokens_per_s, unix_s
    daemon_pid: int = 0
    updated_unix_s: float = 0.0

    @classmethod
    def load(cls, run_dir: Path) -> "RunState":
        path = run_dir / STATE_FILE
        if not path.exists():
            return cls()
        data = json.loads(path.read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in known}
        fields["incidents"] = [IncidentRecord.from_dict(r) for r in fields.get("incidents") or ()]
        fields["recovery"] = Recovery.from_dict(fields["recovery"]) if fields.get("recovery") else None
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["incidents"] = [r.to_dict() for r in self.incidents]
        out["recovery"] = self.recovery.to_dict() if self.recovery else None
        return out

    def save(self, run_dir: Path) -> None:
        self.updated_unix_s = time.time()
        write_atomically(run_dir / STATE_FILE, json.dumps(self.to_dict(), indent=1, sort_keys=True))
