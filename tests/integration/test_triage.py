"""Triage before rollback, by the real supervisor against the fake worker: a numerical incident's steps
are re-run from the checkpoint before them; a spike the rerun does not repeat (a device's) is passed
through with nothing rolled back, skipped or cut, one it repeats (bad data) is rolled back as before."""
import json
from pathlib import Path

from daemon.judging.incidents import Rollback
from daemon.records.state import RunState
from tests.integration.test_supervisor import _finish, _named, _start

# a spike is judged after 10 steps against the 10 before it; reruns on (the default)
HEALTH = ["health.loss_spike_warmup_steps=10", "health.loss_spike_window_steps=10", "health.rollback_margin_steps=4"]


def _steps(run: Path, generation: int) -> list[dict]:
    lines = (run / "logs" / "rank-0.log").read_text().splitlines()
    return [e for e in (json.loads(l) for l in lines if l.startswith("{") and '"kind": "step"' in l)
            if e["generation"] == generation]


def test_a_spike_its_rerun_does_not_repeat_is_transient_and_training_goes_on_from_the_rerun(tmp_path, cli, quiet_env):
    import subprocess

    run = tmp_path / "run"
    code, events, err = _finish(_start(run, overrides=HEALTH, fake=[
        "--steps", "60", "--interval", "5", "--spike-at", "30", "--spike-device", "--fault-generations", "1"]))
    assert code == 0, err
    incidents = _named(events, "incident")
    assert [(i["kind"], i["action"]["type"]) for i in incidents] == [("loss_spike", "rerun")]
    action = incidents[0]["action"]
    assert (action["checkpoint_step"], action["first_step"]) == (25, 30)    # the newest checkpoint before step 30
    # what the rerun is compared with: the first run's values of the incident's steps
    observed = incidents[0]["evidence"]["observed"]
    assert sorted(int(s) for s in observed) == list(range(30, action["last_step"] + 1))
    [triage] = _named(events, "triage")
    assert triage["verdict"] == "transient" and triage["level"] == "warning"
    assert triage["compared"][0]["step"] == 30 and triage["compared"][0]["first_run"] != triage["compared"][0]["rerun"]
    # training went on from the rerun: from step 26, every sample in order, the lr never cut
    gen2 = _steps(run, 2)
    assert gen2[0]["step"] == 26 and gen2[-1]["step"] == 60
    assert [e["sample_start"] for e in gen2] == [8 * (e["step"] - 1) for e in gen2]
    assert all(e["lr_multiplier"] == 1.0 for e in gen2)
    state = RunState.load(run)
    assert state.status == "finished" and state.rerun is None
    assert state.triage == {"transient": 1} and state.transient_steps == [30]
    assert state.recovery is None or (not state.recovery.skip_ranges and not state.recovery.lr_overrides)
    assert not any(isinstance(r.action, Rollback) for r in state.incidents)
    shown = subprocess.run([*cli, "status", str(run), "--json"], env=quiet_env, capture_output=True, text=True)
    assert json.loads(shown.stdout)["triage"] == {"transient": 1}, shown.stdout


def test_a_spike_its_rerun_repeats_is_the_data_and_is_rolled_back_skipped_and_cut_as_before(tmp_path):
    run = tmp_path / "run"
    code, events, err = _finish(_start(run, overrides=HEALTH, fake=[
        "--steps", "60", "--interval", "5", "--spike-at", "30", "--fault-generations", "1"]))
    assert code == 0, err
    incidents = _named(events, "incident")
    assert [(i["kind"], i["action"]["type"], i["generation"]) for i in incidents] == [
        ("loss_spike", "rerun", 1), ("loss_spike", "rollback", 2)]
    [triage] = _named(events, "triage")
    assert triage["verdict"] == "deterministic" and triage["rerun_generation"] == 2
    assert all(c["first_run"] == c["rerun"] for c in triage["compared"])          # bit for bit
    assert [c["step"] for c in triage["compared"]] == list(range(30, incidents[0]["action"]["last_step"] + 1))
    rollback = incidents[1]
    assert rollback["evidence"]["triage"]["verdict"] == "deterministic"
    skip = rollback["action"]["skip"]
    assert rollback["action"]["checkpoint_step"] == 25 and skip[0] == 8 * 29
    gen3 = _steps(run, 3)
    assert gen3[-1]["step"] == 60 and all(e["lr_multiplier"] == 0.5 for e in gen3)
    assert all(e["sample_end"] <= skip[0] or e["sample_start"] >= skip[1] for e in gen3), "skipped samples seen"
    state = RunState.load(run)
    assert state.triage == {"deterministic": 1} and state.transient_steps == [] and state.rerun is None


