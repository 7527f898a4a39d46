"""A warm standby's imports on CPU time the training leaves idle, and its process back to normal after.

A standby (engine/rank/standby.py) starts while the generation before it trains, and importing
MindSpore and the engine takes it ~2.5 CPU seconds a process: on the same cores as the ranks, the
steps after every recovery ran slower by about as much (issue 50). Under SCHED_IDLE those imports
take only cycles no other task wants; the standby then goes back to SCHED_OTHER before it forms its
cluster (whose heartbeats must not starve) and long before it trains — or after LIMIT_S at most, where
the training leaves too little idle CPU for the imports to finish.

Leaving SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE that allows the process's nice value (the
systemd units set `LimitNICE=+0`: back to nice 0, never above it); without either, a process that
entered could not leave, so it does not enter and imports at its usual priority. No MindSpore here.
"""
from __future__ import annotations

import contextlib
import os
import resource
import threading
from typing import Iterator

# the longest a standby imports on idle CPU only: the daemon takes a standby whose cluster has not formed 60 s
# after its start for stuck (daemon/processes/standby.py FORM_TIMEOUT_S); ~2.5 s of imports at normal priority
# and the cluster's formation fit in what is left
LIMIT_S = 20.0
CAP_SYS_NICE = 23           # linux/capability.h


class IdleCpuError(RuntimeError):
    """A thread could not be put back to normal scheduling (it would train on idle CPU only)."""


def can_leave() -> bool:
    """Whether this process may go from SCHED_IDLE back to SCHED_OTHER at its nice value: CAP_SYS_NICE
    in effect (root without it — a container's default — may not), or RLIMIT_NICE's ceiling (20 - limit)
    at or below its nice value."""
    if _has_capability(CAP_SYS_NICE):
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - soft <= os.getpriority(os.PRIO_PROCESS, 0)


def _has_capability(bit: int) -> bool:
    """Whether capability number `bit` is in this process's effective set (/proc/self/status CapEff)."""
    try:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return False
    return bool(int(line.split()[1], 16) >> bit & 1)


def enter() -> bool:
    """The calling thread (and every thread it starts from now on) to SCHED_IDLE, where it can leave it
    again; True if it entered."""
    if not hasattr(os, "SCHED_IDLE") or not can_leave():
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        return False
    return True


def leave() -> None:
    """Every thread of this process to SCHED_OTHER (threads started while idle inherited SCHED_IDLE)."""
    for name in os.listdir("/proc/self/task"):
        try:
            if os.sched_getscheduler(int(name)) == os.SCHED_IDLE:
                os.sched_setscheduler(int(name), os.SCHED_OTHER, os.sched_param(0))
        except ProcessLookupError:           # the thread ended meanwhile
            continue
        except OSError as e:
            raise IdleCpuError(f"thread {name} of this standby cannot leave SCHED_IDLE ({e}); the standby would "
                               f"train on idle CPU only") from e


@contextlib.contextmanager
def only(limit_s: float = LIMIT_S) -> Iterator[bool]:
    """The block on idle CPU only (where the process can come back) for at most `limit_s` (then at normal
    priority: a machine the training keeps busy would starve it), then every thread back to normal. Yields
    whether it ran idle."""
    entered = enter()
    timer = None
    if entered:
        timer = threading.Timer(limit_s, _leave_quietly)
        timer.daemon = True
        timer.start()
    try:
        yield entered
    finally:
        if timer is not None:
            timer.cancel()
            leave()


def _leave_quietly() -> None:
    """leave(), on the limit's timer thread: an error is the block's to raise, when it ends."""
    try:
        leave()
    except IdleCpuError:
        pass
