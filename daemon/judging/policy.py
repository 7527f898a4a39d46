"""The recovery policy: a pure function from (incident, run history, config) to an action.

The recovery ladder:
- crash, hang, a straggler set to act on: restart from the latest committed checkpoint; after
  `max_restarts_without_progress` restarts without a new checkpoint, give up (exit 3);
- loss spike or collapse (and grad-norm spike when set to act), non-finite in fp32/bf16: roll back to the
  newest healthy checkpoint before the incident began, skip the sample window the incident's
  steps consumed, and cut the lr (× lr_cut_factor, held, then ramped back); a recurrence within
  `recur_window_steps` compounds the cut; below `lr_floor_factor`, give up (exit 4);
- fp16 overflow storm: roll back and restart at a lower loss scale (the storm's starting scale ×
  loss_scale_cut, compounding likewise) with its growth capped for a while; below the scale floor,
  handle it as a non-finite incident of fp32;
- out of memory: restart with recompute on; if it already is, halve the micro-batch and double
  accumulation (the global batch stays); with nothing smaller to try, give up (exit 3);
- replica mismatch (the data-parallel replicas' fingerprints differ: a weight corrupted silently): roll
  back to the newest checkpoint at or before the last step they all agreed at; nothing skipped, no lr
  cut (neither the data nor the numbers were at fault); the odd replica's device quarantined when it can
  be told (three or more replicas);
- a straggler with `straggler_action = "exclude"`: its device (several machines: its machine) quarantined,
  restart from the latest committed checkpoint;
- corrupt data (corpus blocks failing their checksums, found before training on them): resume
  from the newest healthy checkpoint before that step with the blocks quarantined (their samples
  are passed over); beyond `max_quarantined_fraction` of the corpus, give up (exit 65).
Before any of the numerical rows (spike, collapse, grad-norm spike acted on, non-finite) — with
`health.rerun` — the incident's steps are re-run first from the newest healthy checkpoint before them,
nothing else changed (a Rerun): the watch of that generation compares the rerun with the first run.
Reproduced, the incident comes back with its `triage` evidence and its row decides; not reproduced,
it was transient and training goes on from the rerun. Reproduced under data parallel with the incident
pointing at some ranks (daemon.judging.triage.suspects), a second rerun rotates the shares across the replicas:
the fault follows the data -> its row decides; it stays with the rank -> a device fault: the device
(several machines: its machine) is quarantined (daemon.judging.quarantine) and the run rolls back to the newest
healthy checkpoint before it, nothing skipped, no lr cut. An incident at a step a rerun already found
transient is not re-run again (a fault that comes back where a rerun passed is no passing fault).
Warnings are recorded, never decided on. Checkpoint health is derived from the incident log, never stamped.
Also: merging a rollback into the recovery directive in force. No clocks, files or processes here.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from contracts.config import HealthConfig, TrainConfig
from contracts.protocol import ExitCode, LrOverride, RecoveryDirective
from daemon.judging.incidents import Action, Halt, Incident, Kind, Rerun, Restart, Rollback

NUMERIC = (Kind.LOSS_SPIKE, Kind.LOSS_COLLAPSE, Kind.GRAD_NORM_SPIKE, Kind.NON_FINITE, Kind.RANK_OUTLIER)


@dataclasses.dataclass(frozen=True)
class RunHistory:
    """What the policy may look at: facts the supervisor keeps in state.json."""

    incidents: Sequence[Incident] = ()            # earlier incidents that were rolled back
    committed_steps: Sequence[int] = ()           # committed checkpoints
    restarts_without_progress: int = 0            # counting the incident being decided
    sample_ranges: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)  # step -> [a, b)
    quarantined: Sequence[tuple[str, int]] = ()   # corpus blocks quarantined so far
    transient_steps: Sequence[int] = ()           # first steps of incidents a rerun found transient
    memory_steps: Sequence[int] = ()              # the RAM tier's committed checkpoints (one machine's): a rerun's
                                                  # or rollback's nearest start
    script: bool = False                          # the ranks run a user's script (config [script]) ...
    can_skip: bool = True                         # ... which can skip a data window (its client reports skip_data)


def is_healthy(step: int, incidents: Sequence[Incident], margin: int) -> bool:
    """A checkpoint is unhealthy if its step lies inside an incident or within `margin` before its start."""
    return not any(i.first_step - margin <= step <= i.last_step for i in incidents if i.kind.taints_checkpoints)


def newest_healthy(committed: Sequence[int], incidents: Sequence[Incident], margin: int,
                   before_step: int | None = None) -> int:
    """The newest healthy committed step (below `before_step` if given); 0 when none (start over)."""
    healthy = [s for s in committed if is_healthy(s, incidents, margin) and (before_step is None or s < before_step)]
    return max(healthy, default=0)


def _recurrences(kinds: Sequence[Kind], incident: Incident, history: RunHistory, window: int) -> int:
    # absolute distance: after a rollback the run replays steps, so a recurrence may start earlier
    return sum(1 for h in history.incidents
               if h.kind in kinds and abs(incident.first_step - h.first_step) <= window)


def decide(incident: Incident, history: RunHistory, h: HealthConfig, train: TrainConfig) -> Action:
    """The action for an incident that needs one (warnings never come here): its kind's row of RULES."""
    rule = RULES.get(incident.kind)
    if rule is None:
        raise ValueError(f"no policy for incident kind {incident.kind.value!r}")
    return rule(incident, history, h, train)


