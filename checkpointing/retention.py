"""Which committed checkpoints to delete, and deleting them.

Owns the retention rule (`select_for_deletion`: pure, no files, tested with
tables) and its one effect (`retire_old`: scan a root, retire what the rule
selects). Who runs it is the caller's choice: the supervisor after each commit
it hears of (it knows which checkpoints its incidents need), or rank 0 of a
`llm-pretrain train` running alone. The writer's commit path never decides.
"""
from __future__ import annotations

from pathlib import Path
from typing import Collection, Sequence

from checkpointing import layout


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


def retire_old(root: str | Path, *, keep_last: int, keep_every: int = 0,
               protected: Collection[int] = (), recycle: bool | Collection[str] = False) -> list[int]:
    """Retires (layout.retire, with `recycle`) every committed checkpoint under `root` that
    select_for_deletion picks; returns their steps, ascending."""
    root = Path(root)
    doomed = select_for_deletion(layout.committed_steps(root), keep_last=keep_last, keep_every=keep_every,
                                 protected=protected)
    for step in doomed:
        layout.retire(root, step, recycle=recycle)
    return doomed
