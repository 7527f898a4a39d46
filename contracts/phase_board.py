"""Where each rank is inside its step, in shared memory: the rank writes, its daemon reads.

Each rank of a generation has one small file under the prefix the daemon hands it (ENV_PHASE_BOARD):
`<prefix>.rank<N>`, mapped into memory. Entering a phase is one `struct.pack_into` on the map (no system
call): the phase, the step it belongs to and when it was entered (time.monotonic: one clock for every
process of the machine). A sequence number, odd while a write is under way, lets the reader take a
whole record without a lock (a seqlock). The daemon reads every rank's record on each tick and so
knows, seconds after a rank stops, which rank is stuck in what while the others wait for it in the
gradient sum (daemon.judging.stall). Stdlib only: the daemon and the ranks share it.
"""
from __future__ import annotations

import dataclasses
import mmap
import os
import struct
import time
from pathlib import Path

# between: the host's work between two steps (events, commands, the next batch's hand-off); data: waiting
# for the input pipeline; compute: the forward and backward graph (with MindSpore's cluster, the gradient sum
# too: it is inside the graph); sum: in the gradient sum across ranks (shared memory, or the hub), waiting
# for the others; update: the optimizer's graph; save: staging a checkpoint; eval: the validation loss
PHASES = ("between", "data", "compute", "sum", "update", "save", "eval", "paused")
_SEQ = struct.Struct("<Q")             # at 0: odd while a write is under way
_RECORD = struct.Struct("<iIqd")        # at 8: phase, pad, step, entered (monotonic seconds)
SLOT_BYTES = 64


def slot_path(prefix: str | Path, rank: int) -> Path:
    return Path(f"{prefix}.rank{rank}")


@dataclasses.dataclass(frozen=True)
class Slot:
    rank: int
    phase: str
    step: int              # the step being worked on (the last one finished + 1), or the last one for `between`
    entered_s: float       # time.monotonic() when the rank entered the phase


class PhaseWriter:
    """A rank's own record: `enter(phase, step)` costs a pack into the map."""

    def __init__(self, prefix: str | Path, rank: int):
        path = slot_path(prefix, rank)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, SLOT_BYTES)
            self._map = mmap.mmap(fd, SLOT_BYTES)
        finally:
            os.close(fd)
        self._seq = 0
        self._codes = {name: i for i, name in enumerate(PHASES)}

    def enter(self, phase: str, step: int) -> None:
        self._seq += 1
        _SEQ.pack_into(self._map, 0, self._seq)             # odd: a write is under way
        _RECORD.pack_into(self._map, 8, self._codes[phase], 0, step, time.monotonic())
        self._seq += 1
        _SEQ.pack_into(self._map, 0, self._seq)             # even: whole

    def close(self) -> None:
        self._map.close()


def read(prefix: str | Path, ranks) -> dict[int, Slot]:
    """Every rank's record that exists and is whole now (a rank that has not written yet has none): its
    sequence number read before and after the record, equal and even (else read again)."""
    out = {}
    for rank in ranks:
        try:
            with open(slot_path(prefix, rank), "rb") as f, mmap.mmap(f.fileno(), SLOT_BYTES,
                                                                     access=mmap.ACCESS_READ) as m:
                for _ in range(100):
                    (before,) = _SEQ.unpack_from(m, 0)
                    code, _, step, entered = _RECORD.unpack_from(m, 8)
                    (after,) = _SEQ.unpack_from(m, 0)
                    if before == after and before and before % 2 == 0:
                        if 0 <= code < len(PHASES):
                            out[rank] = Slot(rank, PHASES[code], step, entered)
                        break
        except (OSError, ValueError):        # not there (yet, or any more), or not mapped to its size
            continue
    return out


def remove(prefix: str | Path, ranks) -> None:
    for rank in ranks:
        try:
            slot_path(prefix, rank).unlink()
        except FileNotFoundError:
            pass
