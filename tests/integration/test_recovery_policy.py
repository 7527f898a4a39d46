"""The real supervisor acting on incidents, against the stdlib fake worker: a loss spike is rolled
back with the window skipped and the lr cut; recurrences compound the cut and end in exit 4;
out-of-memory kills in a real memory cgroup are told from crashes and answered with config changes."""
import json
import os
from pathlib import Path

import pytest

from daemon.judging.incidents import Halt, Rollback
from daemon.processes import memcg
from daemon.records.state import RunState
from tests.integration.test_supervisor import _finish, _named, _start


# a spike is judged after 10 steps against the 10 before it; the policy's rows act at once (no rerun
# first: tests/integration/test_triage.py has the rerun before them)
QUICK_HEALTH = ["health.loss_spike_warmup_steps=10", "health.loss_spike_window_steps=10",
                "health.rollback_margin_steps=4", "health.rerun=false"]


def _steps(log: Path) -> list[dict]:
    return [json.loads(l) for l in log.read_text().splitlines() if l.startswith("{") and '"kind": "step"' in l]


def test_a_loss_spike_is_rolled_back_with_its_window_skipped_and_the_lr_cut(tmp_path):
    run = tmp_path / "run"
    code, events, err = _finish(_start(run, overrides=QUICK_HEALTH, fake=[
        "--steps", "60", "--interval", "5", "--spike-at", "30", "--fault-generations", "1"]))
    assert code == 0, err
    incident = _named(events, "incident")[0]
    assert incident["kind"] == "loss_spike" and incident["first_step"] == 30
    assert incident["evidence"]["values"][0] > incident["evidence"]["threshold"]
    action = incident["action"]
    # newest committed checkpoint before 30 - margin 4 = 26: step 25
    assert action["type"] == "rollback" and action["checkpoint_step"] == 25
    assert action["lr_overrides"] == [{"start_step": 26, "factor": 0.5, "hold_steps": 200, "ramp_steps": 200}]
    skip = action["skip"]
    assert skip[0] == 8 * 29 and skip[1] >= 8 * 32        # from the first spiking step to the last one seen
    rollback = _named(events, "rollback")[0]
    assert 30 in rollback["rolled_back_steps"]
    assert (run / "checkpoints" / "step-00000030.rolledback").is_dir()
    assert not (run / "checkpoints" / "step-00000030").exists() or \
        _named(events, "generation_start")[1]["resume_step"] == 25
    # the decision was on disk, and the next generation ran with it
    state = RunState.load(run)
    assert isinstance(state.incidents[-1].action, Rollback) and state.status == "finished"
    assert state.recovery.skip_ranges == (tuple(skip),)
    gen2 = [e for e in _steps(run / "logs" / "rank-0.log") if e["generation"] == 2]
    assert gen2[0]["step"] == 26 and gen2[-1]["step"] == 60
    assert all(e["sample_end"] <= skip[0] or e["sample_start"] >= skip[1] for e in gen2), "skipped samples seen"
    assert all(e["lr_multiplier"] == 0.5 for e in gen2)


def test_the_daemon_retires_old_checkpoints_but_keeps_the_one_a_rollback_needs(tmp_path):
    # keep_last = 1: without the daemon's protection the spike at 30 would find nothing healthy to go back to
    run = tmp_path / "run"
    code, events, err = _finish(_start(run, overrides=[*QUICK_HEALTH, "checkpoint.keep_last=1"], fake=[
        "--steps", "60", "--interval", "5", "--spike-at", "30", "--fault-generations", "1"]))
    assert code == 0, err
    action = _named(events, "incident")[0]["action"]
    starts = _named(events, "generation_start")
    assert action["type"] == "rollback" and action["checkpoint_step"] == 25     # as with every checkpoint kept
    assert starts[1]["resume_step"] == action["checkpoint_step"]        # it was still there
    retired = [s for e in _named(events, "checkpoint_committed") if e["generation"] == 1 for s in e.get("retired") or []]
    # at the commit of 30 the daemon has seen step 30 or a little more: 20 or 25 is the newest settled one
    assert retired in ([5, 10, 15], [5, 10, 15, 20])
    # at the end (step 60, margin 4, hold 3: horizon 53): the newest healthy one at or before it, and later ones
    left = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step-*") if p.name[5:].isdigit())
    assert left == [50, 55, 60]


