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


def newest_settled(steps: Sequence[int], *, current_step: int, guard_steps: int) -> set[int]:
    """The newest step at least `guard_steps` behind `current_step` (empty if none): a checkpoint no
    incident detected from now on can make unhealthy, so retention must keep it."""
    settled = [s for s in steps if s <= current_step - guard_steps]
    return {max(settled)} if settled else set()
