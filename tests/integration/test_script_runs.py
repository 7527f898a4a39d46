"""`[script]`: the daemon runs a user's training script as each rank (docs/bring-your-own-script.md) — here the
stdlib fake worker, speaking the protocol as llm_pretrain_client does — through the real `llm-pretrain run`."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _run(cli, env, run_dir: Path, command: str, *more: str, timeout: int = 180):
    return subprocess.run([*cli, "run", "--log-format", "json", "--set", f"run.dir={str(run_dir)!r}",
                           "--set", "train.steps=12", "--set", f"script.command={command!r}",
                           "--set", f"script.python={sys.executable!r}", "--set", f"script.cwd={str(ROOT)!r}", *more],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "logs" / "events.jsonl").read_text().splitlines()]


def test_a_script_runs_as_the_ranks_with_the_resolved_config_and_says_what_it_cannot_report(tmp_path, cli, quiet_env):
    run_dir = tmp_path / "byo"
    command = (f"-m tests.integration.fake_worker --run-dir {run_dir} --steps 12 --interval 4 "
               "--reports loss,lr,loss_scale,data_position")
    proc = _run(cli, quiet_env, run_dir, command)
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = (run_dir / "logs" / "rank-0.log").read_text()
    # the script was told the run's config through LLM_PRETRAIN_CONFIG, not an appended --config
    assert f"config {run_dir}/config.resolved.toml: " in log and "train.steps=12" in log
    said = [e for e in _events(run_dir) if e["event"] == "script_reports"]
    assert len(said) == 1 and said[0]["level"] == "warning"
    assert said[0]["missing"] == ["grad_norm", "skip_data"]
    assert "grad-norm spike" in said[0]["off"]["grad_norm"] and "window" in said[0]["off"]["skip_data"]
    assert any(e["event"] == "daemon_exit" and e.get("reason") == "finished" for e in _events(run_dir))
    status = subprocess.run([*cli, "status", str(run_dir), "--json"], capture_output=True, text=True, env=quiet_env,
                            timeout=60)
    assert json.loads(status.stdout)["script_reports"]["missing"] == ["grad_norm", "skip_data"]
    text = subprocess.run([*cli, "status", str(run_dir)], capture_output=True, text=True, env=quiet_env, timeout=60)
    assert "detectors off" in text.stdout and "no grad_norm, no skip_data" in text.stdout


def test_a_script_that_reports_everything_is_not_warned_about(tmp_path, cli, quiet_env):
    run_dir = tmp_path / "full"
    command = (f"-m tests.integration.fake_worker --run-dir {run_dir} --steps 12 "
               "--reports loss,grad_norm,loss_scale,lr,data_position,skip_data")
    proc = _run(cli, quiet_env, run_dir, command)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [e for e in _events(run_dir) if e["event"] == "script_reports"]
    assert [e["missing"] for e in said] == [[]] and said[0]["level"] == "info"


def test_a_crashed_script_rank_is_restarted_cold_and_the_state_rebuilt_keeps_what_it_reports(tmp_path, cli,
                                                                                               quiet_env):
    """No warm standby for a script (its interpreter starts cold); a crash restarts it from its checkpoint; a
    state rebuilt from the events (state.json lost) keeps what the script reports."""
    run_dir = tmp_path / "crash"
    command = (f"-m tests.integration.fake_worker --run-dir {run_dir} --steps 12 --interval 4 --crash-at 6 "
               "--fault-generations 1 --reports loss,lr")
    proc = _run(cli, quiet_env, run_dir, command)
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = _events(run_dir)
    starts = [e for e in events if e["event"] == "generation_start"]
    assert len(starts) == 2 and not any(e.get("from_standby") for e in starts)
    assert not any(e["event"].startswith("standby") for e in events)
    assert len([e for e in events if e["event"] == "script_reports"]) == 1     # said once, not per generation
    from daemon.records.state_rebuild import read_events, state_from_events

    rebuilt, _ = state_from_events(read_events(run_dir / "logs" / "events.jsonl"))   # a state.json lost
    assert rebuilt.script_reports["reports"] == ["loss", "lr"]
    assert rebuilt.script_reports["missing"] == ["grad_norm", "loss_scale", "data_position", "skip_data"]


@pytest.mark.parametrize("setting, named", [
    ("script.command='no_such_train.py --lr 1'", "no_such_train.py"),
    ("script.python='/nonexistent/bin/python'", "/nonexistent/bin/python"),
    ("script.cwd='/nonexistent/dir'", "/nonexistent/dir"),
])
def test_a_script_that_cannot_start_is_refused_in_one_line_before_any_rank(tmp_path, cli, quiet_env, setting, named):
    run_dir = tmp_path / "bad"
    command = f"-m tests.integration.fake_worker --run-dir {run_dir}"
    proc = _run(cli, quiet_env, run_dir, command, "--set", setting, timeout=60)
    assert proc.returncode == 78, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "Traceback" not in proc.stderr
    assert not (run_dir / "logs" / "rank-0.log").exists()


def test_an_interpreter_without_the_client_is_refused(tmp_path, cli, quiet_env):
    """The client is found without being imported: an interpreter that lacks it (the system's, with no
    PYTHONPATH to this repository) is refused in one line naming the package to install."""
    run_dir, bare = tmp_path / "bare", tmp_path / "elsewhere"
    bare.mkdir()
    (bare / "train.py").write_text("print('never run')\n")
    if not Path("/usr/bin/python3").exists():
        pytest.skip("needs a system Python (/usr/bin/python3), which lacks llm_pretrain_client")
    env = {k: v for k, v in quiet_env.items() if k != "PYTHONPATH"}
    proc = subprocess.run([*cli, "run", "--set", f"run.dir={str(run_dir)!r}", "--set", "script.command='train.py'",
                           "--set", "script.python='/usr/bin/python3'", "--set", f"script.cwd={str(bare)!r}"],
                          capture_output=True, text=True, env=env, timeout=60, cwd=ROOT)
    assert proc.returncode == 78 and "cannot import llm_pretrain_client" in proc.stderr, proc.stderr