def test_recurring_spikes_compound_the_cut_then_give_up_with_4(tmp_path):
    run = tmp_path / "run"
    code, events, err = _finish(_start(run, overrides=[*QUICK_HEALTH, "health.lr_floor_factor=0.25"], fake=[
        "--steps", "60", "--interval", "5", "--spike-at", "30"]))
    assert code == 4, err
    cuts = [i["action"]["lr_overrides"][0]["factor"] for i in _named(events, "incident")
            if i["action"]["type"] == "rollback"]
    assert cuts == [0.5, 0.25]
    assert _named(events, "gave_up")[0]["code"] == 4
    assert _named(events, "daemon_exit")[-1]["reason"] == "numerics"
    state = RunState.load(run)
    assert state.status == "gave_up" and isinstance(state.incidents[-1].action, Halt)


def _memcg_available() -> bool:
    try:
        memcg.locate()
        return os.geteuid() == 0
    except (memcg.CgroupError, OSError):
        return False


needs_memcg = pytest.mark.skipif(not _memcg_available(), reason="needs root and a memory cgroup controller")


@needs_memcg
def test_out_of_memory_is_told_from_a_crash_and_answered_with_smaller_batches(tmp_path):
    run = tmp_path / "run"
    limit = 200 << 20
    code, events, err = _finish(_start(run, overrides=[f"run.worker_memory_limit_bytes={limit}"], fake=[
        "--steps", "20", "--interval", "5", "--hog-at", "7", "--fault-generations", "1,2"]), timeout=120)
    assert code == 0, err
    ooms = _named(events, "oom")
    assert len(ooms) == 2 and ooms[0]["limit_bytes"] == limit and ooms[0]["signal"] == "cgroup oom_kill"
    actions = [i["action"] for i in _named(events, "incident")]
    assert [a["config_changes"] for a in actions] == [
        {"train.recompute": True}, {"train.micro_batch": 4, "train.grad_accum_steps": 2}]
    ends = _named(events, "generation_end")
    assert [e["oom_kills"]["0"] for e in ends] == [1, 1, 0]
    assert 0 < ends[-1]["peak_memory_bytes"]["0"] < limit
    log = (run / "logs" / "rank-0.log").read_text()
    gen3 = log[log.index("generation 3"):].splitlines()[1]       # the config generation 3 started with
    assert "train.micro_batch=4" in gen3 and "train.grad_accum_steps=2" in gen3 and "train.recompute=true" in gen3
    assert RunState.load(run).config_changes == {"train.recompute": True, "train.micro_batch": 4,
                                                 "train.grad_accum_steps": 2}
    cgroup_root = memcg.locate()[1]
    assert not (cgroup_root / "llm-pretrain-run").exists(), "the daemon left its cgroups behind"


@needs_memcg
def test_a_sigkill_under_a_memory_limit_is_still_a_crash(tmp_path):
    code, events, err = _finish(_start(tmp_path / "run", overrides=["run.worker_memory_limit_bytes=268435456"],
                                       fake=["--steps", "15", "--signal-at", "7", "--fault-generations", "1"]))
    assert code == 0, err
    assert not _named(events, "oom") and _named(events, "crash")[0]["cause"] == "killed by signal 9"
    assert _named(events, "incident")[0]["action"] == {"type": "restart", "config_changes": {},
                                                       "reason": "crash: restart from the latest committed checkpoint"}


