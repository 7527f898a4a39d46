"""After an incident ended a generation: the policy's decision, recorded before it is carried out.

Owns the order that makes a decision survive the daemon's own death: count
the restart against progress, ask daemon.judging.policy, put the incident with its
action, the config changes and the recovery directive into state.json, and
only then rename rolled-back checkpoints aside. A daemon killed anywhere in
between finds either no decision or the whole decision on disk; a rollback
repeated after a restart is a no-op (nothing newer than its target is left).
"""
from __future__ import annotations

import dataclasses
import shutil
import time
from typing import Sequence

import tenacity

from checkpointing import layout
from contracts.config import Config, HealthConfig, config_hash, with_changes
from contracts.protocol import ExitCode, RecoveryDirective
from daemon.judging import policy, watch
from daemon.judging.incidents import Action, Halt, Incident, IncidentRecord, Rerun, Rollback
from daemon.processes.run_files import RunFiles
from daemon.records import bundles
from daemon.records.ledger import Ledger

_ROLLBACK_FIELDS = ("skip", "lr_overrides", "loss_scale", "loss_scale_cap_until_step", "quarantine")


@dataclasses.dataclass(frozen=True)
class Decision:
    action: Action
    record: IncidentRecord
    cfg: Config            # the config the next generation runs with
    resume_step: int       # the checkpoint it resumes from
    resume_tier: str = "disk"   # where the ranks find it: "ram" (this machine's RAM tier), "disk", "none"
    progress_step: int | None = None   # the decider's: the step the run would have resumed from (restart progress)


def decide_and_record(incident: Incident, *, ledger: Ledger, files: RunFiles, cfg: Config,
                      base_cfg: Config, common: Sequence[int] | None = None) -> Decision:
    """`common`: several machines: the RAM steps every machine left in the run holds (RunFiles.resume_step)."""
    state = ledger.state
    steps = files.committed_steps()                 # one scan of the manifests serves both
    committed = steps[-1] if steps else 0
    # what the ranks restore (the RAM tier's where it is newer), and what a restart's progress is judged by: with
    # the RAM tier every few steps, a rank lost 40 steps after a restart made progress, though no disk checkpoint
    # came between (no backoff for it)
    progress = files.resume_step(common)
    ledger.note_committed(progress, counts_progress=incident.kind.is_process_fault)
    history = _history(ledger, steps, memory_steps=files.memory_steps() if cfg.run.nodes == 1 else (),
                       script=bool(cfg.script.command))
    action = policy.decide(incident, history, cfg.health, cfg.train)
    record = IncidentRecord(incident=incident, generation=state.generation, unix_s=time.time(),
                            committed_step=committed, action=action)
    _record_decision(ledger, record)                        # on disk before anything is done
    resume = progress                  # nothing since moved a checkpoint (a rollback moves them next, and says where)
    if isinstance(action, (Rollback, Rerun)):
        resume = finish_rollback(ledger, files, common, cause=incident.kind.value, reason=action.reason,
                                 **{k: v for k, v in action.to_dict().items() if k in _ROLLBACK_FIELDS})
    new_cfg = cfg if isinstance(action, Halt) else with_changes(base_cfg, state.config_changes)
    write_bundle(ledger, files, cfg, record, resume)
    return Decision(action=action, record=record, cfg=new_cfg, resume_step=resume, resume_tier=files.tier_of(resume),
                    progress_step=progress)


def write_bundle(ledger: Ledger, files: RunFiles, cfg: Config, record: IncidentRecord, resume: int) -> None:
    """The decided incident's post-mortem bundle (daemon.records.bundles), once its decision is carried out: the
    last generation's rank logs (from where its processes began; after a daemon's restart, the logs' ends). A disk
    that refuses it is a warning: the run goes on."""
    logs = ledger.rank_logs or {r: (str(files.log_dir / f"rank-{r}.log"), 0) for r in files.local_ranks}
    try:
        bundles.write(files.incidents_dir, record=record, index=len(ledger.state.incidents) - 1, resume_step=resume,
                      trajectory_hash=config_hash(cfg), run=cfg.run.name, node=files.node,
                      config_path=files.resolved_config, events_path=ledger.log.path, rank_logs=logs,
                      keep=cfg.checkpoint.keep_incident_bundles)
    except OSError as e:
        ledger.emit("bundle_failed", level="warning", generation=record.generation, kind=record.kind.value,
                    detail=f"the incident's post-mortem bundle under {files.incidents_dir} was not written: "
                           f"{e.strerror or e}")


