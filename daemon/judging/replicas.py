"""Replica fingerprints compared: data-parallel replicas hold bit-identical weights, so their digests
(engine.rank.fingerprint, every health.fingerprint_interval_steps) are equal; one that differs was
corrupted silently. Pure: fed the ranks' fingerprint events, returns an incident when they disagree.

The ranks compared are those this daemon watches (on several machines: its own machine's replicas).
With three or more, the odd ones out are named; with two, which one is corrupt cannot be told.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

from contracts.protocol import FingerprintEvent
from daemon.judging.incidents import Incident, Kind


class ReplicaCheck:
    def __init__(self, ranks: Sequence[int]):
        self.ranks = list(ranks)
        self.agreed_step: int | None = None      # the last step all replicas agreed at (None: none seen yet)
        self._pending: dict[int, dict[int, FingerprintEvent]] = {}

    def started_at(self, resume_step: int) -> None:
        """The generation resumed from `resume_step`: its replicas were loaded from one checkpoint."""
        if self.agreed_step is None:
            self.agreed_step = resume_step

    def observe(self, ev: FingerprintEvent) -> Incident | None:
        if len(self.ranks) < 2 or ev.rank not in self.ranks:
            return None
        seen = self._pending.setdefault(ev.step, {})
        seen[ev.rank] = ev
        if len(seen) < len(self.ranks):
            return None
        del self._pending[ev.step]
        for step in [s for s in self._pending if s < ev.step]:      # a lost datagram: never complete
            del self._pending[step]
        values = {r: tuple(e.groups) for r, e in seen.items()}
        if len(set(values.values())) == 1:
            self.agreed_step = ev.step
            return None
        return self._mismatch(ev.step, seen, values)

    def _mismatch(self, step: int, seen: dict[int, FingerprintEvent], values: dict[int, tuple]) -> Incident:
        common, count = Counter(values.values()).most_common(1)[0]
        tie = list(Counter(values.values()).values()).count(count) > 1
        odd = sorted(seen) if tie else sorted(r for r, v in values.items() if v != common)
        names = next(iter(seen.values())).names
        groups = sorted({i for r in odd for i, (a, b) in enumerate(zip(values[r], common)) if a != b}
                        if not tie else {i for i in range(len(common)) if len({v[i] for v in values.values()}) > 1})
        agreed = self.agreed_step or 0
        who = (f"rank {odd[0]}" if len(odd) == 1 else "ranks " + ", ".join(map(str, odd))) + \
            (" (two replicas disagree: which one is corrupt cannot be told)" if tie else "")
        return Incident(kind=Kind.REPLICA_MISMATCH, first_step=agreed + 1, last_step=step,
                        rank=odd[0] if len(odd) == 1 else None,
                        detail=f"the replicas' weights differ at step {step}: {who}, in parameter group(s) "
                               f"{', '.join(names[i] + '…' for i in groups)}; they last agreed at step {agreed}",
                        evidence={"step": step, "last_agreed_step": agreed, "odd_ranks": odd, "tie": tie,
                                  "groups": groups, "group_names": [names[i] for i in groups],
                                  "fingerprints": {str(r): list(v) for r, v in values.items()}})
