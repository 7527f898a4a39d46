"""The RAM tier's retention under the daemon (issue 50, item 4): the daemon, not the ranks, retires RAM
checkpoints, by the disk's rule, on a clock that stops at an incident's detection, so a rerun or rollback finds
the checkpoint just before the incident however far the ranks ran on before the teardown; and where each
generation resumed from is said by the events, state.json and status."""
import json

import pytest

from checkpointing import layout, retention
from checkpointing.writer import FORMAT, VERSION
from contracts.config import load_config
from contracts.protocol import CheckpointEvent
from daemon.judging import policy
from daemon.judging.health import HealthMonitor
from daemon.judging.incidents import Incident, IncidentRecord, Kind, Rerun, Rollback
from daemon.judging.watch import MemoryCommitted, Restored, Watch
from daemon.processes.run_files import MEMORY_KEEP, RunFiles, detection_hold, protected_steps
from tests.unit.steps import step_event

# spikes judged from step 10 over a window of 10; hold 3, rollback margin 10 (the defaults)
CFG = load_config(None, ["health.loss_spike_warmup_steps=10", "health.loss_spike_window_steps=10"])


def _retire(steps: list[int], cfg, incidents, current: int) -> list[int]:
    """The daemon's rule (RunFiles.retire_memory) on a list of RAM steps: what is left."""
    doomed = retention.select_for_deletion(steps, keep_last=MEMORY_KEEP,
                                           protected=protected_steps(steps, incidents, cfg, current_step=current))
    return [s for s in steps if s not in doomed]


@pytest.mark.parametrize("ran_on", [0, 5, 40])
def test_the_ram_checkpoints_before_a_spike_outlive_the_ranks_running_on_to_the_teardown(ran_on):
    """The ranks save to RAM every step and run `ran_on` steps past the spike's detection before the teardown;
    today's ranks kept their newest two, so a rerun of a spike at 30 started from the disk."""
    w = Watch(CFG, generation=1, ranks=[0], now=0.0, monitor=HealthMonitor(CFG.health, precision="fp32"))
    ram: list[int] = []
    for step in range(1, 33 + ran_on):                 # the spike: steps 30, 31, 32 (detected at 32, hold 3)
        w.on_event(step_event(step=step, loss=12.0 if step >= 30 else 3.0), 0.01 * step)
        w.on_event(CheckpointEvent(rank=0, generation=1, step=step, stage="in_memory"), 0.01 * step)
        for e in w.drain():
            if isinstance(e, MemoryCommitted):
                ram.append(e.step)
                ram = _retire(ram, CFG, [], e.current_step)
    incident = w.tick(1.0).incident
    assert (incident.kind, incident.first_step, incident.last_step) == (Kind.LOSS_SPIKE, 30, 32)
    assert w.judged_step == 32                         # the clock stopped at the detection
    assert {19, 29} <= set(ram) and ram[-1] == 32 + ran_on and len(ram) <= detection_hold(CFG) + 10 + 2 + ran_on
    # the rerun starts from the step before the incident, the rollback after it from the one before its margin
    history = policy.RunHistory(committed_steps=[], memory_steps=ram, sample_ranges={})
    rerun = policy.decide(incident, history, CFG.health, CFG.train)
    assert isinstance(rerun, Rerun) and rerun.checkpoint_step == 29
    triaged = Incident(kind=incident.kind, first_step=30, last_step=32, evidence={"triage": {"verdict": "deterministic"}})
    rollback = policy.decide(triaged, history, CFG.health, CFG.train)
    assert isinstance(rollback, Rollback) and rollback.checkpoint_step == 19


