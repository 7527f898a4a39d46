"""A buddy's part copied while the ranks train (checkpoint.memory_placement = "buddy", several machines).

Each machine's RAM tier holds its own part of every step (checkpointing.parts); the machines this one is the
buddy of (daemon.machines.buddies) are polled from a thread of the daemon while the generation trains, and the
newest step of each one's own part that this machine holds too is copied into this machine's `step-N/`
(daemon.machines.ram_parts.copy_part). When a machine is lost, its part of the newest step copied is with its
buddy: the survivors' parts make that step whole, and nobody goes back to the disk. Retention keeps the step
being copied and the newest one every peer's part was copied into (`on_kept`: RunFiles.buddy_kept) until newer
ones are. A copy lags the ranks by a poll and a transfer; a step retired on either side while it is copied
(each keeps the steps an incident may need, 13 by default, and its newest two: a part must travel within as
many RAM intervals) is passed over for the next.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Mapping, Sequence

from daemon.machines import buddies, ram_parts
from daemon.machines.ram_peers import FetchError

POLL_S = 0.05
COPY_TIMEOUT_S = 30.0
STOP_WAIT_S = 1.0


class _Stopped(FetchError):
    """The generation ended while a part was being copied."""


class BuddyCopies:
    """This machine's copies of the parts of the members it is the buddy of, for one generation."""

    def __init__(self, *, root: Path, run_id: str, node: int, members: Sequence[int], domains: Sequence[str],
                 urls: Callable[[], Mapping[int, str]], on_kept: Callable[[frozenset[int]], None]):
        """`urls()`: each node's RAM server (its etcd record's); `on_kept(steps)`: the steps retention keeps for the
        copies (the one being copied, the newest copied of every peer's part)."""
        self.root, self.run_id, self.urls, self.on_kept = root, run_id, urls, on_kept
        self.of = {peer: list(members).index(peer) for peer in buddies.kept_by(node, members, domains)}
        self.copied: dict[int, int] = {}          # peer -> the newest step of its part copied here
        self.count, self.failures, self.last_error = 0, 0, ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="buddy-copies", daemon=True)

    @property
    def peers(self) -> list[int]:
        return sorted(self.of)

    def start(self) -> "BuddyCopies":
        if self.of:
            self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the copies: a transfer under way breaks off at its next chunk, and puts nothing in place after. One
        waiting on a lost peer (a connection that never answers) is not waited for: it ends at its timeout."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=STOP_WAIT_S)

    def newest(self) -> int:
        """The newest step every peer's part was copied of (0: none yet)."""
        return min((self.copied.get(p, 0) for p in self.of), default=0)

    def _tick(self) -> None:
        if self._stop.is_set():
            raise _Stopped("the generation ended")

    def _keep(self, copying: int | None = None) -> None:
        self.on_kept(frozenset(s for s in (self.newest(), copying) if s))

    def _run(self) -> None:
        while not self._stop.is_set():
            copied_any = False
            for peer, slot in self.of.items():
                url = self.urls().get(peer)
                if self._stop.is_set() or not url:
                    continue
                try:
                    step = ram_parts.copy_part(url, self.run_id, slot, self.root, after=self.copied.get(peer, 0),
                                               deadline_s=COPY_TIMEOUT_S, tick=self._tick, copying=self._keep)
                except _Stopped:
                    break
                except Exception as e:           # a thread boundary: retired on one side meanwhile, the peer gone
                    self.failures += 1
                    self.last_error = f"{type(e).__name__}: {e}"
                    continue
                if step is not None:
                    self.copied[peer] = step
                    self.count += 1
                    copied_any = True
                self._keep()
            if not copied_any:
                self._stop.wait(POLL_S)
