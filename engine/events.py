"""Where a worker's events go: one JSON line each on stdout, safe to call from any thread.

(The supervisor's datagram socket joins here when it lands.)
"""
from __future__ import annotations

import sys
import threading
from typing import TextIO


class EventSink:
    def __init__(self, out: TextIO = sys.stdout):
        self.out = out
        self._lock = threading.Lock()

    def emit(self, event) -> None:
        line = event.to_json()
        with self._lock:
            print(line, file=self.out, flush=True)
