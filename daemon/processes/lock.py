"""One daemon per run directory: an flock on `<run.dir>/daemon.lock`, which also holds the pid.

The kernel drops an flock when its holder dies, so a lock left by a killed
daemon is stale by construction and the next daemon simply takes it.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path


class LockHeldError(RuntimeError):
    def __init__(self, path: Path, pid: str):
        super().__init__(f"run directory is in use: {path} is held by a live daemon (pid {pid or 'unknown'})")
        self.pid = pid


class LockUnusableError(RuntimeError):
    """The lock file cannot be created or opened (permissions, a read-only or missing directory)."""


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = run_dir / "daemon.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Raises LockHeldError (another live daemon) or LockUnusableError (the file cannot be used)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise LockUnusableError(f"cannot take the run's lock {self.path}: {e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise LockHeldError(self.path, pid) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None



def holder(run_dir: Path) -> str | None:
    """The pid (as written) of the live daemon holding the run's lock; None when no daemon holds it."""
    try:
        fd = os.open(run_dir / "daemon.lock", os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)                 # also drops the shared lock, if it was taken
    return None