def _restart(incident: Incident, history: RunHistory, h: HealthConfig, train: TrainConfig) -> Action:
    """A process fault: restart from the latest committed checkpoint, until restarts stop making progress."""
    if history.restarts_without_progress >= h.max_restarts_without_progress:
        return Halt(f"{history.restarts_without_progress} restarts without a new checkpoint",
                    ExitCode.GAVE_UP_CRASH_LOOP)
    if incident.kind is Kind.STRAGGLER and h.straggler_action == "exclude" and incident.rank is not None:
        return Rollback(f"straggler: rank {incident.rank}'s device (several machines: its machine) quarantined for "
                        f"{h.quarantine_probation_s:g} s; restart from the latest committed checkpoint",
                        checkpoint_step=max(_every_checkpoint(history), default=0), skip=None, lr_overrides=(),
                        exclude=(incident.rank,), exclude_for_s=h.quarantine_probation_s)
    return Restart(f"{incident.kind.value}: restart from the latest committed checkpoint")


def _every_checkpoint(history: RunHistory) -> list[int]:
    """Both tiers' committed steps: the ranks resume from the newest left after a rollback's renames, either."""
    return sorted({*history.committed_steps, *history.memory_steps})


def _rollback_target(incident: Incident, history: RunHistory, h: HealthConfig) -> int:
    """The newest healthy checkpoint (either tier) before the incident began (and before its margin)."""
    return newest_healthy(_every_checkpoint(history), [*history.incidents, incident], h.rollback_margin_steps,
                          before_step=incident.first_step - h.rollback_margin_steps)


def _numeric(incident: Incident, history: RunHistory, h: HealthConfig, train: TrainConfig) -> Action:
    triage = incident.evidence.get("triage") or {}
    if triage.get("verdict") == "device":
        return _exclude(incident, history, h, tuple(triage.get("suspects") or ()),
                        f"{incident.kind.value}: a device fault — rotated across the replicas, the fault stayed on "
                        f"rank(s) {list(triage.get('suspects') or ())}, not with the data")
    if h.rerun and not triage and incident.first_step not in history.transient_steps:
        return _rerun(incident, history, h)
    if h.rerun and triage.get("verdict") == "deterministic" and not triage.get("rotate") and _rotatable(incident):
        return _rerun(incident, history, h, rotate=1)
    return _cut_lr(incident.kind, incident, history, h, _rollback_target(incident, history, h))


def _rotatable(incident: Incident) -> bool:
    """Data parallel, and the incident's steps point at some ranks but not all: rotating the shares tells
    whether its fault follows the data or stays with the rank."""
    ranks, suspects = int(incident.evidence.get("ranks") or 1), incident.evidence.get("suspects") or ()
    return ranks >= 2 and 0 < len(suspects) < ranks


