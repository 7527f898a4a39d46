"""The supervisor's structured log: one JSON object per line, to stdout (journald) and events.jsonl.

Every line carries ts, level, event, run and generation, plus the event's own fields.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO


def _clean(value: Any) -> Any:
    """Strict JSON: non-finite floats become 'nan'/'inf', at any depth."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class EventLog:
    def __init__(self, path: Path, run: str, stream: TextIO = sys.stdout):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)
        self.stream, self.run, self.generation = stream, run, 0

    def emit(self, event: str, level: str = "info", **fields: Any) -> None:
        record = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}Z",
                  "level": level, "event": event, "run": self.run, "generation": self.generation}
        record.update({k: _clean(v) for k, v in fields.items()})
        line = json.dumps(record, sort_keys=False, allow_nan=False, default=str)
        self._file.write(line + "\n")
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        self._file.close()
