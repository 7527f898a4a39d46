"""The supervisor's structured log: structlog JSON lines, to stdout (journald) and events.jsonl.

One schema for every event: ts (UTC, ISO 8601, milliseconds), level, event,
run, generation, then the event's own fields (rank and step where they
apply). Strict JSON: non-finite floats are written 'nan'/'inf' at any depth.
events.jsonl rotates by size: events.jsonl.1 … .N, the oldest dropped.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import structlog

from contracts import strict_json

COMMON = ("ts", "level", "event", "run", "generation")


# syslog priorities: journald reads a "<N>" line prefix (SyslogLevelPrefix=, on by default), so
# `journalctl -p err` finds the errors
_PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3, "critical": 2}


def is_journal(stream: TextIO, env=os.environ) -> bool:
    """Whether `stream` is systemd's journal stream ($JOURNAL_STREAM names its device and inode)."""
    try:
        dev, ino = (int(x) for x in env.get("JOURNAL_STREAM", "").split(":"))
        st = os.fstat(stream.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


class RotatingTee:
    """structlog's logger: each rendered line to the stream and to a size-rotated file. The file never
    fails the daemon: while it cannot be written (a full or read-only disk) lines go to the stream
    only (journald under systemd), one line on stderr says so, and the file is tried again later."""

    RETRY_S = 5.0

    def __init__(self, path: Path | None, stream: TextIO, *, max_bytes: int, backups: int):
        self.path, self.stream, self.max_bytes, self.backups = path, stream, max_bytes, backups
        self._file = None
        self._retry_at = 0.0
        self._failing = False
        self.journal = is_journal(stream)  # under systemd: each line carries its level's syslog priority
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

    def _to_file(self, line: str) -> None:
        if self.path is None:
            return
        try:
            if self._file is None:
                if time.monotonic() < self._retry_at:
                    return
                self._file = open(self.path, "a", buffering=1)
            if self.max_bytes and self._file.tell() + len(line) + 1 > self.max_bytes and self._file.tell() > 0:
                self._rotate()
            self._file.write(line + "\n")
            if self._failing:
                self._failing = False
                print(f"llm-pretrain: {self.path} is written again", file=sys.stderr, flush=True)
        except OSError as e:
            self._drop_file()
            if not self._failing:
                self._failing = True
                print(f"llm-pretrain: cannot write {self.path} ({e.strerror or e}); logging to the stream only, "
                      f"retrying every {self.RETRY_S:g} s", file=sys.stderr, flush=True)

    def _drop_file(self) -> None:
        file, self._file, self._retry_at = self._file, None, time.monotonic() + self.RETRY_S
        if file is not None:
            try:
                file.close()
            except OSError:
                pass                      # its unwritten buffer goes with it

    def _write(self, line: str, level: str) -> None:
        self._to_file(line)
        try:
            print(f"<{_PRIORITY[level]}>{line}" if self.journal else line, file=self.stream, flush=True)
        except (OSError, ValueError):
            pass          # a closed stdout (journald restarted, a pipe's reader gone) never ends the daemon

    # structlog calls the method named after the event's level with the rendered line
    msg = info = functools.partialmethod(_write, level="info")
    debug = functools.partialmethod(_write, level="debug")
    warning = functools.partialmethod(_write, level="warning")
    error = functools.partialmethod(_write, level="error")
    critical = functools.partialmethod(_write, level="critical")

    def reopen(self) -> None:
        """Closes the file; the next line opens it again by name: after logrotate moved it, writing
        goes on in a new file (the SIGHUP convention)."""
        if self.path is not None:
            self._drop_file()
            self._retry_at = 0.0

    def close(self) -> None:
        self._drop_file()


def ts_unix_s(ts: Any) -> float | None:
    """An event's `ts` (as `_timestamp` writes it: UTC, ISO 8601) in Unix seconds; None if unreadable."""
    import datetime

    try:
        return datetime.datetime.fromisoformat(str(ts).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _timestamp(_, __, event_dict: dict) -> dict:
    import datetime

    now = datetime.datetime.now(datetime.timezone.utc)
    event_dict["ts"] = now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z"
    return event_dict


def _schema(_, method: str, event_dict: dict) -> dict:
    """The common fields first, in their order; the rest cleaned to strict JSON."""
    ordered = {k: event_dict.pop(k) for k in COMMON if k in event_dict}
    ordered.update({k: strict_json.encode(v) for k, v in event_dict.items()})
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

    @property
    def path(self) -> Path | None:
        """events.jsonl (its rotated backups beside it), or None: the stream only."""
        return self._sink.path

    def emit(self, event: str, level: str = "info", **fields: Any) -> None:
        getattr(self._log, level)(event, **{"run": self.run, "generation": self.generation, **fields})

    def reopen(self) -> None:
        self._sink.reopen()

    def close(self) -> None:
        self._sink.close()


def _dumps(obj: Any, **kw: Any) -> str:
    return json.dumps(obj, allow_nan=False, default=str)
