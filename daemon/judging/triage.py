"""The triage of a rerun: does a numerical incident come back when its steps are run again?

A generation decided as a Rerun (daemon.judging.policy) resumes from the newest healthy checkpoint before the
incident with nothing else changed; `RerunCheck` compares its steps `first_step`..`last_step` with
the first run's (the incident's `observed` evidence: loss, grad norm, skipped per step):

- every compared step the same (bit for bit with `health.rerun_rtol = 0`; within that relative
  tolerance otherwise; a skipped step skipped again) → `deterministic`: the data or the numbers —
  the incident is decided again, on its own row of the policy;
- one differs → `transient`: a fault of the device or the machine that training passed through; the
  rerun's steps stand (no rollback, no skip, no lr cut).

Nothing to compare (the incident came from an older daemon, or the rerun resumed past its steps) is
judged deterministic: the policy of old, never a guess in the run's favour.

A second, rotated rerun (data parallel, a reproduced incident that points at some ranks: `suspects`)
trains each rank on the share of rank + `rotate`: the same ranks stand out again → `device` (the fault
is the rank's: quarantine, daemon.judging.quarantine); otherwise → `data` (it followed the data, or cannot be
told: the incident's own row decides). Pure: no clocks or files.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Mapping, Sequence

from contracts.protocol import StepEvent

VERDICTS = ("transient", "deterministic", "data", "device")     # the last two: a rotated rerun's
OUTLIER = 10.0     # an own gradient norm this many times the others' median marks its rank


def suspects(steps: Sequence[tuple[Sequence[float] | None, Sequence[float] | None]]) -> list[int]:
    """The ranks an incident's steps point at, from each rank's own loss and gradient norm (StepEvent's
    rank_losses, rank_grad_norms): a non-finite own value; failing that, an own gradient norm OUTLIER times
    the median of the others' or more. Empty when the steps carry no per-rank values, or nothing stands out."""
    out: set[int] = set()
    for losses, norms in steps:
        out.update(outliers(losses, norms))
    return sorted(out)


def outliers(losses: Sequence[float] | None, norms: Sequence[float] | None) -> list[int]:
    """One step's suspects (see suspects)."""
    if not losses or not norms:
        return []
    broken = [r for r, (loss, norm) in enumerate(zip(losses, norms)) if not (math.isfinite(loss) and math.isfinite(norm))]
    if broken:
        return broken
    return [r for r, norm in enumerate(norms)
            if len(norms) > 1 and norm >= OUTLIER * max(statistics.median(norms[:r] + norms[r + 1:]), 1e-12)]


def observed_values(ev: StepEvent) -> list:
    """What a rerun compares of a step: [loss, grad norm, skipped]."""
    return [ev.loss, ev.grad_norm, bool(ev.skipped)]


def same_step(first: list, rerun: list, rtol: float) -> bool:
    """The rerun repeated the first run's step: skipped alike, loss and grad norm alike."""
    if bool(first[2]) != bool(rerun[2]):
        return False
    return all(_close(float(a), float(b), rtol) for a, b in zip(first[:2], rerun[:2]))


def _close(a: float, b: float, rtol: float) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return a == b or abs(a - b) <= rtol * max(abs(a), abs(b))


class RerunCheck:
    """The verdict on one rerun, from the watched rank's step events in order."""

    def __init__(self, rerun: Mapping[str, Any], rtol: float):
        self.kind = str(rerun["kind"])
        self.first, self.last = int(rerun["first_step"]), int(rerun["last_step"])
        self.checkpoint_step = int(rerun["checkpoint_step"])
        self.observed = {int(k): list(v) for k, v in (rerun.get("observed") or {}).items()}
        self.suspects = list(rerun.get("suspects") or ())     # the ranks the first run's steps pointed at
        self.rtol = rtol
        self.rotate = int(rerun.get("rotate") or 0)       # the second rerun: the shares rotated by this many ranks
        self.rerun_suspects: set[int] = set()
        self.ranks = 0
        self.compared: list[dict[str, Any]] = []
        self.verdict: str | None = None

    def observe(self, ev: StepEvent) -> str | None:
        """The verdict once this step settles it (None: not yet, or already given)."""
        if self.verdict is not None or ev.step < self.first:
            return None
        if self.rotate:
            return self._rotated(ev)
        if ev.step <= self.last:
            first = self.observed.get(ev.step)
            if first is not None:
                rerun = observed_values(ev)
                self.compared.append({"step": ev.step, "first_run": first, "rerun": rerun})
                if not same_step(first, rerun, self.rtol):
                    self.verdict = "transient"
                    return self.verdict
            if ev.step < self.last:
                return None
        self.verdict = "deterministic"
        return self.verdict

    def _rotated(self, ev: StepEvent) -> str | None:
        """The second rerun, each rank on the share of rank + rotate: the ranks its steps point at now are
        those of the first run -> `device` (the fault stayed with the rank); else `data` (it followed the
        data, or cannot be told: the policy of old)."""
        if ev.step <= self.last:
            self.ranks = max(self.ranks, len(ev.rank_losses or ()))
            now = outliers(ev.rank_losses, ev.rank_grad_norms)
            self.rerun_suspects.update(now)
            self.compared.append({"step": ev.step, "suspects": now})
            if ev.step < self.last:
                return None
        stayed = bool(self.suspects) and self.rerun_suspects == set(self.suspects)
        self.verdict = "device" if stayed else "data"
        return self.verdict

    def evidence(self, generation: int) -> dict[str, Any]:
        out = {"verdict": self.verdict, "kind": self.kind, "first_step": self.first, "last_step": self.last,
               "suspects": self.suspects,
               "rerun_generation": generation, "checkpoint_step": self.checkpoint_step, "rtol": self.rtol,
               "compared": self.compared}
        if self.rotate:
            followed = sorted((s - self.rotate) % self.ranks for s in self.suspects) if self.ranks else []
            out.update(rotate=self.rotate, rerun_suspects=sorted(self.rerun_suspects), if_data=followed)
        return out
