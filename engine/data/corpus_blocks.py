"""Per-block CRC32C checksums of a corpus's shards: computed as the shards are written, verified as
the blocks are first read each epoch.

Owns: the block layout (every shard cut into `block_bytes` blocks, the last one short), the
running checksum a writer keeps, and the reader's check of a token range — which blocks it
touches, which of those this epoch has not verified yet, and the error that names the shard,
the block and both checksums when one fails. A whole-corpus sha256 at open reads every byte
before the first step; a block is checked only when training first needs it (CRC32C, in
hardware where the CPU has it, costs little beside the step), so a shard altered while a run trains is caught at the step that reads it.
No MindSpore here.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import crc32c
import numpy as np

from contracts.errors import DataError

DEFAULT_BLOCK_BYTES = 1 << 20
BLOCK_ALIGN = 4096


def check_block_bytes(block_bytes: int) -> int:
    if block_bytes < BLOCK_ALIGN or block_bytes % BLOCK_ALIGN:
        raise DataError(f"--block-bytes = {block_bytes} must be a positive multiple of {BLOCK_ALIGN}")
    return block_bytes


class RunningBlocks:
    """A shard's block checksums while it is written: feed bytes in order, read `crcs` at the end."""

    def __init__(self, block_bytes: int):
        self.block_bytes = block_bytes
        self.crcs: list[int] = []
        self._crc, self._filled = 0, 0

    def update(self, blob: bytes | memoryview) -> None:
        view = memoryview(blob)
        while view.nbytes:
            part = view[: self.block_bytes - self._filled]
            self._crc = crc32c.crc32c(part, value=self._crc)
            self._filled += part.nbytes
            view = view[part.nbytes:]
            if self._filled == self.block_bytes:
                self._flush()

    def _flush(self) -> None:
        self.crcs.append(self._crc)
        self._crc, self._filled = 0, 0

    def finish(self) -> list[int]:
        if self._filled:
            self._flush()
        return self.crcs


@dataclasses.dataclass(frozen=True)
class BadBlock:
    """One block whose bytes no longer match the manifest's checksum."""

    file: str               # the shard's file name in the corpus directory
    block: int              # its index within the shard
    offset: int             # its first byte in the shard
    expected: int
    actual: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class CorruptBlockError(DataError):
    """Blocks of one shard fail their checksums; `bad` lists them all (the whole shard is checked
    once one fails, so one incident quarantines them together)."""

    def __init__(self, path: str, bad: Sequence[BadBlock], corpus_blocks: int):
        self.path, self.bad, self.corpus_blocks = path, tuple(bad), corpus_blocks
        first = self.bad[0]
        more = f" (and {len(self.bad) - 1} more blocks of it)" if len(self.bad) > 1 else ""
        super().__init__(f"corpus {path!r}: shard {first.file} block {first.block} (at byte {first.offset}) "
                         f"fails its CRC32C check: expected {first.expected:08x}, read "
                         f"{first.actual:08x}{more}; the shard was altered or the disk returned bad data")


class BlockVerifier:
    """The reader's side: checks each block of the memory-mapped shards once per epoch."""

    def __init__(self, path: str, files: Sequence[str], maps: Sequence[np.ndarray], offsets: np.ndarray,
                 crcs: Sequence[Sequence[int]], block_bytes: int, itemsize: int):
        self.path, self.files, self.maps, self.offsets = path, list(files), list(maps), offsets
        self.crcs = [list(c) for c in crcs]
        self.block_tokens = block_bytes // itemsize
        self.block_bytes = block_bytes
        self._verified: set[tuple[int, int]] = set()
        for name, shard, c in zip(self.files, self.maps, self.crcs):
            if len(c) != -(-shard.size // self.block_tokens):
                raise DataError(f"corpus {path!r}: shard {name} has {len(c)} block checksums in the manifest "
                                f"but {shard.size} tokens make {-(-shard.size // self.block_tokens)} blocks")

    def new_epoch(self) -> None:
        """Every block is checked again the next time it is read."""
        self._verified.clear()

    def blocks_of(self, start: int, stop: int) -> list[tuple[int, int]]:
        """(shard, block) pairs that tokens [start, stop) of the stream touch."""
        out = []
        shard = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < stop:
            base = int(self.offsets[shard])
            end = min(stop, int(self.offsets[shard + 1]))
            first, last = (start - base) // self.block_tokens, (end - 1 - base) // self.block_tokens
            out.extend((shard, b) for b in range(first, last + 1))
            start, shard = end, shard + 1
        return out

    def _crc(self, shard: int, block: int) -> int:
        data = self.maps[shard][block * self.block_tokens:(block + 1) * self.block_tokens]
        return crc32c.crc32c(memoryview(np.ascontiguousarray(data)).cast("B"))

    def _bad(self, shard: int, block: int) -> BadBlock | None:
        actual = self._crc(shard, block)
        expected = self.crcs[shard][block]
        if actual == expected:
            return None
        return BadBlock(self.files[shard], block, block * self.block_bytes, expected, actual)

    def verify(self, start: int, stop: int) -> None:
        """Raises CorruptBlockError if a block of tokens [start, stop) not yet verified this epoch fails."""
        for key in self.blocks_of(start, stop):
            if key in self._verified:
                continue
            if self._bad(*key) is not None:
                shard = key[0]
                bad = [b for b in (self._bad(shard, i) for i in range(len(self.crcs[shard]))) if b]
                raise CorruptBlockError(self.path, bad, sum(len(c) for c in self.crcs))
            self._verified.add(key)

    def token_range(self, file: str, block: int) -> tuple[int, int]:
        """The stream's tokens [a, b) that block `block` of shard `file` holds."""
        try:
            shard = self.files.index(file)
        except ValueError:
            raise DataError(f"corpus {self.path!r} has no shard {file!r} (a quarantined block names it)") from None
        base = int(self.offsets[shard])
        return (base + block * self.block_tokens,
                min(base + (block + 1) * self.block_tokens, int(self.offsets[shard + 1])))
