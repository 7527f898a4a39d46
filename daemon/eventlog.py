"""The supervisor's structured log: structlog JSON lines, to stdout (journald) and events.jsonl.

One schema for every event: ts (UTC, ISO 8601, milliseconds), level, event,
run, generation, then the event's own fields (rank and step where they
apply). Strict JSON: non-finite floats are written 'nan'/'inf' at any depth.
events.jsonl rotates by size: events.jsonl.1 … .N, the oldest dropped.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import structlog

COMMON = ("ts", "level", "event", "run", "generation")


def _clean(value: Any) -> Any:
    """Strict JSON: non-finite floats become 'nan'/'inf', at any depth."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class RotatingTee:
    """structlog's logger: each rendered line to the stream and to a size-rotated file."""

    def __init__(self, path: Path | None, stream: TextIO, *, max_bytes: int, backups: int):
        self.path, self.stream, self.max_bytes, self.backups = path, stream, max_bytes, backups
        self._file = None
        if path is not None:              # None: the stream only (a daemon that may not touch the run)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1)

    def _rotate(self) -> None:
        self._file.close()
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.rename(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.backups > 0:
            os.rename(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        self._file = open(self.path, "a", buffering=1)

    def msg(self, line: str) -> None:
        if self._file is not None:
            if self.max_bytes and self._file.tell() + len(line) + 1 > self.max_bytes and self._file.tell() > 0:
                self._rotate()
            self._file.write(line + "\n")
        print(line, file=self.stream, flush=True)

    debug = info = warning = error = critical = msg

    def reopen(self) -> None:
        """Closes and opens the file again by name: after logrotate moved it, writing goes on in a
        new file (the SIGHUP convention)."""
        if self._file is not None:
            self._file.close()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def _timestamp(_, __, event_dict: dict) -> dict:
    import datetime

    now = datetime.datetime.now(datetime.timezone.utc)
    event_dict["ts"] = now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z"
    return event_dict


def _schema(_, method: str, event_dict: dict) -> dict:
    """The common fields first, in their order; the rest cleaned to strict JSON."""
    ordered = {k: event_dict.pop(k) for k in COMMON if k in event_dict}
    ordered.update({k: _clean(v) for k, v in event_dict.items()})
    return ordered


class EventLog:
    def __init__(self, path: Path | None, run: str, stream: TextIO = sys.stdout, *, max_bytes: int = 64 << 20,
                 backups: int = 5):
        self._sink = RotatingTee(path, stream, max_bytes=max_bytes, backups=backups)
        self.run, self.generation = run, 0
        self._log = structlog.wrap_logger(
            self._sink, processors=[structlog.processors.add_log_level, _timestamp, _schema,
                                    structlog.processors.JSONRenderer(serializer=_dumps)],
            context_class=dict, cache_logger_on_first_use=False)

    def emit(self, event: str, level: str = "info", **fields: Any) -> None:
        getattr(self._log, level)(event, **{"run": self.run, "generation": self.generation, **fields})

    def reopen(self) -> None:
        self._sink.reopen()

    def close(self) -> None:
        self._sink.close()


def _dumps(obj: Any, **kw: Any) -> str:
    return json.dumps(obj, allow_nan=False, default=str)
