"""Detectors that turn the global step stream into incidents and warnings. Pure: no clocks, files
or processes; the caller feeds step events in order.

- loss spike: the loss above median + k·MAD of the `window` steps before it, and at least
  `min_rel` above that median, for `hold` consecutive steps, after `warmup` steps. The baseline
  is frozen when a run of high steps begins, so a spike cannot raise its own baseline; a single
  bursty batch never makes an incident; a slow drift moves the median with it.
- loss collapse: the spike mirrored — the loss below median − k·MAD and at least
  `loss_collapse_min_rel` below the median, held and warmed up alike (a data shard of zeros
  makes the loss fall to nothing: as wrong as a spike, and as silent).
- grad-norm spike: the same statistic on the gradient norm; a warning unless configured to act.
- grad-norm burst: a single step whose gradient norm is `grad_norm_burst_factor` (100) times the
  window's median or more — not sustained, so no spike, but worth a word (a warning, at most one
  per window).
- non-finite: in fp32/bf16 any skipped step; in fp16 an overflow storm — `overflow_storm_steps`
  skipped steps in a row, or a skipped step with the loss scale at its floor.
- throughput regression and stalled loss: warnings, with their evidence.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

from contracts.protocol import StepEvent
from daemon.judging.incidents import Incident, Kind
from daemon.judging.triage import OUTLIER, outliers

MAD_TO_SIGMA = 1.4826   # MAD × this estimates σ for normal noise


class SpikeDetector:
    """median + k·MAD over a trailing window, held for `hold` consecutive steps; with `falling`, the
    mirror image: median − k·MAD, and `min_rel` below the median (a collapse)."""

    def __init__(self, *, window: int, k: float, min_rel: float, hold: int, warmup: int, falling: bool = False):
        self.window, self.k, self.min_rel, self.hold, self.warmup = window, k, min_rel, hold, warmup
        self.falling = falling
        # more than a window is kept, so that after a rollback a full window before it remains
        self.history: deque[tuple[int, float]] = deque(maxlen=4 * window)
        self.run: list[tuple[int, float]] = []          # the current streak of out-of-band steps
        self.baseline: tuple[float, float] | None = None  # (median, sigma) frozen for the streak

    def _stats(self) -> tuple[float, float]:
        values = [v for _, v in list(self.history)[-self.window:]]
        median = statistics.median(values)
        mad = statistics.median(abs(v - median) for v in values) * MAD_TO_SIGMA
        return median, max(mad, 1e-6 * abs(median), 1e-12)

    def observe(self, step: int, value: float) -> dict[str, Any] | None:
        """Returns the evidence of a spike when the streak reaches `hold`, else None."""
        if not math.isfinite(value):
            return None                                     # the non-finite detector's business
        ready = step > self.warmup and len(self.history) >= self.window
        if ready:
            median, sigma = self.baseline or self._stats()
            if self.falling:
                threshold = min(median - self.k * sigma, median * (1 - self.min_rel))
            else:
                threshold = max(median + self.k * sigma, median * (1 + self.min_rel))
            if (value < threshold) if self.falling else (value > threshold):
                if not self.run:
                    self.baseline = (median, sigma)
                self.run.append((step, value))
                if len(self.run) == self.hold:
                    return {"median": median, "sigma": sigma, "threshold": threshold, "k": self.k,
                            "window_steps": self.window, "hold_steps": self.hold,
                            "steps": [s for s, _ in self.run], "values": [v for _, v in self.run],
                            "recent": [v for _, v in list(self.history)[-10:]]}
                return None
            # a step within the band ends the streak; the streak's values never enter the baseline
            self.run, self.baseline = [], None
        self.history.append((step, value))
        return None


    def rewind(self, step: int) -> None:
        """The run resumes after `step`: forget what was observed later (it is being replayed)."""
        kept = [(s, v) for s, v in self.history if s <= step]
        self.history.clear()
        self.history.extend(kept)
        self.run, self.baseline = [], None


class HealthMonitor:
    """All detectors over one run's global step stream (one rank's events suffice: they are global)."""

    def __init__(self, cfg, *, precision: str, loss_scale_min: float = 1.0):
        self.cfg, self.precision, self.loss_scale_min = cfg, precision, loss_scale_min
        self.loss = SpikeDetector(window=cfg.loss_spike_window_steps, k=cfg.loss_spike_mad_k,
                                  min_rel=cfg.loss_spike_min_rel, hold=cfg.loss_spike_hold_steps,
                                  warmup=cfg.loss_spike_warmup_steps)
        self.collapse = SpikeDetector(window=cfg.loss_spike_window_steps, k=cfg.loss_spike_mad_k,
                                      min_rel=cfg.loss_collapse_min_rel, hold=cfg.loss_spike_hold_steps,
                                      warmup=cfg.loss_spike_warmup_steps, falling=True)
        self.grad = SpikeDetector(window=cfg.loss_spike_window_steps, k=cfg.grad_norm_mad_k,
                                  min_rel=cfg.loss_spike_min_rel, hold=cfg.loss_spike_hold_steps,
                                  warmup=cfg.loss_spike_warmup_steps)
        self.skipped_run: list[int] = []
        self.storm_scale: float | None = None
        self.storm_reported = False
        self.throughput: deque[float] = deque(maxlen=cfg.throughput_window_steps)
        self.best_throughput = 0.0
        self.throughput_warned = False
        self.smooth: deque[float] = deque(maxlen=cfg.loss_spike_window_steps)
        self.best_loss = math.inf
        self.best_loss_step = 0
        self.stall_warned = False
        self.ignore_throughput = 0
        self.burst_warned_at = -(1 << 62)
        self.outlier_run: list[tuple[int, tuple[int, ...]]] = []    # (step, outlier ranks), the same ranks in a row

    def rewind(self, step: int) -> None:
        """A new generation resumes after `step`: later observations are replayed, and its first
        steps include compilation (not a throughput regression)."""
        self.loss.rewind(step)
        self.collapse.rewind(step)
        self.grad.rewind(step)
        self.skipped_run, self.storm_scale, self.storm_reported = [], None, False
        self.outlier_run = []
        self.throughput.clear()
        self.ignore_throughput = 2
        self.smooth.clear()

    def observe(self, event: StepEvent) -> list[Incident]:
        step, out = event.step, []
        out += self._non_finite(event)
        if event.skipped:
            return out
        if (ev := self.loss.observe(step, event.loss)) is not None:
            out.append(Incident(kind=Kind.LOSS_SPIKE, first_step=ev["steps"][0], last_step=step, evidence=ev))
        if (ev := self.collapse.observe(step, event.loss)) is not None:
            out.append(Incident(kind=Kind.LOSS_COLLAPSE, first_step=ev["steps"][0], last_step=step, evidence=ev))
        out += self._rank_outlier(event)
        out += self._burst(event)
        if (ev := self.grad.observe(step, event.grad_norm)) is not None:
            out.append(Incident(kind=Kind.GRAD_NORM_SPIKE, needs_action=self.cfg.grad_norm_action == "rollback",
                                first_step=ev["steps"][0], last_step=step, evidence=ev))
        out += self._throughput(event)
        out += self._stall(event)
        return out

    def _rank_outlier(self, event: StepEvent) -> list[Incident]:
        """Data parallel: the same rank's own gradient norm OUTLIER x the others' median (daemon.judging.triage)
        `rank_outlier_steps` steps in a row — a device that adds to its gradients, or data only its share
        holds; the triage tells which."""
        hold = self.cfg.rank_outlier_steps
        ranks = tuple(outliers(event.rank_losses, event.rank_grad_norms)) if hold else ()
        if not ranks or (self.outlier_run and self.outlier_run[0][1] != ranks):
            self.outlier_run = []
        if not ranks:
            return []
        self.outlier_run.append((event.step, ranks))
        if len(self.outlier_run) != hold:
            return []
        norms = list(event.rank_grad_norms or ())
        return [Incident(kind=Kind.RANK_OUTLIER, first_step=self.outlier_run[0][0], last_step=event.step,
                         rank=ranks[0], detail=f"rank(s) {list(ranks)}: own gradient norm {OUTLIER:g}x the others' "
                         f"median or more for {hold} steps", evidence={"ranks": list(ranks), "rank_grad_norms": norms,
                                                                      "hold_steps": hold, "factor": OUTLIER})]

    def _burst(self, event: StepEvent) -> list[Incident]:
        """Before the grad detector takes the step in: its window is the step's baseline."""
        g, factor = self.grad, self.cfg.grad_norm_burst_factor
        if not factor or event.step <= g.warmup or len(g.history) < g.window or not math.isfinite(event.grad_norm):
            return []
        median = statistics.median(v for _, v in list(g.history)[-g.window:])
        if event.grad_norm < factor * median or event.step - self.burst_warned_at < g.window:
            return []
        self.burst_warned_at = event.step
        return [Incident(kind=Kind.GRAD_NORM_BURST, needs_action=False, first_step=event.step, last_step=event.step,
                         evidence={"grad_norm": event.grad_norm, "median": median, "ratio": event.grad_norm / median,
                                   "factor": factor, "window_steps": g.window, "loss": event.loss})]

    def _non_finite(self, event: StepEvent) -> list[Incident]:
        step = event.step
        if not event.skipped:
            self.skipped_run, self.storm_scale = [], None
            return []
        if self.precision != "fp16":
            return [Incident(kind=Kind.NON_FINITE, first_step=step, last_step=step, evidence={
                "loss": event.loss, "grad_norm": event.grad_norm, "precision": self.precision})]
        if not self.skipped_run:
            self.storm_scale, self.storm_reported = event.loss_scale, False
        self.skipped_run.append(step)
        at_floor = event.loss_scale <= self.loss_scale_min
        if self.storm_reported or (len(self.skipped_run) < self.cfg.overflow_storm_steps and not at_floor):
            return []          # the dynamic scaler handles isolated overflows by itself
        self.storm_reported = True
        return [Incident(kind=Kind.OVERFLOW_STORM, first_step=self.skipped_run[0], last_step=step,
                         storm_start_scale=self.storm_scale,
                         evidence={"skipped_in_a_row": len(self.skipped_run), "loss_scale": event.loss_scale,
                                   "at_floor": at_floor})]

    def _throughput(self, event: StepEvent) -> list[Incident]:
        if self.ignore_throughput:
            self.ignore_throughput -= 1
            return []
        self.throughput.append(event.tokens_per_s)
        if len(self.throughput) < self.throughput.maxlen:
            return []
        current = statistics.median(self.throughput)
        self.best_throughput = max(self.best_throughput, current)
        # one ongoing condition, one warning: said when tokens/s falls `throughput_drop` below the best, and
        # again only after it has recovered half of that drop (a rate hovering at the threshold on a busy
        # machine is the same slow-down, not a new one every window)
        if current < (1 - self.cfg.throughput_drop) * self.best_throughput:
            if not self.throughput_warned:
                self.throughput_warned = True
                return [Incident(kind=Kind.THROUGHPUT_REGRESSION, needs_action=False, first_step=event.step,
                                 last_step=event.step, evidence={"tokens_per_s": current, "best_tokens_per_s": self.best_throughput,
                                  "drop": 1 - current / self.best_throughput})]
        elif current >= (1 - self.cfg.throughput_drop / 2) * self.best_throughput:
            self.throughput_warned = False
        return []

    def _stall(self, event: StepEvent) -> list[Incident]:
        self.smooth.append(event.loss)
        if len(self.smooth) < self.smooth.maxlen:
            return []
        level = statistics.median(self.smooth)
        if level < self.best_loss * (1 - self.cfg.loss_stall_min_delta):
            self.best_loss, self.best_loss_step, self.stall_warned = level, event.step, False
        elif event.step - self.best_loss_step >= self.cfg.loss_stall_steps and not self.stall_warned:
            self.stall_warned = True
            return [Incident(kind=Kind.LOSS_STALLED, needs_action=False, first_step=self.best_loss_step,
                             last_step=event.step, evidence={"best_smoothed_loss": self.best_loss, "now": level,
                                                             "steps_without_improvement": event.step - self.best_loss_step})]
        return []
