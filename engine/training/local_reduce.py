"""Summing data-parallel gradients through shared memory when every rank runs on this machine (CPU).

MindSpore's CPU AllReduce moves gradients between two local ranks through its RPC
transport, slowly enough that two ranks of small-20m trained barely faster than one
(bench/dp_scaling.py; the figures are in the README). NCCL and gloo use shared
memory inside a machine; so does this: each rank copies its flat buffer into its
slot of one /dev/shm segment, each sums its share of the buffer over all slots,
and each reads the whole sum back. Two barriers per step; the sum over slots
runs in rank order, which for two ranks is the same float sum as a ring's.

The segment and the barrier's FIFOs belong to one group of ranks, named by a
path prefix:
- under the supervisor (a local group, daemon/processes/mindspore_env.py: no MindSpore cluster
  at all) the prefix is new for every generation, so every rank creates what is
  missing and opens it, with no barrier; rank 0 unlinks the files after the
  first sum (every rank holds them by then), and the supervisor removes what a
  generation that died earlier left;
- under msrun (MindSpore's cluster) the prefix comes from the scheduler's port,
  which an earlier cluster may have used: rank 0 creates the files fresh, the
  ranks open them between two MindSpore barriers, and rank 0 unlinks them at once.
A rank that dies leaves its peers blocked in the barrier, as in a collective;
the supervisor's crash and hang handling ends them.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Callable

import numpy as np


class LocalAllReduce:
    """Sum of a float32 vector of `size` over `world` ranks of this machine."""

    def __init__(self, *, rank: int, world: int, size: int, prefix: Path,
                 barrier: Callable[[], None] | None = None):
        """prefix: the group's files are prefix + ".seg", ".go<rank>", ".arrive". barrier: MindSpore's,
        where the prefix may be an earlier cluster's; None where it is new (a local group)."""
        if world < 2:
            raise ValueError(f"a local all-reduce needs at least 2 ranks, not {world}")
        self.rank, self.world, self.size = rank, world, size
        base = Path(prefix)
        paths = [base.with_name(base.name + ".seg")] + [base.with_name(f"{base.name}.go{r}") for r in range(world)]
        paths.append(base.with_name(base.name + ".arrive"))
        self._paths = paths if rank == 0 else []          # rank 0 unlinks them
        nbytes = (world + 1) * size * 4
        if barrier is None:                # a new prefix: whoever comes first creates each file
            fd = os.open(paths[0], os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(fd, nbytes)       # every rank the same size: never cuts what a peer wrote
            for path in paths[1:]:
                try:
                    os.mkfifo(path, 0o600)
                except FileExistsError:
                    pass
        else:
            if rank == 0:
                for path in paths:
                    path.unlink(missing_ok=True)
                fd = os.open(paths[0], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.ftruncate(fd, nbytes)
                for path in paths[1:]:
                    os.mkfifo(path, 0o600)
            barrier()                      # the segment and FIFOs exist
            if rank != 0:
                fd = os.open(paths[0], os.O_RDWR)
        # O_RDWR on a FIFO never blocks at open (Linux); each rank holds what it reads and writes
        self._go = [os.open(path, os.O_RDWR) for path in paths[1:1 + world]]
        self._arrive = os.open(paths[-1], os.O_RDWR)
        self._map = mmap.mmap(fd, nbytes)
        os.close(fd)
        if barrier is not None:
            barrier()                      # everyone holds everything
            self._unlink()
        view = np.frombuffer(self._map, dtype=np.float32)
        self.slots = view[:world * size].reshape(world, size)
        self.result = view[world * size:]
        bounds = np.linspace(0, size, world + 1).astype(np.int64)
        self._lo, self._hi = int(bounds[rank]), int(bounds[rank + 1])

    def _unlink(self) -> None:
        for path in self._paths:
            path.unlink(missing_ok=True)
        self._paths = []

    def _barrier(self) -> None:
        """Every rank tells rank 0 it arrived; rank 0 releases them all once all have."""
        if self.rank == 0:
            need = self.world - 1
            while need:
                need -= len(os.read(self._arrive, need))
            for r in range(1, self.world):
                os.write(self._go[r], b"x")
        else:
            os.write(self._arrive, b"x")
            while not os.read(self._go[self.rank], 1):
                pass

    def all_reduce(self, local: np.ndarray) -> np.ndarray:
        """The sum of every rank's `local` (float32, `size`), as a view valid until the next call."""
        np.copyto(self.slots[self.rank], local.reshape(-1), casting="no")
        self._barrier()                    # every slot written
        lo, hi = self._lo, self._hi
        out = self.result[lo:hi]
        np.add(self.slots[0, lo:hi], self.slots[1, lo:hi], out=out)
        for r in range(2, self.world):
            np.add(out, self.slots[r, lo:hi], out=out)
        self._barrier()                    # every share summed; nobody writes a slot before all read
        if self._paths:                    # every rank came through a barrier: all hold the files
            self._unlink()
        return self.result

    def close(self) -> None:
        for fd in (*self._go, self._arrive):
            os.close(fd)
        self.slots = self.result = None
        try:
            self._map.close()
        except BufferError:                # a tensor still shares the sum's pages: the exit unmaps them
            pass
