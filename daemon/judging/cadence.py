"""How often to checkpoint when `checkpoint.interval_steps = "auto"` (and `memory_interval_steps`, the
RAM tier's): as often as the failure rate says, by Young and Daly's first-order optimum

    interval = sqrt(2 · C · MTBF)

- C, the cost of one save: the seconds it blocks the step (its `staged` event) plus what the steps
  while it is written take beyond the median step (the writer competes for the host), the median of
  the last saves of that tier;
- MTBF, the time between failures: (seconds trained + `checkpoint.auto_mtbf_prior_s`) / (failures +
  1) — the prior counts as one failure's worth of evidence, so the first failures move it gently and
  many replace it; a failure is an incident that lost the work since a checkpoint (a crash, hang, out
  of memory, lost node, restarted straggler) or a rerun;
- in steps: interval / median step time, within [auto_min_interval_steps, auto_max_interval_steps];
  changed only when it moves by more than a tenth (no command per step for noise).

Until a save has been measured the ranks use AUTO_FIRST_STEPS; each generation's commands file starts
with the intervals in force (`interval_args`). Pure: fed events and incidents, it
returns the change to send to the ranks (an `interval` command) and to say (a `checkpoint_interval` event).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any, Mapping

from contracts.config import CheckpointConfig
from contracts.protocol import AUTO_FIRST_STEPS, StepEvent

TIERS = {"disk": "interval_steps", "memory": "memory_interval_steps"}
HYSTERESIS = 0.1


def interval_args(ck: CheckpointConfig, saved: Mapping[str, Any] | None) -> dict[str, int]:
    """The `interval` command's arguments a generation starts with: the automatic tiers' intervals in
    force (state.json's `cadence`); none before the first was decided."""
    saved = saved or {}
    return {key: int(saved[key]) for key in TIERS.values() if getattr(ck, key) == "auto" and saved.get(key)}


class Cadence:
    def __init__(self, ck: CheckpointConfig, saved: Mapping[str, Any] | None = None):
        self.ck = ck
        self.auto = {tier: getattr(ck, key) == "auto" for tier, key in TIERS.items()}
        saved = dict(saved or {})
        self.trained_s = float(saved.get("trained_s", 0.0))
        self.interval = {tier: int(saved.get(key) or AUTO_FIRST_STEPS) for tier, key in TIERS.items()}
        self.costs: dict[str, deque[float]] = {t: deque(saved.get("costs", {}).get(t, ()), maxlen=9) for t in TIERS}
        self.step_s: deque[float] = deque(maxlen=200)
        self._open: dict[tuple[str, int], float] = {}     # (tier, step) being written -> its cost so far

    def to_dict(self) -> dict[str, Any]:
        """What state.json keeps across daemons."""
        return {"trained_s": round(self.trained_s, 3), **{TIERS[t]: self.interval[t] for t in TIERS if self.auto[t]},
                "costs": {t: [round(c, 6) for c in self.costs[t]] for t in TIERS}}

    # What is observed --------------------------------------------------------------------------
    def step(self, ev: StepEvent, compiled: bool) -> None:
        if compiled:                          # a generation's first step: compilation, not a step time
            return
        self.trained_s += ev.step_s
        median = statistics.median(self.step_s) if self.step_s else ev.step_s
        self.step_s.append(ev.step_s)
        for key in self._open:
            self._open[key] += max(0.0, ev.step_s - median)

    def staged(self, tier: str, step: int, seconds: float) -> None:
        """A save of `tier` blocked the step `seconds`; it is written from now on."""
        self._open[(tier, step)] = seconds

    def committed(self, tier: str, step: int) -> None:
        cost = self._open.pop((tier, step), None)
        for key in [k for k in self._open if k[0] == tier and k[1] < step]:
            del self._open[key]              # a save whose commit was never heard of
        if cost is not None:
            self.costs[tier].append(cost)

    # The decision --------------------------------------------------------------------------------
    def mtbf_s(self, failures: int) -> float:
        return (self.trained_s + self.ck.auto_mtbf_prior_s) / (failures + 1)

    def retune(self, failures: int) -> dict[str, Any] | None:
        """The new intervals when one moved by more than HYSTERESIS, with the evidence; else None."""
        if not self.step_s:
            return None
        step_s, mtbf = statistics.median(self.step_s), self.mtbf_s(failures)
        changed, evidence = {}, {}
        for tier, key in TIERS.items():
            if not self.auto[tier] or not self.costs[tier]:
                continue
            cost = statistics.median(self.costs[tier])
            seconds = math.sqrt(2.0 * cost * mtbf)
            steps = min(self.ck.auto_max_interval_steps, max(self.ck.auto_min_interval_steps,
                                                             round(seconds / max(step_s, 1e-9))))
            evidence[tier] = {"cost_s": round(cost, 6), "interval_s": round(seconds, 3), "steps": steps}
            if abs(steps - self.interval[tier]) > HYSTERESIS * self.interval[tier]:
                changed[key] = self.interval[tier] = steps
        if not changed:
            return None
        return {"changed": changed, "mtbf_s": round(mtbf, 3), "failures": failures, "step_s": round(step_s, 6),
                "trained_s": round(self.trained_s, 3), "tiers": evidence}
