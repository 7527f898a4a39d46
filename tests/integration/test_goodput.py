"""The goodput ledger under the real supervisor and the fake worker: a crash shows what the restart cost and the
steps trained again; a daemon killed with SIGKILL and started again keeps the ledger (productive seconds never go
down, every cause keeps its total) and counts the time it was away; `status --json` and the metrics textfile say it.
Timings are never asserted tightly (the machines are shared): causes present or absent, monotonicity, sums."""
import json
import signal
import subprocess
import time

import pytest

from daemon.judging.goodput import CAUSES, RESTART
from daemon.records.state import RunState
from tests.integration.test_supervisor import ROOT, _finish, _logged, _named, _start, _wait

pytestmark = pytest.mark.integration


def _ledger_sums_to_its_wall(g: dict) -> None:
    assert g["productive_s"] + sum(g["badput_s"].values()) + g["slack_s"] == pytest.approx(g["wall_s"], abs=0.05)
    assert 0 < g["ratio"] < 1


def test_a_crash_shows_restart_badput_and_retrained_steps(tmp_path, cli, quiet_env):
    run, textfile = tmp_path / "run", tmp_path / "metrics" / "run.prom"
    started = time.time()
    code, events, err = _finish(_start(run, overrides=[f'run.metrics_textfile="{textfile}"'], fake=[
        "--steps", "60", "--step-s", "0.03", "--interval", "10", "--save-s", "0.02", "--crash-at", "35",
        "--fault-generations", "1"]))
    wall = time.time() - started
    assert code == 0, err
    g = RunState.load(run).goodput
    _ledger_sums_to_its_wall(g)
    assert g["wall_s"] <= wall + 1.0                    # never more than the run took
    assert g["high_step"] == 60 and g["steps"] == 60
    assert g["retrained_steps"] == 5                    # 31-35 again after the restart from checkpoint 30
    b = g["badput_s"]
    assert b["retrained"] > 0 and b["checkpoint"] > 0
    # the restart costs its time (the fake rank's new process alone takes ~0.2 s): how it splits among teardown,
    # start and compile depends on when late step claims were credited (they come first, and under load one
    # of the three read 0 in a full-suite run), not on anything a user reads
    assert sum(b[c] for c in ("teardown", "start", "restore", "compile")) > 0.1, b
    assert b["paused"] == b["waiting_for_machines"] == b["daemon_down"] == b["validation"] == 0

    ledgers = _named(events, "goodput")                 # told as it grew: never down
    assert len(ledgers) >= 3
    for before, after in zip(ledgers, ledgers[1:]):
        assert after["productive_s"] >= before["productive_s"]
        assert all(after["badput_s"][c] >= before["badput_s"][c] for c in CAUSES)

    status = subprocess.run([*cli, "status", str(run), "--json"], capture_output=True, text=True, timeout=60,
                            env={**quiet_env, "PYTHONPATH": str(ROOT)})
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)["goodput"]
    assert shown["ratio"] == pytest.approx(g["ratio"], abs=0.001) and shown["largest_losses"]
    assert shown["restart_s"] == pytest.approx(sum(b[c] for c in RESTART), abs=0.01)
    text = subprocess.run([*cli, "status", str(run)], capture_output=True, text=True, timeout=60,
                          env={**quiet_env, "PYTHONPATH": str(ROOT)}).stdout
    (row,) = [line for line in text.splitlines() if line.startswith("goodput")]
    assert f"{100 * g['ratio']:.1f}%" in row and "largest losses: " in row

    prom = textfile.read_text()
    assert f'llm_pretrain_goodput_ratio{{run="run"}} {g["ratio"]!r}' in prom
    assert all(f'llm_pretrain_badput_seconds_total{{run="run",cause="{c}"}}' in prom for c in CAUSES)
    assert 'llm_pretrain_productive_seconds{run="run"}' in prom


def test_a_daemon_killed_with_sigkill_and_started_again_keeps_its_ledger(tmp_path):
    run = tmp_path / "run"
    fake = ["--steps", "140", "--step-s", "0.05", "--interval", "5"]
    first = _start(run, fake=fake)
    _wait(lambda: (RunState.load(run).goodput.get("high_step") or 0) >= 40, "40 steps in the saved ledger")
    first.send_signal(signal.SIGKILL)
    first.communicate()
    killed = RunState.load(run).goodput           # what the killed daemon had saved
    time.sleep(1.0)                               # away a second at least: daemon_down
    code, events, err = _finish(_start(run, fake=fake))
    assert code == 0, err
    after = RunState.load(run).goodput
    _ledger_sums_to_its_wall(after)
    assert after["productive_s"] >= killed["productive_s"]
    assert all(after["badput_s"][c] >= killed["badput_s"][c] for c in CAUSES)
    assert after["badput_s"]["daemon_down"] >= 1.0
    assert after["high_step"] == 140 and after["retrained_steps"] >= 0
    (said,) = [e for e in _named(events, "goodput") if "daemon_down_s" in e]   # the new daemon said what it found
    assert said["daemon_down_s"] >= 1.0

    # the run's whole ledger, as the event log says it across both daemons: never down
    ledgers = _logged(run, "goodput")
    for before, later in zip(ledgers, ledgers[1:]):
        assert later["productive_s"] >= before["productive_s"]
        assert all(later["badput_s"][c] >= before["badput_s"][c] for c in CAUSES)


def test_a_stopped_run_started_again_counts_no_time_between_its_daemons(tmp_path):
    run = tmp_path / "run"
    code, _, err = _finish(_start(run, fake=["--steps", "20", "--step-s", "0.02"]))
    assert code == 0, err
    finished = RunState.load(run).goodput
    time.sleep(1.0)
    code, _, err = _finish(_start(run, fake=["--steps", "30", "--step-s", "0.02"]))
    assert code == 0, err
    after = RunState.load(run).goodput
    assert after["badput_s"]["daemon_down"] == 0
    assert after["high_step"] == 30 and after["productive_s"] > finished["productive_s"]
