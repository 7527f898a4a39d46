"""The straggler detector: which rank the others wait for, from every rank's own step time split.

In synchronous data parallel every rank ends a step together (the gradients' all-reduce), so a
slow rank makes the whole run slow and a global step time names nobody. What differs is where
each rank spends the step: the one that arrives last at the collective waits least inside it.
Each rank reports `sync_s`, its seconds in the compiled graph that holds the step's collectives;
for one step, rank r's lag is max_j sync_j - sync_r (how much later than the most-waiting rank
it arrived). Over a trailing window of steps, a rank whose median lag is at least
`straggler_min_lag_s` and `straggler_min_rel` of the median step period is a straggler; its
relative score is 1 - lag / period (1.0: never waited for; 0.6: the others wait 40 % of each
step for it), in the manner of NVIDIA's resiliency extension. The warning names the rank once;
with `straggler_action = "restart"` (or "exclude": its device or machine quarantined), a rank slow for `straggler_restart_after_s` (summed step
periods) ends the generation (on a cluster its node would be excluded).

What it sees: host-side slowness (input pipeline, CPU contention, a rank's Python) and, with
grad_accum_steps > 1, slow device compute (the micro-batch graphs are local; the collective is
in the finishing graph). With one fused graph per step a rank slow inside the device compute
delays everyone inside the same graph, and shows only as a global slowdown. Pure: step events
in, incidents out; the first step of each rank (compilation) is not counted.
"""
from __future__ import annotations

import statistics
from collections import deque
from typing import Sequence

from contracts.config import HealthConfig
from contracts.protocol import StepEvent
from daemon.judging.incidents import Incident, Kind


class StragglerDetector:
    def __init__(self, cfg: HealthConfig, ranks: Sequence[int]):
        self.cfg, self.ranks = cfg, list(ranks)
        self._pending: dict[int, dict[int, StepEvent]] = {}        # step -> rank -> event
        self._seen: set[int] = set()
        self._lags: deque[dict[int, float]] = deque(maxlen=cfg.straggler_window_steps)
        self._periods: deque[float] = deque(maxlen=cfg.straggler_window_steps)
        self._slow_rank: int | None = None
        self._slow_for_s = 0.0
        self._warned: set[int] = set()
        self._acted = False

    def observe(self, ev: StepEvent) -> list[Incident]:
        if len(self.ranks) < 2:
            return []
        if ev.rank not in self._seen:                               # its first step compiled the graphs
            self._seen.add(ev.rank)
            return []
        step = self._pending.setdefault(ev.step, {})
        step[ev.rank] = ev
        if len(step) < len(self.ranks):
            return []
        del self._pending[ev.step]
        for old in [s for s in self._pending if s < ev.step]:       # steps some rank never reported
            del self._pending[old]
        most = max(e.sync_s for e in step.values())
        self._lags.append({r: most - e.sync_s for r, e in step.items()})
        period = statistics.median(e.host_s + e.step_s - e.data_wait_s for e in step.values())
        self._periods.append(period)
        return self._judge(ev.step, period)

    def scores(self) -> tuple[dict[int, float], dict[int, float], float]:
        """Per rank: median lag (s) and relative score over the window; and the median step period."""
        period = statistics.median(self._periods)
        lags = {r: statistics.median(l.get(r, 0.0) for l in self._lags) for r in self.ranks}
        return lags, {r: round(max(0.0, 1.0 - lag / period), 3) if period > 0 else 1.0
                      for r, lag in lags.items()}, period

    def _judge(self, step: int, period: float) -> list[Incident]:
        if len(self._lags) < self._lags.maxlen:
            return []
        lags, scores, median_period = self.scores()
        slow = [r for r, lag in lags.items()
                if lag >= max(self.cfg.straggler_min_lag_s, self.cfg.straggler_min_rel * median_period)]
        rank = min(slow, key=lambda r: scores[r]) if slow else None
        if rank != self._slow_rank:
            self._slow_rank, self._slow_for_s = rank, 0.0
        if rank is None:
            return []
        self._slow_for_s += period
        evidence = {"rank": rank, "scores": {str(r): s for r, s in scores.items()},
                    "lag_s": round(lags[rank], 4), "step_period_s": round(median_period, 4),
                    "window_steps": self.cfg.straggler_window_steps, "slow_for_s": round(self._slow_for_s, 2),
                    "action": self.cfg.straggler_action}
        detail = (f"rank {rank} is a straggler: the others wait {lags[rank]:.3f} s of each {median_period:.3f} s "
                  f"step for it (score {scores[rank]:.2f})")
        out = []
        if rank not in self._warned:
            self._warned.add(rank)
            out.append(Incident(kind=Kind.STRAGGLER, first_step=step, last_step=step, rank=rank,
                                needs_action=False, detail=detail, evidence=evidence))
        if (self.cfg.straggler_action in ("restart", "exclude") and not self._acted
                and self._slow_for_s >= self.cfg.straggler_restart_after_s):
            self._acted = True
            out.append(Incident(kind=Kind.STRAGGLER, first_step=step, last_step=step, rank=rank,
                                detail=f"{detail}, for {self._slow_for_s:.0f} s", evidence=evidence))
        return out
