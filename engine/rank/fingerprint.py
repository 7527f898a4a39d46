"""Replica fingerprints: under data parallelism every replica holds bit-identical weights; a short
digest of them, compared across the replicas, catches one that was corrupted silently (a flipped bit
in memory that no loss or gradient shows).

Owns: the digest. The parameters in the model's order are cut into `GROUPS` contiguous groups; a
group's value is the sum of its elements' bit patterns read as unsigned integers (float32 as uint32,
bf16/fp16 as uint16), modulo 2^64. One flipped bit k anywhere changes its group's value by ±2^k: it
is always seen; the group says roughly where. On the CPU reading a parameter is a view of its live
memory (no copy); the sums are numpy's (tens of milliseconds for 20M parameters).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

GROUPS = 8
_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def group_bounds(count: int, groups: int = GROUPS) -> list[tuple[int, int]]:
    """[start, end) of each group over `count` parameters (fewer groups than parameters never empty)."""
    groups = max(1, min(groups, count))
    edges = [round(i * count / groups) for i in range(groups + 1)]
    return list(zip(edges[:-1], edges[1:]))


def word_sum(array: np.ndarray) -> int:
    """The sum of the array's elements' bit patterns as unsigned words, modulo 2^64."""
    flat = np.ascontiguousarray(array).reshape(-1)
    words = flat.view(_WORDS[flat.dtype.itemsize])
    return int(words.sum(dtype=np.uint64))


def fingerprint(arrays: Sequence[np.ndarray], groups: int = GROUPS) -> list[int]:
    """One value per group of parameters (see the module's docstring)."""
    out = []
    for start, end in group_bounds(len(arrays), groups):
        total = 0
        for a in arrays[start:end]:
            total = (total + word_sum(a)) & 0xFFFFFFFFFFFFFFFF
        out.append(total)
    return out


def flip_bit(array: np.ndarray, index: int = 0, bit: int = 10) -> np.ndarray:
    """A copy of `array` with bit `bit` of its element `index` flipped (a mantissa bit by default: the
    value moves by about 2^-13 of itself — a silent corruption)."""
    out = np.array(array, copy=True)
    flat = out.reshape(-1).view(_WORDS[out.dtype.itemsize])
    flat[index] ^= flat.dtype.type(1 << bit)
    return out
