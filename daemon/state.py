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

from durable import write_atomically

STATE_FILE = "state.json"


@dataclasses.dataclass
class RunState:
    generation: int = 0                  # generations started so far (the next is generation + 1)
    restarts: int = 0                    # restarts after crashes and hangs, in all
    restarts_without_progress: int = 0   # consecutive restarts with no new committed checkpoint
    last_committed_step: int = 0         # newest committed checkpoint when the last generation began
    status: str = "new"                  # new, running, restarting, finished, stopped, gave_up, failed
    incidents: list[dict[str, Any]] = dataclasses.field(default_factory=list)   # with the action taken
    recovery: dict[str, Any] | None = None    # the policy's directive in force (daemon.protocol.Recovery)
    config_changes: dict[str, Any] = dataclasses.field(default_factory=dict)  # "section.key" -> value, by policy
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
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, run_dir: Path) -> None:
        self.updated_unix_s = time.time()
        write_atomically(run_dir / STATE_FILE, json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True))