def test_replicas_whose_fingerprints_differ_are_rolled_back_to_where_they_last_agreed(tmp_path):
    run = tmp_path / "run"
    code, events, err = _finish(_start(run, ranks=2, overrides=HEALTH + ["health.fingerprint_interval_steps=10"], fake=[
        "--steps", "60", "--interval", "5", "--fingerprint-every", "10", "--corrupt-at", "33", "--rank-faults", "1",
        "--fault-generations", "1", "--lockstep", str(tmp_path / "lockstep"), "--lockstep-world", "2"]))
    assert code == 0, err
    [incident] = _named(events, "incident")
    assert incident["kind"] == "replica_mismatch" and "rank" not in incident       # two replicas: a tie
    evidence = incident["evidence"]
    assert (evidence["step"], evidence["last_agreed_step"], evidence["groups"]) == (40, 30, [1])
    assert evidence["tie"] is True and evidence["odd_ranks"] == [0, 1]
    action = incident["action"]
    # where they last agreed (30), nothing skipped, the lr untouched: neither the data nor the numbers were at fault
    assert action["type"] == "rollback" and action["checkpoint_step"] == 30
    assert action["skip"] is None and action["lr_overrides"] == []
    assert _named(events, "generation_start")[1]["resume_step"] == 30
    gen2 = _steps(run, 2)
    assert gen2[0]["step"] == 31 and gen2[-1]["step"] == 60 and all(e["lr_multiplier"] == 1.0 for e in gen2)
    assert RunState.load(run).status == "finished"


def _committed(events, generation):
    return [e["step"] for e in _named(events, "checkpoint_committed") if e["generation"] == generation]


def test_an_auto_checkpoint_interval_follows_young_daly_and_shortens_after_a_failure(tmp_path, cli, quiet_env):
    import subprocess

    run = tmp_path / "run"
    # every figure reported, none timed: steps of 0.01 s, saves blocking 0.02 s, a prior MTBF of 50 s
    code, events, err = _finish(_start(run, overrides=[
        "checkpoint.interval_steps=auto", "checkpoint.auto_mtbf_prior_s=50", "checkpoint.keep_last=10"], fake=[
        "--steps", "400", "--step-s", "0.01", "--save-s", "0.02", "--crash-at", "200", "--fault-generations", "1",
        "--interval", "50"]),               # the engine's starting interval (AUTO_FIRST_STEPS)
        timeout=120)
    assert code == 0, err
    first, second = _named(events, "checkpoint_interval")[:2]
    # at the first save (step 50: the ranks' starting interval), 49 steps trained (the first compiles):
    # sqrt(2 x 0.02 s x (0.49 s + 50 s) / 1) = 1.421 s = 142 steps
    assert first["changed"] == {"interval_steps": 142} and first["failures"] == 0
    assert first["tiers"]["disk"]["cost_s"] == 0.02 and first["step_s"] == 0.01
    assert _committed(events, 1)[:2] == [50, 142]          # the ranks took it at once
    # the next generation (from 142) starts with the interval in force (its commands file's first) and saves at
    # 284 by it; the crash at 200 was a failure: MTBF halves, the interval shrinks by about 1/sqrt(2)
    assert _committed(events, 2)[0] == 284
    assert second["generation"] == 2 and second["failures"] == 1
    assert second["changed"]["interval_steps"] < 142 * 0.8
    state = RunState.load(run)
    assert state.cadence["interval_steps"] == second["changed"]["interval_steps"]
    shown = subprocess.run([*cli, "status", str(run), "--json"], env=quiet_env, capture_output=True, text=True)
    assert json.loads(shown.stdout)["checkpoint_intervals"] == {"interval_steps": state.cadence["interval_steps"]}