def _rerun(incident: Incident, history: RunHistory, h: HealthConfig, rotate: int = 0) -> Rerun:
    """The incident's steps again from the newest healthy checkpoint before them: data or device? (rotate:
    the second rerun, each rank on another's share: the data or this device?)"""
    target = newest_healthy(_every_checkpoint(history), history.incidents, h.rollback_margin_steps, before_step=incident.first_step)
    first, last = incident.first_step, incident.last_step
    span = f"step {first}" if first == last else f"steps {first}-{last}"
    why = (f"reproduced; rerun {span} from step {target} with the replicas' shares rotated by {rotate} to tell the "
           "data from the device") if rotate else f"rerun {span} from step {target} to tell the data from the device"
    return Rerun(f"{incident.kind.value}: {why}", checkpoint_step=target, first_step=first, last_step=last,
                 rotate=rotate)


def _exclude(incident: Incident, history: RunHistory, h: HealthConfig, ranks: tuple[int, ...], why: str) -> Action:
    """A faulty device (machine): left out for health.quarantine_probation_s, the run back at the newest
    healthy checkpoint before the fault; nothing skipped, no lr cut (the data and the numbers were right)."""
    target = _rollback_target(incident, history, h)
    return Rollback(f"{why}: quarantined for {h.quarantine_probation_s:g} s, roll back to step {target}",
                    checkpoint_step=target, skip=None, lr_overrides=(), exclude=ranks,
                    exclude_for_s=h.quarantine_probation_s)


def _overflow_storm(incident: Incident, history: RunHistory, h: HealthConfig, train: TrainConfig) -> Action:
    """fp16: a lower loss scale, growth capped; with no scale left to lower, fp32's non-finite handling."""
    target = _rollback_target(incident, history, h)
    n = _recurrences((Kind.OVERFLOW_STORM,), incident, history, h.recur_window_steps) + 1
    start_scale = incident.storm_start_scale or train.loss_scale_init
    scale = start_scale * h.loss_scale_cut ** n
    if scale >= train.loss_scale_min:
        return Rollback(f"fp16 overflow storm #{n}: loss scale {start_scale:g} -> {scale:g}, growth capped",
                        checkpoint_step=target, skip=None, lr_overrides=(), loss_scale=scale,
                        loss_scale_cap_until_step=target + h.loss_scale_cap_steps)
    return _cut_lr(Kind.NON_FINITE, incident, history, h, target)


def _smaller(incident: Incident, history: RunHistory, h: HealthConfig, train: TrainConfig) -> Action:
    """Out of memory: recompute on, then half the micro-batch at twice the accumulation. A script's batch and
    recompute are its own: it is restarted as it is (the crash loop's limit ends a run that keeps running out)."""
    if history.script:
        return Restart("out of memory in the script (its batch and recompute are its own: restarted as it is)")
    if not train.recompute:
        return Restart("out of memory: recompute on", {"train.recompute": True})
    if train.micro_batch > 1 and train.micro_batch % 2 == 0:
        micro, accum = train.micro_batch // 2, train.grad_accum_steps * 2
        return Restart(f"out of memory with recompute on: micro-batch {train.micro_batch} -> {micro}, "
                       f"accumulation {train.grad_accum_steps} -> {accum}",
                       {"train.micro_batch": micro, "train.grad_accum_steps": accum})
    return Halt(f"out of memory at micro-batch {train.micro_batch} with recompute on: nothing smaller fits",
                ExitCode.GAVE_UP_CRASH_LOOP)


def _quarantine(incident: Incident, history: RunHistory, h: HealthConfig, train: TrainConfig) -> Action:
    bad = tuple((str(b["file"]), int(b["block"])) for b in incident.evidence.get("blocks", ()))
    every = sorted({*history.quarantined, *bad})
    total = int(incident.evidence.get("corpus_blocks") or 0)
    fraction = len(every) / total if total else 1.0
    if fraction > h.max_quarantined_fraction:
        return Halt(f"{len(every)} of {total} corpus blocks fail their checksums ({fraction:.1%} > "
                    f"health.max_quarantined_fraction = {h.max_quarantined_fraction:g}): the copy or the disk is "
                    "bad; check it and prepare the corpus again", ExitCode.DATA_ERROR)
    target = newest_healthy(_every_checkpoint(history), history.incidents, h.rollback_margin_steps,
                            before_step=incident.first_step)
    return Rollback(f"corrupt data: quarantine {len(bad)} block(s) ({len(every)} of {total} in all), resume from "
                    f"step {target}", checkpoint_step=target, skip=None, lr_overrides=(), quarantine=bad)


