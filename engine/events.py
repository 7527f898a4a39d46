"""Where a worker's events go: one JSON line each on stdout (the rank's log), and, under the
supervisor, one datagram each on its event socket. Safe from any thread; never blocks."""
from __future__ import annotations

import socket
import sys
import threading
from typing import TextIO

from daemon.protocol import send_datagram


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
                print(line, file=self.out, flush=True)
            if self._sock is not None:
                send_datagram(self._sock, self.socket_path, event)