@pytest.mark.parametrize("point", ["recorded", "mid_rollback", "rolled_back", "backoff"])
def test_a_rollback_interrupted_by_kill_9_anywhere_is_completed_once_by_the_next_daemon(tmp_path, point):
    run = tmp_path / "run"
    fake = ["--steps", "60", "--interval", "5", "--spike-at", "30", "--fault-generations", "1"]
    code, events, _ = _finish(_start(run, overrides=QUICK_HEALTH, fake=fake,
                                     env=dict(os.environ, FAKE_DAEMON_DIE_AT=point)))
    assert code == -9                                               # it died where it was told to
    decided = RunState.load(run)
    assert isinstance(decided.incidents[-1].action, Rollback) and decided.incidents[-1].action.checkpoint_step == 25
    finished_before = bool(_named(events, "rollback"))
    code, events, err = _finish(_start(run, overrides=QUICK_HEALTH, fake=fake))
    assert code == 0, err
    assert len(_named(events, "rollback")) == (0 if finished_before else 1)
    assert _named(events, "generation_start")[0]["resume_step"] == 25     # never from a condemned checkpoint
    assert (run / "checkpoints" / "step-00000030.rolledback").is_dir()
    state = RunState.load(run)
    assert state.pending_rollback is None and len([r for r in state.incidents if r.action]) == 1
    gen2 = [e for e in _steps(run / "logs" / "rank-0.log") if e["generation"] == 2]
    skip = state.recovery.skip_ranges[0]
    assert gen2[0]["step"] == 26 and gen2[-1]["step"] == 60 and all(e["lr_multiplier"] == 0.5 for e in gen2)
    assert all(e["sample_end"] <= skip[0] or e["sample_start"] >= skip[1] for e in gen2)


def test_a_daemon_killed_after_detecting_before_deciding_leaves_the_incident_for_the_next_to_decide(tmp_path):
    run = tmp_path / "run"
    fake = ["--steps", "60", "--interval", "5", "--spike-at", "30", "--fault-generations", "1"]
    code, _, _ = _finish(_start(run, overrides=QUICK_HEALTH, fake=fake, env=dict(os.environ, FAKE_DAEMON_DIE_AT="detected")))
    held = RunState.load(run)
    assert code == -9 and not held.incidents and held.undecided["kind"] == "loss_spike"   # held, not decided
    code, events, err = _finish(_start(run, overrides=QUICK_HEALTH, fake=fake))
    assert code == 0, err
    assert len(_named(events, "rollback")) == 1 and [e["kind"] for e in _named(events, "incident")] == ["loss_spike"]
    assert _named(events, "generation_start")[0]["resume_step"] == 25 and RunState.load(run).undecided is None
    assert _named(events, "daemon_exit")[0]["reason"] == "finished"


def test_a_daemon_killed_once_the_next_generation_is_spawned_keeps_the_decision_in_force(tmp_path):
    run = tmp_path / "run"
    fake = ["--steps", "60", "--interval", "5", "--spike-at", "30", "--fault-generations", "1"]
    code, events, _ = _finish(_start(run, overrides=QUICK_HEALTH, fake=fake, env=dict(os.environ, FAKE_DAEMON_DIE_AT="opened")))
    assert code == -9 and len(_named(events, "rollback")) == 1
    code, events, err = _finish(_start(run, overrides=QUICK_HEALTH, fake=fake))
    assert code == 0, err
    assert not _named(events, "rollback") and not _named(events, "incident")    # decided and done once
    resumed = _named(events, "generation_start")[0]["resume_step"]
    assert 25 <= resumed < 30                  # the rollback's lineage (the orphans' save on SIGTERM at most)
    state = RunState.load(run)
    skip = state.recovery.skip_ranges[0]
    after = [e for e in _steps(run / "logs" / "rank-0.log") if e["step"] > 25]
    last_gen = max(e["generation"] for e in after)
    final = [e for e in after if e["generation"] == last_gen]
    assert final[-1]["step"] == 60 and all(e["lr_multiplier"] == 0.5 for e in final)
    assert all(e["sample_end"] <= skip[0] or e["sample_start"] >= skip[1] for e in final)
