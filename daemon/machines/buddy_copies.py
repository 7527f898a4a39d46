"""A buddy's part copied while the ranks train (checkpoint.memory_placement = "buddy", several machines).

Each machine's RAM tier holds its own part of every step (checkpointing.parts); the machines this one is the
buddy of (daemon.machines.buddies) are polled from a thread of the daemon while the generation trains, and the
newest step of each one's own part that this machine holds too is copied into this machine's `step-N/`
(daemon.machines.ram_parts.copy_part). When a machine is lost, its part of the newest step copied is with its
buddy: the survivors' parts make that step whole, and nobody goes back to the disk. The step it copied last is
kept by retention (RunFiles.buddy_copy_step) until a newer one is copied. A copy lags the ranks by a poll and a
transfer; a step retired on either side while it is copied is passed over for the next.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, Mapping, Sequence

from daemon.machines import buddies, ram_parts
from daemon.machines.ram_peers import FetchError

POLL_S = 0.05
COPY_TIMEOUT_S = 60.0


class BuddyCopies:
    """This machine's copies of the parts of the members it is the buddy of, for one generation."""

    def __init__(self, *, root: Path, run_id: str, node: int, members: Sequence[int], domains: Sequence[str],
                 urls: Callable[[], Mapping[int, str]], on_copied: Callable[[int], None]):
        """`urls()`: each node's RAM server (its etcd record's); `on_copied(step)`: after each copy (retention keeps
        that step until the next)."""
        self.root, self.run_id, self.urls, self.on_copied = root, run_id, urls, on_copied
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
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=COPY_TIMEOUT_S)

    def newest(self) -> int:
        """The newest step every peer's part was copied of (0: none yet)."""
        return min((self.copied.get(p, 0) for p in self.of), default=0)

    def _run(self) -> None:
        while not self._stop.is_set():
            urls = self.urls()
            copied_any = False
            for peer, slot in self.of.items():
                if self._stop.is_set() or not urls.get(peer):
                    continue
                try:
                    step = ram_parts.copy_part(urls[peer], self.run_id, slot, self.root,
                                               after=self.copied.get(peer, 0), deadline_s=COPY_TIMEOUT_S)
                except (FetchError, OSError) as e:       # retired on one side meanwhile, or the peer is gone
                    self.failures += 1
                    self.last_error = str(e)
                    continue
                if step is not None:
                    self.copied[peer] = step
                    self.count += 1
                    copied_any = True
                    if len(self.of) == 1 or all(self.copied.get(p) == step for p in self.of):
                        self.on_copied(step)
            if not copied_any:
                self._stop.wait(POLL_S)
