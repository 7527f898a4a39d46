"""The control directory, `<run.dir>/control/`: requests operators drop as files.

Owns: the file grammar and consuming requests. A request is a file named
`<name>` or `<name>.<anything>` (so requests of one kind can queue), where
name is one of daemon.judging.requests.CONTROL_NAMES; its body is empty (`touch`) or a JSON object
(a reason; `inject` needs one). Names starting with '.' are ignored (writers
create a hidden file and rename it, so a request is never read half-written).
A request read is deleted; a malformed one — or anything that is not a regular
file: a symbolic link (never followed, whatever it points to), a directory, a
FIFO — is renamed `.<file>.rejected` and reported; an unknown name is reported
once and left alone. Bodies are read up to the cap, never whole; an entry that
vanishes midway is simply gone: nothing here may crash or block the daemon.
File work, and the intake that hands each request to the ledger: the supervisor decides what a
request does.
"""
from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

from daemon.judging.requests import CONTROL_NAMES, MAX_BODY_BYTES, Rejected, Request, parse_body
from daemon.records.ledger import Ledger
from durable import write_atomically

SCAN_EVERY_S = 2.0          # scanned when the watcher flags a change, and at least this often


class ControlDirError(RuntimeError):
    """The control directory is unsafe or unusable; the message says why."""


def ensure(control_dir: Path) -> None:
    """Creates the directory (mode 0750) or checks an existing one: anyone who can write here can
    stop the run, so a world-writable directory is refused."""
    control_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
    mode = control_dir.stat().st_mode
    if mode & stat.S_IWOTH:
        raise ControlDirError(f"control directory {control_dir} is world-writable (mode {stat.S_IMODE(mode):o}); "
                              "chmod o-w it: anyone could stop or pause the run")


class ControlDir:
    def __init__(self, path: Path):
        self.path = path
        self._reported: set[str] = set()
        self._changed = threading.Event()
        self._observer = None
        self._scanned_at = -SCAN_EVERY_S

    def watch(self) -> str:
        """Starts a `watchdog` observer (inotify; a polling observer where inotify is unavailable)
        that flags new files; returns which one runs. The caller still scans now and then."""
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer
        from watchdog.observers.polling import PollingObserver

        changed = self._changed

        class _Flag(FileSystemEventHandler):
            def on_any_event(self, event) -> None:
                changed.set()

        for kind in (Observer, PollingObserver):
            try:
                observer = kind()
                observer.schedule(_Flag(), str(self.path), recursive=False)
                observer.daemon = True
                observer.start()
                self._observer = observer
                return kind.__name__
            except OSError:
                continue
        return "none"

    def changed(self) -> bool:
        """True (once) if the observer saw something since the last call."""
        if self._changed.is_set():
            self._changed.clear()
            return True
        return False

    def close(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=2)
            self._observer = None

    def intake(self, ledger: Ledger) -> list[Request]:
        """The control intake, every tick: new requests, each noted by the ledger (logged, and remembered
        as the run's last request); a rejected file reported as a `control_rejected` event."""
        taken = []
        for req in self.poll(time.monotonic()):
            if isinstance(req, Rejected):
                ledger.emit("control_rejected", level="warning", file=req.file, detail=req.reason)
                continue
            ledger.note_control(req)
            taken.append(req)
        return taken

    def poll(self, now: float) -> list[Request | Rejected]:
        """`take()` when the watcher flagged a change or SCAN_EVERY_S passed since the last scan."""
        if not self.changed() and now - self._scanned_at < SCAN_EVERY_S:
            return []
        self._scanned_at = now
        return self.take()

    def take(self) -> list[Request | Rejected]:
        """Consumes the requests present, oldest first; returns them and the rejections. Never follows
        a symlink, never opens anything but a regular file, never blocks, and an entry that vanishes
        at any moment (another process's churn) is simply gone."""
        try:
            names = [e.name for e in os.scandir(self.path) if not e.name.startswith(".")]
        except OSError:
            return []
        self._reported &= set(names)          # forget names gone (a churn of new names must not grow it)
        found = []
        for name in names:
            try:
                found.append((os.lstat(self.path / name), name))
            except OSError:
                continue                                   # vanished since the scan
        out: list[Request | Rejected] = []
        for st, file in sorted(found, key=lambda f: (f[0].st_mtime_ns, f[1])):
            name = file.split(".", 1)[0]
            if name not in CONTROL_NAMES:
                if file not in self._reported:
                    self._reported.add(file)
                    out.append(Rejected(file, f"unknown control file {file!r}; known: "
                                              f"{', '.join(CONTROL_NAMES)} (left alone)"))
                continue
            try:
                body = parse_body(_read_regular(self.path / file, st))
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as e:
                out.append(Rejected(file, f"{e}; {self._set_aside(file)}"))
                continue
            try:
                os.unlink(self.path / file)
            except FileNotFoundError:
                continue                                   # someone else took it: not ours to act on
            out.append(Request(name, body, file))
        return out

    def _set_aside(self, file: str) -> str:
        try:
            os.rename(self.path / file, self.path / f".{file}.rejected")
            return f"renamed .{file}.rejected"
        except OSError as e:
            return f"could not rename it ({e.strerror or e})"


def _kind(mode: int) -> str:
    for test, what in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "not a regular file"


def _read_regular(path: Path, st: os.stat_result) -> bytes:
    """At most MAX_BODY_BYTES + 1 bytes of a regular file, opened without following a symlink and
    without blocking (a FIFO put there after the lstat opens at once and is refused by its fstat)."""
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{_kind(st.st_mode)}, not a regular file (symbolic links are never followed)")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise ValueError(f"{_kind(mode)}, not a regular file")
        chunks, size = [], 0
        while size <= MAX_BODY_BYTES and (chunk := os.read(fd, MAX_BODY_BYTES + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_request(control_dir: Path, name: str, body: dict[str, Any]) -> Path:
    """What the CLI does: a hidden temporary file, fsynced, renamed to a unique `<name>.<ns>-<pid>`."""
    if name not in CONTROL_NAMES:
        raise ValueError(f"unknown control request {name!r}")
    final = control_dir / f"{name}.{time.time_ns()}-{os.getpid()}"
    write_atomically(final, json.dumps(body, sort_keys=True) if body else "")   # its temporary is hidden
    return final
