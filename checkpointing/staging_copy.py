"""The blocking part of a save, the copy of a rank's tensors into its writer's staging buffers, on
several threads.

While a rank copies, its step waits: nothing else runs on the cores it trains on, so the copy may
take them all. numpy releases the GIL for a large copy, and one thread's memcpy leaves memory
bandwidth unused: two threads copy 245 MB in ~22 ms where one takes ~40 (measured on a 2-core
Intel Xeon VM). The tensors are cut into byte-balanced runs of flat slices, one run per thread;
the caller's thread copies one of them. Small saves (a RAM tier of a tiny model) stay on one thread:
handing work to another costs more than it saves.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

MIN_PARALLEL_BYTES = 8 << 20       # below this a copy stays on the caller's thread


def runs(pairs: Sequence[tuple[np.ndarray, np.ndarray]], n: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """(source, destination) pairs cut into `n` runs of about equal bytes, a tensor split across two runs
    where a boundary falls inside it (flat slices of contiguous arrays; any other goes whole)."""
    total = sum(s.nbytes for s, _ in pairs)
    share = -(-total // n)
    out: list[list[tuple[np.ndarray, np.ndarray]]] = [[]]
    room = share
    for src, dst in pairs:
        if not (src.flags.c_contiguous and dst.flags.c_contiguous) or src.nbytes == 0:
            out[-1].append((src, dst))
            room -= src.nbytes
            continue
        flat_s, flat_d, at = src.reshape(-1), dst.reshape(-1), 0
        while at < flat_s.size:
            if room <= 0 and len(out) < n:
                out.append([])
                room = share
            take = min(flat_s.size - at, max(1, room // src.itemsize))
            out[-1].append((flat_s[at:at + take], flat_d[at:at + take]))
            at += take
            room -= take * src.itemsize
    return out


def _copy(run: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    for src, dst in run:
        np.copyto(dst, src)


class StagingCopier:
    """Copies (source, destination) pairs, on `threads` threads when they are large enough: the
    caller's and `threads - 1` of its own, started at the first large copy, each given one run. A
    rank passes the threads it computes with (engine.model.fused_cpu.threads: its share of the
    cores, those it is bound to): its step is what waits for the copy."""

    def __init__(self, threads: int):
        self.threads = max(1, threads)
        self._inboxes: list[queue.SimpleQueue] = []

    def copy(self, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        if self.threads == 1 or sum(s.nbytes for s, _ in pairs) < MIN_PARALLEL_BYTES:
            _copy(pairs)
            return
        if not self._inboxes:
            self._inboxes = [_helper(i) for i in range(1, self.threads)]
        mine, *theirs = runs(pairs, self.threads)
        futures = []
        for inbox, run in zip(self._inboxes, theirs):
            futures.append(Future())
            inbox.put((run, futures[-1]))
        try:
            _copy(mine)
        finally:
            for f in futures:                # never return while a helper still writes the buffers
                f.exception()
        for f in futures:
            f.result()                       # a failed copy raises here, as on one thread


def _helper(index: int) -> queue.SimpleQueue:
    """A daemon thread that copies each run put in its inbox and says so on the run's future."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def serve() -> None:
        while True:
            run, done = inbox.get()
            try:
                _copy(run)
            except Exception as e:           # the caller raises it
                done.set_exception(e)
            else:
                done.set_result(None)

    threading.Thread(target=serve, name=f"checkpoint-staging-{index}", daemon=True).start()
    return inbox
