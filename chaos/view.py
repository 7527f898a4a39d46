"""What the soak reads of a run: the daemon's events, rank 0's step events, pids, the last commit.

Everything comes from the run's own files (events.jsonl, logs/rank-0.log, daemon.lock), read
afresh on each call, so the soak sees exactly what an operator's tools see; lines still being
written are skipped.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterator

from daemon.records.eventlog import ts_unix_s


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    try:
        text = path.read_text(errors="replace")
    except (FileNotFoundError, NotADirectoryError):
        return
    for line in text.splitlines():
        if line.startswith("{") and line.endswith("}"):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


@dataclasses.dataclass(frozen=True)
class Step:
    generation: int
    step: int
    step_s: float


class RunView:
    def __init__(self, run_dir: Path, log_dir: Path):
        self.run_dir, self.log_dir = run_dir, log_dir

    def events(self, since_unix_s: float = 0.0) -> list[dict[str, Any]]:
        """The daemon's events at or after `since_unix_s`, each with `unix_s` added."""
        out = []
        for e in _lines(self.log_dir / "events.jsonl"):
            e["unix_s"] = ts_unix_s(e.get("ts"))
            if e["unix_s"] is not None and e["unix_s"] >= since_unix_s:
                out.append(e)
        return out

    def first(self, name: str, since_unix_s: float, **match: Any) -> dict[str, Any] | None:
        for e in self.events(since_unix_s):
            if e.get("event") == name and all(e.get(k) == v for k, v in match.items()):
                return e
        return None

    def steps(self) -> list[Step]:
        """Rank 0's step events in the order it logged them (every generation)."""
        return [Step(int(e["generation"]), int(e["step"]), float(e["step_s"]))
                for e in _lines(self.log_dir / "rank-0.log") if e.get("kind") == "step"]

    def last_step(self) -> tuple[int, int]:
        """(generation, step) of rank 0's newest step event; (-1, 0) before the first."""
        steps = self.steps()
        return (steps[-1].generation, steps[-1].step) if steps else (-1, 0)

    def generation_start(self) -> dict[str, Any] | None:
        starts = [e for e in self.events() if e.get("event") == "generation_start"]
        return starts[-1] if starts else None

    def rank_pids(self) -> dict[int, int]:
        start = self.generation_start()
        return {int(r): int(p) for r, p in (start or {}).get("pids", {}).items()}

    def daemon_pid(self) -> int | None:
        try:
            text = (self.run_dir / "daemon.lock").read_text().strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def final_digest(self) -> str | None:
        """rank 0's parameter digest at its last exit event."""
        exits = [e for e in _lines(self.log_dir / "rank-0.log") if e.get("kind") == "exit"]
        return exits[-1].get("params_sha256") if exits else None
