"""Writing state.json so that a disk that refuses it never ends the daemon.

Owns the retries of an unsaved state: a refused write (a full or read-only disk, an I/O error) keeps
the state in memory, says so once (`state_save_failed`), and is tried again every SAVE_RETRY_S from
the loop's tick until the disk takes it (`state_saved`). The state itself is daemon.records.state's; what
is recorded when is the Ledger's.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from daemon.records.state import RunState

SAVE_RETRY_S = 5.0          # an unsaved state.json is tried again this often


class StateFile:
    def __init__(self, run_dir: Path, emit: Callable[..., None]):
        self.run_dir, self._emit = run_dir, emit
        self.unsaved_since: float | None = None   # state.json could not be written since then
        self.retried_at = 0.0

    def save(self, state: RunState) -> None:
        """state.json, atomically; on a refusal the state stays in memory, said to be unsaved."""
        try:
            state.save(self.run_dir)
        except OSError as e:
            if self.unsaved_since is None:
                self.unsaved_since = time.monotonic()
                self._emit("state_save_failed", level="error", detail=f"{e.strerror or e}: state.json kept in "
                           f"memory, written again as soon as the disk takes it")
            return
        if self.unsaved_since is not None:
            self._emit("state_saved", detail=f"state.json written again after "
                                             f"{time.monotonic() - self.unsaved_since:.0f} s")
            self.unsaved_since = None

    def retry(self, state: RunState, now: float) -> None:
        """From the loop's tick: an unsaved state is written again once SAVE_RETRY_S has passed."""
        if self.unsaved_since is not None and now - self.retried_at >= SAVE_RETRY_S:
            self.retried_at = now
            self.save(state)
