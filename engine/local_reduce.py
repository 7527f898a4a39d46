"""Summing data-parallel gradients through shared memory when every rank runs on this machine (CPU).

MindSpore's CPU AllReduce moves about 120 MB/s between two local ranks (its RPC
transport; measured: 0.7 s for small-20m's 82 MB of gradients, a third of the
step, so two ranks trained barely faster than one). NCCL and gloo use shared
memory inside a machine; so does this: each rank copies its flat buffer into its
slot of one /dev/shm segment, each sums its share of the buffer over all slots,
and each reads the whole sum back. Two barriers per step; the sum over slots
runs in rank order, which for two ranks is the same float sum as a ring's.

The segment and the barrier's FIFOs belong to one cluster: rank 0 creates them
fresh under a name from the scheduler's port, the ranks open them between two
MindSpore barriers, and rank 0 unlinks them at once, so nothing is left in
/dev/shm whatever happens to the processes. A rank that dies leaves its peers
blocked in the barrier, as in a collective; the supervisor's crash and hang
handling ends them.
"""
from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Callable

import numpy as np

SHM_DIR = Path("/dev/shm")


class LocalAllReduce:
    """Sum of a float32 vector of `size` over `world` ranks of this machine."""

    def __init__(self, *, rank: int, world: int, size: int, tag: str, barrier: Callable[[], None],
                 directory: Path = SHM_DIR):
        if world < 2:
            raise ValueError(f"a local all-reduce needs at least 2 ranks, not {world}")
        self.rank, self.world, self.size = rank, world, size
        base = directory / f"llm-pretrain-reduce-{tag}"
        paths = [base.with_name(base.name + ".seg")] + [base.with_name(f"{base.name}.go{r}") for r in range(world)]
        paths.append(base.with_name(base.name + ".arrive"))
        nbytes = (world + 1) * size * 4
        if rank == 0:
            for path in paths:
                path.unlink(missing_ok=True)
            fd = os.open(paths[0], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, nbytes)
            for path in paths[1:]:
                os.mkfifo(path, 0o600)
        barrier()                          # the segment and FIFOs exist
        if rank != 0:
            fd = os.open(paths[0], os.O_RDWR)
        # O_RDWR on a FIFO never blocks at open (Linux); each rank holds what it reads and writes
        self._go = [os.open(path, os.O_RDWR) for path in paths[1:1 + world]]
        self._arrive = os.open(paths[-1], os.O_RDWR)
        self._map = mmap.mmap(fd, nbytes)
        os.close(fd)
        barrier()                          # everyone holds everything
        if rank == 0:
            for path in paths:
                path.unlink(missing_ok=True)
        view = np.frombuffer(self._map, dtype=np.float32)
        self.slots = view[:world * size].reshape(world, size)
        self.result = view[world * size:]
        bounds = np.linspace(0, size, world + 1).astype(np.int64)
        self._lo, self._hi = int(bounds[rank]), int(bounds[rank + 1])

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
        return self.result

    def close(self) -> None:
        for fd in (*self._go, self._arrive):
            os.close(fd)
        self.slots = self.result = None
        try:
            self._map.close()
        except BufferError:                # a tensor still shares the sum's pages: the exit unmaps them
            pass