def _record_decision(ledger: Ledger, record: IncidentRecord, *,
                     in_force: tuple[dict, RecoveryDirective | None] | None = None) -> None:
    """A decided incident into state.json, the same on the decider and on the others (RunState.apply_incident:
    its config changes, recovery directive and pending rollback; `in_force`: the decider's, taken as they are)."""
    ledger.note_status("gave_up" if isinstance(record.action, Halt) else "restarting")
    ledger.record(record, "incident", "error", in_force=in_force)


def _history(ledger: Ledger, steps: list[int], memory_steps: list[int] | tuple = (),
             script: bool = False) -> policy.RunHistory:
    """What the policy is told of the run: its rollbacks, checkpoints (the RAM tier's: one machine's,
    for a rerun), restarts, samples, quarantine, where reruns found a transient fault, and whether the ranks
    run a user's script and that script can skip data."""
    state = ledger.state
    return policy.RunHistory(incidents=[r.incident for r in state.incidents if r.is_rollback],
                             committed_steps=steps, restarts_without_progress=state.restarts_without_progress,
                             sample_ranges=ledger.sample_ranges,
                             quarantined=state.recovery.quarantined_blocks if state.recovery else (),
                             transient_steps=tuple(state.transient_steps), memory_steps=tuple(memory_steps),
                             script=script, can_skip="skip_data" not in state.script_reports.get("missing", ()))


def finish_rollback(ledger: Ledger, files: RunFiles, common: Sequence[int] | None = None, **fields) -> int:
    """Carries out the recorded rollback (`state.pending_rollback`): every committed checkpoint after
    its target renamed aside, then the record that it is done. Idempotent: a daemon killed midway
    runs it again at its start (`fields` then only say so). Returns the step the run resumes from
    (`common`: several machines' RAM steps, RunFiles.resume_step)."""
    state = ledger.state
    target = state.pending_rollback
    moved = layout.roll_back(files.ckpt_root, target)
    files.retire_memory_after(target)           # nor may the ranks resume from a newer RAM copy
    # the RAM tier's newest left, where it is newer than the disk's (several machines: of those all hold)
    resume, tier = files.resume_point(None if common is None else [s for s in common if s <= target])
    ledger.note_rollback_done(resume)
    ledger.emit("rollback", level="warning", checkpoint_step=resume, checkpoint_tier=tier, rolled_back_steps=moved,
                **fields)
    ledger.save()
    return resume


def give_up(decision: Decision, ledger: Ledger, files: RunFiles) -> int:
    """A Halt: the daemon ends with its code (3: crash loop, 4: numerics)."""
    code, state = decision.action.code, ledger.state
    if (memory := files.memory_root()) is not None:       # a run that gave up holds no RAM
        shutil.rmtree(memory, ignore_errors=True)
    ledger.emit("gave_up", level="error", code=int(code), reason=decision.action.reason,
                restarts_without_progress=state.restarts_without_progress,
                committed_step=decision.record.committed_step, last_incident=decision.record.log_fields())
    cause = {ExitCode.GAVE_UP_CRASH_LOOP: "crash_loop", ExitCode.DATA_ERROR: "data"}.get(code, "numerics")
    incident = decision.record.incident
    last = f"; the last incident: {incident.kind.value}: {incident.detail}" if incident.detail else ""
    return ledger.exit(code, "gave_up", cause, "error", detail=f"{decision.action.reason}{last}")


def end_as(outcome: watch.Finished | watch.Stopped | watch.WorkerFailed | watch.Ended, ledger: Ledger, *,
           stop_code: int, stop_reason: str | None) -> int:
    """The daemon ends as `outcome` says: finished, stopped (with `stop_code`: 75 when etcd was gone
    too long), a rank's fatal error, or (multi-node) as the decider ended the run."""
    if isinstance(outcome, watch.WorkerFailed):
        return ledger.exit(outcome.code, "failed", "worker_error", "error", detail=outcome.detail)
    if isinstance(outcome, watch.Ended):
        return ledger.exit(outcome.code, outcome.status, outcome.reason, "error" if outcome.code else "info",
                           detail=outcome.detail)
    kind = "finished" if isinstance(outcome, watch.Finished) else "stopped"
    code = stop_code if kind == "stopped" else ExitCode.OK
    if kind == "finished" and outcome.step is not None:     # every rank at the run's last step (a stop's may differ)
        ledger.ended_at(outcome.step)
    return ledger.exit(code, kind, kind, step=outcome.step, **({"detail": stop_reason} if stop_reason else {}))


