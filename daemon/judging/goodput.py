"""The goodput ledger: the run's wall-clock time by cause, and the share of it that was productive.

Owns the accounting, pure (no clock, files or processes: every input carries its `now`, in unix
seconds, and the tests feed literal times). The daemon (daemon.records.ledger) feeds it what it
already sees; the ledger is kept in state.json and in `goodput` events, so a later daemon — or the
rebuild from the event log — continues it.

How the time is split. The ledger has settled the run's time up to `at_unix_s`; each input settles
the interval since then:

- what the ranks measured and said — a step's `step_s` (less its `data_wait_s`) with the loop's own
  work since the step before (`loop_s`: sending events, reading commands), its data wait, the RAM
  tier's saves since the step before, a disk checkpoint's `staged` (and `waited`) seconds, a validation's seconds —
  is a *claim* on that interval, credited to
  its cause (claims beyond the interval wait for the next one: the sum is always the wall time). While
  training, up to SLACK_S of time no claim has taken yet is held (`slack`) before it is called `other`:
  the ranks' events reach the daemon a tick late, several at a time, and their claims take it then;
- the rest goes to the cause of the daemon's *mode*: `other` while training (time between steps no
  rank accounted for), `start` (a generation opened, its processes starting), `restore`, `compile`
  (to the end of the generation's first step, which compiles), `teardown` (from a generation's end
  — the last step before a crash or hang, the decision, the backoff — to the next one's opening),
  `paused`, `waiting_for_machines`. A generation's time after its last step (a crash's detection, a
  hang's timeout, the last save) is teardown too.

A step is *productive* the first time its number is trained; a step at or below the highest step
trained before (after a rollback, a rerun, a restart from an older checkpoint) is `retrained`. The
time a daemon was not running is `daemon_down` when it died without saying so (kill -9, a lost
machine); after a daemon that exited (stopped, finished) the time until the next one is no part of
the run's wall time.

goodput = productive seconds / the wall seconds accounted (every cause, productive included).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

RESTART = ("teardown", "start", "restore", "compile")    # what a restart costs, in order
CAUSES = (*RESTART, "retrained", "checkpoint", "data_wait", "validation", "paused", "waiting_for_machines",
          "daemon_down", "other")
CLAIMED = ("productive", "retrained", "checkpoint", "data_wait", "validation")   # measured by the ranks
SLACK_S = 2.0          # unclaimed training time held for late claims before it is `other`
MODES = {"start": "start", "restore": "restore", "compile": "compile", "training": "other", "teardown": "teardown",
         "paused": "paused", "waiting": "waiting_for_machines"}      # mode -> where its unclaimed time goes


@dataclasses.dataclass
class Goodput:
    productive_s: float = 0.0
    badput_s: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    high_step: int = 0                 # the highest step trained so far: at or below it, a step is trained again
    steps: int = 0                     # first-time steps
    retrained_steps: int = 0
    mode: str = "start"
    stepping: bool = False             # the current generation has made its first (compiling) step
    at_unix_s: float | None = None     # settled up to here (None: the run has not begun)
    pending: dict[str, float] = dataclasses.field(default_factory=dict)   # claims not yet settled
    slack_s: float = 0.0               # settled time no claim has taken yet (training: up to SLACK_S)

    # What the daemon sees ---------------------------------------------------------------------------
    def resume(self, now: float, *, ended: bool) -> float:
        """A daemon takes the run over. `ended`: the last one said it exited (its status was final); else
        it died and the time since the ledger was last settled is `daemon_down`. Returns that time."""
        down = 0.0
        if self.at_unix_s is not None and not ended:
            down = max(0.0, now - self.at_unix_s)
            self.badput_s["daemon_down"] += down
        self.at_unix_s, self.mode, self.stepping, self.pending = now, "start", False, {}
        self._credit("other", self.slack_s)      # held for claims that will not come now
        self.slack_s = 0.0
        return down

    def open_generation(self, now: float) -> None:
        self._enter("start", now)
        self.stepping = False

    def phase(self, phase: str, now: float) -> None:
        """The watched rank entered `phase`: restore or compile (others change nothing here)."""
        if phase in ("restore", "compile") and not self.stepping:
            self._enter(phase, now)

    def step(self, now: float, *, step: int, step_s: float, data_wait_s: float, loop_s: float = 0.0,
             memory_save_s: float = 0.0) -> None:
        """A step of the watched rank. The generation's first step compiles: its time is `compile`.
        `loop_s`: the loop's own work since the step before (it goes with this step: productive or
        retrained); `memory_save_s`: the RAM tier's saves since then (checkpoint)."""
        new = step > self.high_step
        self.high_step = max(self.high_step, step)
        if not self.stepping:
            self.settle(now)                          # to the compile (or whatever mode came before it)
            self.mode, self.stepping = "training", True
            self.steps += new
            self.retrained_steps += not new
            return
        if self.mode not in ("training", "paused"):
            self._enter("training", now)
        if new:
            self.steps += 1
            self._claim("productive", max(0.0, step_s - data_wait_s) + max(0.0, loop_s))
            self._claim("data_wait", max(0.0, data_wait_s))
        else:
            self.retrained_steps += 1
            self._claim("retrained", max(0.0, step_s) + max(0.0, loop_s))
        self._claim("checkpoint", max(0.0, memory_save_s))
        self.settle(now)

    def claim(self, cause: str, seconds: float, now: float) -> None:
        """A rank said `seconds` went to `cause`: checkpoint (a save's staging) or validation."""
        self._claim(cause, max(0.0, seconds))
        self.settle(now)

    def status(self, status: str, now: float) -> None:
        """The run's status changed: paused, or running again (after a pause or a wait); any other status
        settles the ledger to `now` (the daemon saves it with the status)."""
        self.settle(now)
        if status == "paused":
            self._enter("paused", now)
        elif status == "running" and self.mode in ("paused", "waiting"):
            self._enter("training" if self.stepping else "start", now)

    def waiting(self, now: float) -> None:
        """The daemon waits for machines (several machines: a decider, the others to join)."""
        self._enter("waiting", now)

    def generation_over(self, now: float) -> None:
        """A generation ended (finished, stopped, failed): teardown, from its last step (what came after it —
        a crash's detection, a hang's timeout, the last save — and what follows until the next one opens)."""
        self._flush()
        self.mode, self.stepping = "teardown", False
        self.settle(now)

    # The accounting -------------------------------------------------------------------------------------
    def _claim(self, cause: str, seconds: float) -> None:
        self.pending[cause] = self.pending.get(cause, 0.0) + seconds

    def _enter(self, mode: str, now: float) -> None:
        self.settle(now)
        if self.mode == "training" and mode != "training":
            self._flush()
        self.mode = mode

    def _flush(self) -> None:
        """Training is over for now: the time held for late claims is `other`."""
        self._credit("other", self.slack_s)
        self.slack_s = 0.0

    def settle(self, now: float) -> None:
        """Accounts the time from `at_unix_s` to `now` (with the slack held before): the claims first (scaled
        down to fit, the rest left pending), what is left to the mode's cause — while training, beyond SLACK_S."""
        if self.at_unix_s is None:
            self.at_unix_s = now
            return
        self.slack_s += max(0.0, now - self.at_unix_s)
        self.at_unix_s = max(self.at_unix_s, now)
        claimed = sum(self.pending.values())
        share = 1.0 if claimed <= self.slack_s else self.slack_s / claimed
        for cause, seconds in list(self.pending.items()):
            self._credit(cause, seconds * share)
            left = seconds * (1.0 - share)
            if left > 1e-9:
                self.pending[cause] = left
            else:
                del self.pending[cause]
        self.slack_s = max(0.0, self.slack_s - claimed * share)
        kept = SLACK_S if self.mode == "training" else 0.0
        if self.slack_s > kept:
            self._credit(MODES[self.mode], self.slack_s - kept)
            self.slack_s = kept

    def _credit(self, cause: str, seconds: float) -> None:
        if cause == "productive":
            self.productive_s += seconds
        else:
            self.badput_s[cause] = self.badput_s.get(cause, 0.0) + seconds

    # What it says -----------------------------------------------------------------------------------------
    @property
    def wall_s(self) -> float:
        """The run's time settled so far: every cause, productive included, and the slack not yet given one."""
        return self.productive_s + sum(self.badput_s.values()) + self.slack_s

    @property
    def ratio(self) -> float | None:
        """Productive seconds over the wall seconds accounted; None before any time is."""
        wall = self.wall_s
        return self.productive_s / wall if wall > 0 else None

    def restart_s(self) -> float:
        return sum(self.badput_s.get(c, 0.0) for c in RESTART)

    def largest_losses(self, n: int = 3) -> list[tuple[str, float]]:
        """The `n` causes that cost the most, largest first (none that cost nothing)."""
        ranked = sorted(((c, s) for c, s in self.badput_s.items() if s > 0), key=lambda x: -x[1])
        return ranked[:n]

    def to_dict(self) -> dict[str, Any]:
        return {"productive_s": round(self.productive_s, 3),
                "badput_s": {c: round(s, 3) for c, s in self.badput_s.items()},
                "high_step": self.high_step, "steps": self.steps, "retrained_steps": self.retrained_steps,
                "mode": self.mode, "stepping": self.stepping, "at_unix_s": self.at_unix_s,
                "pending": {c: round(s, 3) for c, s in self.pending.items()}, "slack_s": round(self.slack_s, 3),
                "wall_s": round(self.wall_s, 3), "ratio": None if self.ratio is None else round(self.ratio, 4)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Goodput":
        """What to_dict wrote (state.json's `goodput`, a `goodput` event); {} is a new ledger. Unknown or
        malformed fields are passed over: a ledger never stops a daemon from starting."""
        g = cls()
        if not data:
            return g
        g.productive_s = _seconds(data.get("productive_s"))
        badput = data.get("badput_s") if isinstance(data.get("badput_s"), Mapping) else {}
        g.badput_s.update({str(c): _seconds(s) for c, s in badput.items()})
        g.high_step = _count(data.get("high_step"))
        g.steps, g.retrained_steps = _count(data.get("steps")), _count(data.get("retrained_steps"))
        g.mode = data.get("mode") if data.get("mode") in MODES else "start"
        g.stepping = data.get("stepping") is True
        at = data.get("at_unix_s")
        g.at_unix_s = float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else None
        pending = data.get("pending") if isinstance(data.get("pending"), Mapping) else {}
        g.pending = {str(c): _seconds(s) for c, s in pending.items() if c in CLAIMED}
        g.slack_s = _seconds(data.get("slack_s"))
        return g


def _seconds(value: Any) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value >= 0
    return float(value) if ok else 0.0


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0
