"""A corrupt state.json, against the real supervisor and the fake worker: `status` names it in one line
(exit 65); the next daemon sets it aside, rebuilds the run's history from the event log, and the run
goes on with the recovery directive it had (the same samples skipped, the same lr cut)."""
import json
import subprocess

from daemon.records.state import STATE_FILE, RunState
from tests.integration.test_recovery_policy import QUICK_HEALTH, _steps
from tests.integration.test_supervisor import _finish, _named, _start

GARBAGE = b"\x00\x00\x17{\"generation\": 2, \"incid\xff\xfe a write torn by a dying disk"


def _without_time(record) -> dict:
    return {k: v for k, v in record.to_dict().items() if k != "unix_s"}


def test_a_corrupt_state_is_rebuilt_from_the_log_and_the_run_skips_the_same_samples(tmp_path, cli, quiet_env):
    run = tmp_path / "run"
    code, events, err = _finish(_start(run, overrides=QUICK_HEALTH, fake=[
        "--steps", "60", "--interval", "5", "--spike-at", "30", "--fault-generations", "1"]))
    assert code == 0, err
    before = RunState.load(run)
    assert before.recovery.skip_ranges and before.generation == 2 and before.restarts == 1
    (run / STATE_FILE).write_bytes(GARBAGE)

    status = subprocess.run([*cli, "status", str(run)], capture_output=True, text=True, env=quiet_env, timeout=60)
    assert status.returncode == 65, status.stderr
    (line,) = status.stderr.strip().splitlines()
    assert line.startswith("llm-pretrain: data error: ") and f"{run / STATE_FILE} is corrupt (not UTF-8 text)" in line
    assert "rebuilds it from the event log" in line and "Traceback" not in status.stderr and status.stdout == ""

    # the same run, 20 steps more (were the generation count lost, the next would be 1 again, and spike)
    code, events, err = _finish(_start(run, overrides=QUICK_HEALTH, fake=[
        "--steps", "80", "--interval", "5", "--spike-at", "30", "--fault-generations", "1"]))
    assert code == 0, err
    (rebuilt,) = _named(events, "state_rebuilt")
    (aside,) = run.glob(f"{STATE_FILE}.corrupt-*")
    assert aside.read_bytes() == GARBAGE
    assert rebuilt["level"] == "error" and rebuilt["path"] == str(aside) and rebuilt["detail"] == "not UTF-8 text"
    assert rebuilt["rebuilt"]["incidents"] == 1 and rebuilt["rebuilt"]["restarts"] == 1
    assert rebuilt["generations"] == 2 and rebuilt["pending_rollback"] is None
    assert rebuilt["recovery"] == before.recovery.to_dict()
    assert _named(events, "daemon_exit")[-1]["reason"] == "finished"

    after = RunState.load(run)
    assert [_without_time(r) for r in after.incidents] == [_without_time(r) for r in before.incidents]
    assert after.incidents[0].kind == "loss_spike" and after.incidents[0].is_rollback
    assert after.recovery == before.recovery and after.restarts == 1 and after.generation == 3
    assert [s["generation"] for s in _named(events, "generation_start")] == [3]
    written = json.loads((run / "recovery.json").read_text())     # what generation 3 was handed
    assert written["skip_ranges"] == [list(r) for r in before.recovery.skip_ranges]

    # generation 3 continued where generation 2 stopped: past the skipped samples, at the cut lr
    steps = _steps(run / "logs" / "rank-0.log")
    gen2 = {e["step"]: e for e in steps if e["generation"] == 2}
    gen3 = [e for e in steps if e["generation"] == 3]
    (a, b), = before.recovery.skip_ranges
    assert gen3[0]["step"] == 61 and gen3[-1]["step"] == 80
    assert gen3[0]["sample_start"] == gen2[60]["sample_end"] == 8 * 60 + (b - a)
    assert all(e["lr_multiplier"] == 0.5 for e in gen3)
