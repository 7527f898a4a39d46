"""Where a rank's start-up time goes, from the moment its process began to its first step.

Owns: the stage names and their timing. A rank reports the stages with its
`compile` phase event; the supervisor logs them with "compiling", and
bench/recovery.py breaks a recovery down by them. Stdlib only.
"""
from __future__ import annotations

import os
import time


def process_age_s(stat_path: str = "/proc/self/stat") -> float | None:
    """Seconds since this process was created (the kernel's start time, in clock ticks since boot),
    or None where /proc does not say."""
    try:
        with open(stat_path) as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
    return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK"))


_origin: float | None = None      # set when a warm standby is activated: its start counts from there


def restart() -> None:
    """From now on, start-up is timed from this moment (a standby rank's activation), not the process's
    creation."""
    global _origin
    _origin = time.monotonic()


class StartupClock:
    """Seconds spent in each named stage, in the order marked; the first stage runs from the
    process's creation (interpreter start, imports, config), so the stages add up to its age; for
    an activated standby, from its activation."""

    def __init__(self) -> None:
        self.standby = _origin is not None
        self._last = _origin if _origin is not None else time.monotonic() - (process_age_s() or 0.0)
        self.stages: dict[str, float] = {}

    def mark(self, stage: str) -> None:
        """Ends `stage` now."""
        now = time.monotonic()
        self.stages[stage] = round(now - self._last, 3)
        self._last = now
