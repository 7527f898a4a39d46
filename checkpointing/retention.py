"""Which committed checkpoints to delete: pure, no files."""
from __future__ import annotations

from typing import Collection, Sequence


def select_for_deletion(steps: Sequence[int], *, keep_last: int, keep_every: int = 0,
                        protected: Collection[int] = ()) -> list[int]:
    """Keeps the newest `keep_last`, every step divisible by `keep_every` (> 0), and every protected step."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    ordered = sorted(set(steps))
    keep = set(ordered[-keep_last:]) | set(protected)
    if keep_every > 0:
        keep |= {s for s in ordered if s % keep_every == 0}
    return [s for s in ordered if s not in keep]