def test_without_an_incident_the_ram_tier_keeps_the_uncleared_window_and_the_newest_healthy_before_it():
    steps = list(range(1, 101))
    # horizon: 100 - hold 3 - margin 10 = 87: 87 is settled, everything after it may still become a target
    assert _retire(steps, CFG, [], 100) == list(range(87, 101))
    # a rolled-back incident at 80-85 taints 70-85: the settled one is 69 (what is after 87 stays)
    spike = IncidentRecord(incident=Incident(kind=Kind.LOSS_SPIKE, first_step=80, last_step=85), generation=1,
                           unix_s=0.0, action=Rollback("r", checkpoint_step=69, skip=None, lr_overrides=()))
    assert _retire(steps, CFG, [spike], 97) == [69, *range(85, 101)]
    # every 10 steps (RAM) the window holds two: 87 settled before it is
    assert _retire(list(range(10, 101, 10)), CFG, [], 100) == [80, 90, 100]


def test_an_incident_stops_the_clock_of_disk_retention_too():
    w = Watch(CFG, generation=1, ranks=[0], now=0.0, monitor=HealthMonitor(CFG.health, precision="fp32"))
    for step in range(1, 60):
        w.on_event(step_event(step=step, loss=12.0 if step >= 30 else 3.0), 0.01 * step)
    w.on_event(CheckpointEvent(rank=0, generation=1, step=50, stage="committed"), 1.0)
    committed = [e for e in w.drain() if type(e).__name__ == "Committed"]
    assert committed[0].current_step == 32             # not 59: the checkpoints before the spike stay protected


def _manifest(root, step):
    layout.step_dir(root, step).mkdir(parents=True)
    (layout.step_dir(root, step) / layout.MANIFEST).write_text(json.dumps({"format": FORMAT, "version": VERSION,
                                                                          "shards": []}))
    (layout.step_dir(root, step) / layout.shard_name(0, 1)).write_bytes(b"x")


def test_the_daemon_retires_its_ram_tier_and_reports_where_the_ranks_resume_from(tmp_path):
    (tmp_path / "run").mkdir()
    files = RunFiles(load_config(None, [f'run.dir="{tmp_path / "run"}"', f'checkpoint.memory_dir="{tmp_path / "shm"}"']),
                     {})
    memory = files.memory_root()
    for s in range(1, 41):
        _manifest(memory, s)
    _manifest(files.ckpt_root, 20)
    assert files.retire_memory(CFG, [], current_step=40) == list(range(1, 27))   # horizon 27: settled
    assert layout.committed_steps(memory) == list(range(27, 41))
    assert (memory / layout.SPARE / layout.shard_name(0, 1)).exists()           # the ranks write over it
    assert files.resume_point() == (40, "ram") and files.tier_of(40) == "ram" and files.tier_of(20) == "disk"
    assert files.is_memory_path(str(layout.step_dir(memory, 40))) and not files.is_memory_path(str(files.ckpt_root))


def test_the_ranks_restore_is_the_resume_step_status_shows(tmp_path):
    from cli.status import render, summary
    from daemon.records import state_rebuild
    from daemon.records.state import RunState

    w = Watch(CFG, generation=2, ranks=[0], now=0.0, monitor=HealthMonitor(CFG.health, precision="fp32"))
    w.on_event(CheckpointEvent(rank=0, generation=2, step=89, stage="restored", detail="/dev/shm/llm-pretrain-x/step-89"),
               0.0)
    assert Restored(89, "/dev/shm/llm-pretrain-x/step-89") in w.drain()
    state = RunState(status="finished", generation=2)
    state.note_resumed(step=89, tier="ram", generation=2, restored=True)
    state.save(tmp_path)
    s = summary(tmp_path)
    assert s["resumed_from"] == {"step": 89, "tier": "ram", "generation": 2, "restored": True}
    assert "resumed from     step 89 (RAM tier), generation 2" in render(s)
    # a state rebuilt from the log says the same
    rebuilt, _ = state_rebuild.state_from_events([
        {"event": "generation_start", "generation": 2, "resume_step": 89, "resume_tier": "ram"},
        {"event": "checkpoint_restored", "generation": 2, "step": 89, "tier": "ram", "path": "/dev/shm/x"}])
    assert rebuilt.resumed == state.resumed