def _replicas(incident: Incident, history: RunHistory, h: HealthConfig, train: TrainConfig) -> Action:
    agreed = int(incident.evidence.get("last_agreed_step", incident.first_step - 1))
    target = newest_healthy(_every_checkpoint(history), history.incidents, h.rollback_margin_steps,
                            before_step=agreed + 1)
    odd = () if incident.evidence.get("tie") else tuple(int(r) for r in incident.evidence.get("odd_ranks") or ())
    held = f"; rank(s) {list(odd)}' device quarantined for {h.quarantine_probation_s:g} s" if odd else ""
    return Rollback(f"replica mismatch at step {incident.last_step}: roll back to step {target}, at or before step "
                    f"{agreed} where every replica agreed{held}", checkpoint_step=target, skip=None, lr_overrides=(),
                    exclude=odd, exclude_for_s=h.quarantine_probation_s if odd else 0.0)


def _cut_lr(kind: Kind, incident: Incident, history: RunHistory, h: HealthConfig, target: int) -> Action:
    n = _recurrences(NUMERIC, incident, history, h.recur_window_steps) + 1
    factor = h.lr_cut_factor ** n
    if factor < h.lr_floor_factor:
        return Halt(f"{kind.value} #{n} within {h.recur_window_steps} steps: an lr cut to x{factor:g} would pass "
                    f"the floor x{h.lr_floor_factor:g}", ExitCode.GAVE_UP_NUMERICS)
    first, last = incident.first_step, incident.last_step
    seen = [r for step, r in history.sample_ranges.items() if first <= step <= last]
    skip = (min(a for a, _ in seen), max(b for _, b in seen)) if seen and history.can_skip else None
    override = LrOverride(start_step=target + 1, factor=factor, hold_steps=h.lr_hold_steps,
                          ramp_steps=h.lr_ramp_steps)
    skipped = f"skip samples {skip}" if history.can_skip else "the window trained again (the script cannot skip data)"
    return Rollback(f"{kind.value} #{n}: roll back to step {target}, {skipped}, lr x{factor:g}",
                    checkpoint_step=target, skip=skip, lr_overrides=(override,))


Rule = Callable[[Incident, RunHistory, HealthConfig, TrainConfig], Action]

# The policy's table: what is done for each kind of incident that is acted on. A new detector adds a row;
# a kind without one (the warnings) is never decided on.
RULES: dict[Kind, Rule] = {
    Kind.CRASH: _restart, Kind.HANG: _restart, Kind.STRAGGLER: _restart, Kind.NODE_LOST: _restart,
    Kind.OOM: _smaller,
    Kind.DATA_CORRUPT: _quarantine,
    Kind.REPLICA_MISMATCH: _replicas,
    Kind.OVERFLOW_STORM: _overflow_storm,
    Kind.LOSS_SPIKE: _numeric, Kind.LOSS_COLLAPSE: _numeric, Kind.GRAD_NORM_SPIKE: _numeric, Kind.NON_FINITE: _numeric,
    Kind.RANK_OUTLIER: _numeric,
}


def merge_recovery(previous: RecoveryDirective | None, rollback: Rollback) -> RecoveryDirective:
    """The directive after `rollback`: skip ranges accumulate; the lr override list is the policy's
    (it compounds earlier cuts) or, when it decided none (an fp16 storm), the one in force; a new
    loss scale cap replaces the old, else the old one carries on."""
    skips = list(previous.skip_ranges) if previous else []
    if rollback.skip:
        skips.append(tuple(rollback.skip))
    lr = tuple(rollback.lr_overrides) or (previous.lr_overrides if previous else ())
    if rollback.loss_scale is not None:
        cap, until = rollback.loss_scale, rollback.loss_scale_cap_until_step or 0
    elif previous is not None:
        cap, until = previous.loss_scale_cap, previous.loss_scale_cap_until_step
    else:
        cap, until = None, 0
    quarantined = sorted({*(previous.quarantined_blocks if previous else ()), *rollback.quarantine})
    return RecoveryDirective(checkpoint_step=rollback.checkpoint_step, skip_ranges=tuple(skips), lr_overrides=lr,
                    loss_scale=rollback.loss_scale, loss_scale_cap=cap, loss_scale_cap_until_step=until,
                    quarantined_blocks=tuple(quarantined))
