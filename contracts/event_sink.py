"""Where a worker's events go: one JSON line each on stdout (the rank's log), and, under the
supervisor, one datagram each on its event socket. Safe from any thread. A full socket queue (a
daemon slow to drain) is waited for, briefly for a step and longer for the rest: losing a
checkpoint's commit or a rank's exit would leave the daemon guessing. A daemon that is gone is
never waited for."""
from __future__ import annotations

import socket
import sys
import threading
from typing import TextIO

from contracts.protocol import DELIVER_WAIT_S, StepEvent, send_datagram

STEP_WAIT_S = 0.25      # a step event that cannot be queued in this long is dropped: the next one follows


class EventSink:
    def __init__(self, out: TextIO = sys.stdout, socket_path: str | None = None):
        self.out = out
        self.socket_path = socket_path
        self._sock = None
        if socket_path:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
        self._lock = threading.Lock()

    def emit(self, event, *, log: bool = True) -> None:
        """`log=False`: the datagram only (per-step events between log intervals)."""
        line = event.to_json()
        with self._lock:
            if log:
                try:
                    print(line, file=self.out, flush=True)
                except OSError:
                    pass       # a full disk under the rank's log: the datagram still reaches the daemon
            if self._sock is not None:
                send_datagram(self._sock, self.socket_path, event,
                              STEP_WAIT_S if isinstance(event, StepEvent) else DELIVER_WAIT_S)


class TolerantStream:
    """A text stream whose writes never raise OSError: a rank's stdout and stderr are its log file, and
    a full disk under it must not end the rank (what could not be written is lost; the daemon still
    gets every event as a datagram). Each line goes out in one write: the log is shared with other
    processes (the ranks of a generation being torn down while the next one's start), and print()
    hands a line and its newline over apart, which an unbuffered stream (PYTHONUNBUFFERED) writes as
    two system calls another process's line, or a kill, can fall between. A thread's unfinished line
    waits for its newline or a flush."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._unfinished = threading.local()

    def write(self, text: str) -> int:
        pending = getattr(self._unfinished, "text", "") + text
        cut = pending.rfind("\n") + 1
        self._unfinished.text = pending[cut:]
        if cut:
            self._write(pending[:cut])
        return len(text)

    def flush(self) -> None:
        pending, self._unfinished.text = getattr(self._unfinished, "text", ""), ""
        if pending:
            self._write(pending)
        try:
            self._stream.flush()
        except OSError:
            pass

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
        except OSError:
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
