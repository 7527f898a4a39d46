"""Which rank writes which tensor: disjoint, size-balanced, the same on every rank."""
from __future__ import annotations

import heapq
from typing import Mapping


def assign(sizes_bytes: Mapping[str, int], world: int) -> dict[str, int]:
    """Largest tensor first, each to the rank with the fewest bytes so far (ties: lowest rank).

    Deterministic for given names and sizes, so every rank computes the same plan
    without talking to the others.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    load = [(0, rank) for rank in range(world)]
    heapq.heapify(load)
    plan = {}
    for name in sorted(sizes_bytes, key=lambda n: (-sizes_bytes[n], n)):
        used, rank = heapq.heappop(load)
        plan[name] = rank
        heapq.heappush(load, (used + sizes_bytes[name], rank))
    return plan
