"""The checksums a shard is recorded with: sha256 on disk, CRC32C in the RAM tier.

Owns: the names (a manifest's shard entry carries exactly one of them as a key), the digest of
parts as the writer streams them, and of a file as the reader verifies it. Why two: a disk
checkpoint outlives the run, is copied and exported, and sha256 names its content; a RAM
checkpoint lives a few intervals on this machine's tmpfs, where the checksum only has to catch a
torn or damaged copy, and sha256 alone cost more than the RAM tier's whole budget on tiny's step
(CRC32C is an order of magnitude cheaper, in hardware where the CPU has it; bench/ram_tier.py).
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

import crc32c

SHA256, CRC32C = "sha256", "crc32c"
ALGORITHMS = (SHA256, CRC32C)
_CHUNK = 1 << 22


def require(algorithm: str) -> str:
    """`algorithm` if it is one of ALGORITHMS, else a ValueError naming them."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"checksum {algorithm!r}: one of {', '.join(ALGORITHMS)}")
    return algorithm


def digest(parts: Iterable, algorithm: str) -> str:
    """The checksum of the parts' bytes one after another, as the manifest records it (hex)."""
    running = Running(algorithm)
    running.update_all(parts)
    return running.hexdigest()


class Running:
    """digest() taken as the bytes come (`update` each buffer in order; `hexdigest` at the end)."""

    def __init__(self, algorithm: str):
        self.algorithm = require(algorithm)
        self._sha = hashlib.sha256() if algorithm == SHA256 else None
        self._crc = 0

    def update(self, data) -> None:
        if self._sha is not None:
            self._sha.update(data)
        else:
            self._crc = crc32c.crc32c(data, value=self._crc)

    def update_all(self, parts: Iterable) -> None:
        for part in parts:
            self.update(part)

    def hexdigest(self) -> str:
        return self._sha.hexdigest() if self._sha is not None else f"{self._crc:08x}"


def file_digest(path: Path | str, algorithm: str) -> str:
    """digest() of a file's bytes."""
    with open(path, "rb") as f:
        return digest(iter(lambda: f.read(_CHUNK), b""), algorithm)


def recorded(entry: dict) -> tuple[str, str] | None:
    """(algorithm, value) of a manifest's shard entry, or None where it records none."""
    return next(((a, entry[a]) for a in ALGORITHMS if a in entry), None)
