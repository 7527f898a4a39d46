"""Triage before rollback, by the real supervisor against the fake worker: a numerical incident's steps
are re-run from the checkpoint before them; a spike the rerun does not repeat (a device's) is passed
through with nothing rolled back, skipped or cut, one it repeats (bad data) is rolled back as before."""
import json
from pathlib import Path

from daemon.incidents import Rollback
from daemon.state import RunState
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
