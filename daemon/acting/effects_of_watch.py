"""Carries out what the watch (a pure state machine) asked for during a generation: commands to the
ranks, events, status, progress, warnings, checkpoint bookkeeping with retention, stack dumps."""
from __future__ import annotations

from typing import Sequence

from contracts.config import Config
from daemon.judging import watch
from daemon.judging.incidents import Incident, Kind
from daemon.processes.generation import Generation
from daemon.processes.run_files import RunFiles
from daemon.records import bundles
from daemon.records.ledger import Ledger


def carry_out(effects: Sequence[watch.Effect], *, ledger: Ledger, gen: Generation, peers, files: RunFiles,
              cfg: Config) -> None:
    """`peers`: daemon.acting.peers.Alone or daemon.machines.nodes.Nodes (commands go through it; only the decider
    retires checkpoints, its leadership confirmed first)."""
    for e in effects:
        if isinstance(e, watch.Send):
            peers.send(e.name, dict(e.args), ledger, files.append_command)
        elif isinstance(e, watch.Note):
            ledger.emit(e.event, level=e.level, **e.fields)
        elif isinstance(e, watch.Status):
            ledger.set_status(e.status, e.text)
        elif isinstance(e, watch.Progress):
            ledger.progress(e.event, log=e.log, notify=e.notify, compiled=e.compiled)
            _cadence(ledger, cfg, peers, files, step=e)
        elif isinstance(e, watch.Saving):
            if e.stage in ("staged", "waited"):     # the steps held: checkpoint time in the goodput ledger
                ledger.checkpoint_stall(e.seconds)
            if e.stage != "waited":
                _cadence(ledger, cfg, peers, files, saving=e)
        elif isinstance(e, watch.Phase):
            ledger.phase(e.phase)
        elif isinstance(e, watch.Validated):
            ledger.validated(e.event)
        elif isinstance(e, watch.ScriptReports):
            ledger.script_reports(e.reports)
        elif isinstance(e, watch.Warned):
            ledger.warn(e.incident)
        elif isinstance(e, watch.Triaged):
            ledger.triaged(e.verdict, e.first_step, dict(e.evidence), cfg.health)
        elif isinstance(e, watch.CheckpointFailed):
            ledger.checkpoint_failed(e.step, e.detail)
        elif isinstance(e, watch.Committed):
            # one event per save, the checkpoints it retired in it (a line of their own doubled the console)
            retired = peers.is_leader and peers.confirm() and files.retire_old(cfg, ledger.state.incidents,
                                                                               current_step=e.current_step)
            ledger.emit("checkpoint_committed", rank=e.rank, step=e.step, detail=e.detail,
                        **({"retired": retired} if retired else {}))
            ledger.checkpoint_committed(e.step)
            if retired:                  # the incidents' bundles go with the checkpoints their runs resumed from
                _retire_bundles(ledger, files, cfg, retired)
            _disk_space(ledger, files, e.step)
        elif isinstance(e, watch.MemoryCommitted):
            # this machine's RAM tier, retired by its daemon alone (the ranks keep every RAM checkpoint under it)
            files.retire_memory(cfg, ledger.state.incidents, current_step=e.current_step)
        elif isinstance(e, watch.Restored):
            tier = "ram" if files.is_memory_path(e.path) else "disk"
            ledger.emit("checkpoint_restored", step=e.step, path=e.path, tier=tier)
            ledger.note_resumed(e.step, tier, restored=True)
        elif isinstance(e, watch.DumpStacks):
            for rank in e.native:        # before the signals: a stopped rank's state as it was found
                ledger.emit("stacks", level="error", rank=rank, **gen.native_state(rank))
            gen.dump_stacks(e.ranks)


def _cadence(ledger: Ledger, cfg: Config, peers, files: RunFiles, *, step: watch.Progress | None = None,
             saving: watch.Saving | None = None) -> None:
    """checkpoint.interval_steps / memory_interval_steps = "auto": the daemon times the saves and the steps
    and moves the intervals (an `interval` command, a `checkpoint_interval` event) when a commit's cost or
    the failures seen change the optimum (each generation starts with those in force: RunFiles)."""
    cadence = ledger.cadence_for(cfg.checkpoint)
    if cadence is None:
        return
    if step is not None:
        cadence.step(step.event, step.compiled)
        return
    if saving.stage == "staged":
        cadence.staged(saving.tier, saving.step, saving.seconds)
        return
    cadence.committed(saving.tier, saving.step)
    if not peers.is_leader:                   # the decider sets the ranks' intervals for every machine
        return
    change = cadence.retune(ledger.state.failures())
    ledger.note_cadence(cadence.to_dict())
    if change is not None:
        peers.send("interval", change["changed"], ledger, files.append_command)
        ledger.emit("checkpoint_interval", **change)
        ledger.save()


def _retire_bundles(ledger: Ledger, files: RunFiles, cfg: Config, retired: list[int]) -> None:
    try:
        bundles.retire(files.incidents_dir, keep=cfg.checkpoint.keep_incident_bundles,
                       committed=files.committed_steps(), retired=retired)
    except OSError as e:
        ledger.emit("bundle_failed", level="warning", detail=f"old post-mortem bundles under {files.incidents_dir} "
                                                             f"not retired: {e.strerror or e}")


def _disk_space(ledger: Ledger, files: RunFiles, step: int) -> None:
    """A warning once the disk has room for fewer than two more checkpoints (said again only after
    space came back), before saves start to fail."""
    low = files.space_low(step)
    if low is not None and not ledger.disk_space_low:
        ledger.warn(Incident(kind=Kind.DISK_SPACE_LOW, first_step=step, last_step=step, needs_action=False,
                             detail=low))
    ledger.disk_space_low = low is not None
