"""The warm standby against the stdlib fake worker: the next generation's processes start while one
trains, wait, and become the ranks of the generation after an incident (daemon/standby.py)."""
import json
import os
import signal
import time

import pytest

from tests.integration.test_recovery_policy import QUICK_HEALTH, _steps
from tests.integration.test_supervisor import _finish, _named, _start



def _logged(run, name):
    path = run / "logs" / "events.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == name] if path.exists() else []


def test_a_rollback_runs_on_the_standby_with_the_decision_made_after_it_started(tmp_path):
    run = tmp_path / "run"
    code, events, err = _finish(_start(run, overrides=QUICK_HEALTH, ranks=2, fake=[
        "--steps", "60", "--step-s", "0.05", "--interval", "5", "--spike-at", "30", "--fault-generations", "1"]))
    assert code == 0, err
    names = [e["event"] for e in events]
    assert names.index("standby_started") < names.index("standby_ready") < names.index("incident")
    started, gens = _named(events, "standby_started")[0], _named(events, "generation_start")
    assert [g["standby"] for g in gens] == [False, True]
    assert gens[1]["pids"] == started["pids"] and gens[1]["port"] == started["port"]
    # the lr cut and the skipped window were decided after the standby started: its activation carried them
    gen2 = [e for e in _steps(run / "logs" / "rank-1.log") if e["generation"] == 2]
    assert gen2[0]["step"] == 26 and gen2[-1]["step"] == 60 and all(e["lr_multiplier"] == 0.5 for e in gen2)
    # generation 2 keeps a standby of its own, retired when the run ends: no process outlives the daemon
    assert len(_named(events, "standby_started")) == 2
    for pid in _named(events, "standby_started")[1]["pids"].values():
        assert not os.path.exists(f"/proc/{pid}") or "fake_worker" not in open(f"/proc/{pid}/cmdline").read()


def test_a_standby_that_died_is_not_used(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, ranks=2, fake=["--steps", "200", "--step-s", "0.05", "--interval", "10",
                                      "--crash-at", "60", "--fault-generations", "1"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not _logged(run, "standby_ready"):
        time.sleep(0.05)
    os.kill(_logged(run, "standby_started")[0]["pids"]["1"], signal.SIGKILL)
    code, events, err = _finish(proc)
    assert code == 0, err
    (retired,) = _named(events, "standby_retired")
    assert "rank 1 ended (-9)" in retired["detail"] and "starting it cold" in retired["detail"]
    assert [g["standby"] for g in _named(events, "generation_start")] == [False, False]
    assert _named(events, "daemon_exit")[0]["reason"] == "finished"


def test_with_run_standby_off_every_generation_starts_cold(tmp_path):
    code, events, err = _finish(_start(tmp_path / "run", overrides=["run.standby=false"], fake=[
        "--steps", "30", "--interval", "5", "--crash-at", "10", "--fault-generations", "1"]))
    assert code == 0, err
    assert not _named(events, "standby_started")
    assert [g["standby"] for g in _named(events, "generation_start")] == [False, False]