def count_restart(decision: Decision, ledger: Ledger, *, backoff_s: float) -> None:
    """The next generation is coming after `backoff_s`: counted, saved, told."""
    state, incident = ledger.state, decision.record.incident
    ledger.count_restart()
    ledger.save()
    ledger.metrics.update(restarts=state.restarts)
    ram = " (RAM tier)" if decision.resume_tier == "ram" else ""
    ledger.notify.status(f"restarting after {incident.kind.value} from step {decision.resume_step}{ram} "
                         f"(restart {state.restarts})")
    ledger.emit("restart", level="warning", cause=incident.kind.value, rank=incident.rank,
                detail=incident.detail or decision.action.reason, resume_step=decision.resume_step,
                resume_tier=decision.resume_tier,
                backoff_s=round(backoff_s, 3), restarts=state.restarts,
                restarts_without_progress=state.restarts_without_progress,
                config_changes=state.config_changes or None)


class Backoff:
    """How long to wait before the next generation. None before a rollback (the fault was the
    numbers', not the machine's), nor before the first restart since progress (a new checkpoint since
    the last restart) or the run's first restart of all (a rank lost before the first checkpoint): a
    fault that does not repeat costs no wait, as with torchrun's restarts; for a restart that repeats
    without progress, exponential in those repeats from restart_backoff_initial_s, jittered, capped at
    restart_backoff_max_s (a machine that keeps failing is not hammered)."""

    def __init__(self, health: HealthConfig):
        self._wait = tenacity.wait_exponential_jitter(initial=health.restart_backoff_initial_s,
                                                      max=health.restart_backoff_max_s, jitter=1.0)

    def after(self, decision: Decision, state) -> float:
        """delay_s for a run in `state` (a RunState: its restarts before this one)."""
        return self.delay_s(decision, state.restarts_without_progress, first_restart=not state.restarts)

    def delay_s(self, decision: Decision, restarts_without_progress: int, *, first_restart: bool = False) -> float:
        """`first_restart`: the run has not restarted before this one."""
        if isinstance(decision.action, (Rollback, Rerun)) or restarts_without_progress == 0 or first_restart:
            return 0.0
        return self._wait(_Attempt(restarts_without_progress))


class _Attempt:
    """The little of tenacity's RetryCallState that its wait strategies read."""

    def __init__(self, attempt_number: int):
        self.attempt_number = attempt_number


def apply_published(published: dict, *, ledger: Ledger, files: RunFiles, cfg: Config, base_cfg: Config) -> Decision:
    """A node that does not decide: the decider's decision, recorded and applied as it was made. This node's own
    policy, given the same incident, must agree; if it does not, that is non-determinism between
    the daemons (a bug), said loudly, and the decider's decision still stands."""
    state = ledger.state
    record = IncidentRecord.from_dict(published["record"])
    steps = files.committed_steps()
    if record.committed_step is not None:          # what the decider saw: a follower applying it later may
        steps = [s for s in steps if s <= record.committed_step]     # see the next generation's checkpoints
    # the same bookkeeping, in the same order, as the decider's: progress against the step it found the run would
    # resume from (a decider without "progress_step" counted the disk's alone)
    progress = published.get("progress_step", record.committed_step if record.committed_step is not None
                             else (steps[-1] if steps else 0))
    if record.incident.kind.is_process_fault:
        ledger.note_committed(int(progress), counts_progress=True)
    if record.committed_step is not None:
        ledger.note_committed(int(progress))
    history = _history(ledger, steps)
    own = policy.decide(record.incident, history, cfg.health, cfg.train)
    _record_decision(ledger, record, in_force=(
        published.get("config_changes") or {},
        RecoveryDirective.from_dict(published["recovery"]) if published.get("recovery") else None))
    # the skip window comes from the sample ranges a daemon has seen: a follower whose step datagrams of the
    # incident's last steps had not come in yet would decide a shorter one, and that is no disagreement
    seen_all = all(step in history.sample_ranges
                   for step in range(record.incident.first_step, record.incident.last_step + 1))
    if seen_all and own.to_dict() != (record.action.to_dict() if record.action else None):
        ledger.emit("decision_mismatch", level="critical", generation=record.generation,
                    applied=record.action.to_dict() if record.action else None, own=own.to_dict(),
                    detail="this node's policy decided otherwise than the decider's: the daemons are not deterministic "
                           "(a bug); the decider's decision is applied")
    if isinstance(record.action, (Rollback, Rerun)):     # this machine's own RAM tier: the decider retired its own
        files.retire_memory_after(record.action.checkpoint_step)
    new_cfg = cfg if isinstance(record.action, Halt) else with_changes(base_cfg, state.config_changes)
    resume = int(published["resume_step"])
    write_bundle(ledger, files, cfg, record, resume)
    return Decision(action=record.action, record=record, cfg=new_cfg, resume_step=resume,
                    resume_tier=files.tier_of(resume))
