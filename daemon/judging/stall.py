"""A rank stuck inside a step, named in seconds: which rank, in what phase, and who waits for it. Pure.

The ranks say where they are inside each step on their phase board (contracts.phase_board): the data,
the forward and backward graph, the gradient sum, the update, and between steps. When ranks stop
arriving, those that reached the gradient sum wait there for the one that did not: that one — stuck
in another phase of the step (SIGSTOPped, spinning in a kernel, deadlocked in its input) — is the
culprit, the ones in the sum only its victims. A rank is stuck when it has been in one phase of a
step for longer than max(health.stall_floor_s, health.hang_step_multiplier x p99 step time): seconds
once step times are known, where the hang timeout (daemon.judging.hang) waits a minute.

Saving, evaluating and being paused keep their own timeouts (the hang check's), and a rank waiting in
the sum for one of those is not stuck — unless the kernel says that rank's process is stopped. Before this generation has a clean step time (its first step
compiles) nothing is judged here. Ranks that all wait in the sum with no culprit on this machine are
waiting for one elsewhere: that machine's daemon names it; this one says so only after twice the limit.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from contracts.phase_board import Slot

IN_STEP = ("between", "data", "compute", "sum", "update")     # judged by step times
OWN_TIMEOUTS = ("save", "eval", "paused")                      # judged by the hang check's timeouts


@dataclasses.dataclass(frozen=True)
class Stall:
    culprits: tuple[int, ...]      # stuck outside the gradient sum, the longest stuck first; () when elsewhere
    phase: str                     # the first culprit's phase ("sum": every stuck rank waits there)
    step: int
    stuck_s: float                 # how long the first culprit (or the longest waiter) has been in it
    limit_s: float
    waiting: tuple[int, ...]       # ranks blocked in the gradient sum meanwhile

    def describe(self) -> str:
        waiting = f"; rank(s) {list(self.waiting)} wait for it in the gradient sum" if self.waiting else ""
        if not self.culprits:
            return (f"ranks {list(self.waiting)} have waited {self.stuck_s:.1f} s in step {self.step}'s gradient sum "
                    f"for a rank not on this machine (limit {self.limit_s:.1f} s)")
        who = f"rank {self.culprits[0]}" if len(self.culprits) == 1 else f"ranks {list(self.culprits)}"
        return (f"{who} stuck {self.stuck_s:.1f} s in {self.phase} of step {self.step} (limit {self.limit_s:.1f} s)"
                f"{waiting}")


def limit_s(p99_step_s: float | None, *, floor_s: float, multiplier: float) -> float | None:
    """How long a rank may stay in one phase of a step; None while no clean step time is known."""
    return None if p99_step_s is None else max(floor_s, multiplier * p99_step_s)


def judge(slots: Mapping[int, Slot], now: float, *, limit: float | None,
          stopped: frozenset[int] | set[int] = frozenset()) -> Stall | None:
    """The stall among these ranks' records (this machine's live ranks), or None. `stopped`: ranks whose
    process the kernel says is stopped (SIGSTOP, a debugger): stuck in whatever phase they stopped in."""
    if limit is None or not slots:
        return None
    frozen = {r for r in stopped if r in slots and now - slots[r].entered_s > limit}
    if not frozen and any(s.phase in OWN_TIMEOUTS for s in slots.values()):
        return None                       # the others wait for a save, an evaluation or a pause: not stuck
    stuck = {r: s for r, s in slots.items()
             if (s.phase in IN_STEP or r in frozen) and now - s.entered_s > limit}
    culprits = sorted((r for r in stuck if stuck[r].phase != "sum" or r in frozen),
                      key=lambda r: (r not in frozen, stuck[r].entered_s, r))
    if culprits:        # those in the sum wait for them, however recently they got there
        first = stuck[culprits[0]]
        waiting = tuple(sorted(r for r, s in slots.items() if s.phase == "sum" and r not in culprits))
        return Stall(tuple(culprits), first.phase, first.step, round(now - first.entered_s, 2), limit, waiting)
    waiting = tuple(sorted(r for r, s in stuck.items() if s.phase == "sum"))
    if waiting and all(s.phase == "sum" for s in slots.values()):
        longest = min((stuck[r] for r in waiting), key=lambda s: s.entered_s)
        if now - longest.entered_s > 2 * limit:          # its own daemon names the culprit first
            return Stall((), "sum", longest.step, round(now - longest.entered_s, 2), limit, waiting)
    return None
