"""systemd's notify protocol (sd_notify(3)), spoken by the supervisor: READY, STATUS, WATCHDOG,
STOPPING — datagrams to $NOTIFY_SOCKET. Without that variable (not under systemd) it does nothing.

Owns: the socket, the watchdog cadence (half of $WATCHDOG_USEC, when it names
this process in $WATCHDOG_PID or names no process), and not repeating an
unchanged STATUS. Stdlib only; never blocks; a lost message costs nothing.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Mapping


class Notifier:
    def __init__(self, env: Mapping[str, str] = os.environ):
        path = env.get("NOTIFY_SOCKET", "")
        self.address = ("\0" + path[1:]) if path.startswith("@") else path   # '@': the abstract namespace
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)
        usec = int(env.get("WATCHDOG_USEC", "0") or 0)
        pid = env.get("WATCHDOG_PID")
        self.watchdog_s = usec / 2e6 if usec > 0 and (not pid or int(pid) == os.getpid()) else 0.0
        self._last_ping = 0.0
        self._last_status = ""

    def send(self, *fields: str) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.sendto("\n".join(fields).encode(), self.address)
            return True
        except OSError:
            return False

    def ready(self, status: str) -> None:
        self._last_status = status
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def status(self, status: str) -> None:
        if status != self._last_status:
            self._last_status = status
            self.send(f"STATUS={status}")

    def tick(self, now: float | None = None) -> None:
        """Called from the supervisor's loop: a WATCHDOG=1 ping every half watchdog period."""
        if not self.watchdog_s:
            return
        now = time.monotonic() if now is None else now
        if now - self._last_ping >= self.watchdog_s:
            self._last_ping = now
            self.send("WATCHDOG=1")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
