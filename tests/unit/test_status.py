"""`status` tells the truth: an ETA from the recent mean step time, elapsed time, what recovery keeps
in force, and a loud warning when the daemon is dead but processes of its run are not."""
import json
import os

from daemon.generation import start_ticks
from daemon.status_cli import render, summary

DEAD_PID = 2 ** 22 + 12345          # above pid_max's default: never a live process


def _state(run, **fields):
    base = {"status": "running", "total_steps": 1000, "daemon_pid": os.getpid(), "started_unix_s": 1000.0,
            "last_progress": {"step": 400, "loss": 2.5, "tokens_per_s": 9000.0, "tokens": 512, "unix_s": 4600.0,
                              "mean_step_s": 0.25}}
    (run / "state.json").write_text(json.dumps({**base, **fields}))


def test_eta_is_the_recent_mean_step_time_times_the_steps_left(tmp_path):
    _state(tmp_path)
    s = summary(tmp_path, now=4601.0)
    assert s["eta_s"] == 600 * 0.25 and s["elapsed_s"] == 3601.0
    text = render(s)
    assert "ETA              2m30s  (0.250 s/step, recent mean)" in text and "elapsed          1h00m" in text


def test_paused_says_so_instead_of_an_eta(tmp_path):
    _state(tmp_path, status="paused")
    s = summary(tmp_path, now=4601.0)
    assert s["eta_s"] is None and "ETA              paused" in render(s)


def test_what_recovery_keeps_in_force_is_shown(tmp_path):
    recovery = {"checkpoint_step": 300, "skip_ranges": [[100, 140]], "quarantined_blocks": [["tokens-00001.bin", 3]],
                "lr_overrides": [{"start_step": 301, "factor": 0.5, "hold_steps": 200, "ramp_steps": 200}],
                "loss_scale": None, "loss_scale_cap": 1024.0, "loss_scale_cap_until_step": 1300}
    _state(tmp_path, recovery=recovery)
    text = render(summary(tmp_path, now=4601.0))
    assert "lr override      x0.5 from step 301, held 200, ramped back over 200" in text
    assert "loss scale cap   1024 until step 1300" in text
    assert "1 skipped sample window(s), 1 quarantined corpus block(s)" in text


def test_a_dead_daemon_with_live_processes_of_its_run_is_a_warning(tmp_path):
    me = {"pid": os.getpid(), "start_ticks": start_ticks(os.getpid()), "pgid": os.getpgid(0), "role": "rank",
          "rank": 0}
    _state(tmp_path, daemon_pid=DEAD_PID, processes=[me, {**me, "pid": DEAD_PID}])
    s = summary(tmp_path, now=4601.0)
    assert s["status"] == "running (daemon not running)" and s["unsupervised_pids"] == [os.getpid()]
    assert s["eta_s"] is None
    assert f"WARNING          the daemon is not running but processes of this run are: pids {os.getpid()}" in render(s)
    _state(tmp_path, processes=[me])                   # a live daemon: its own ranks, no warning
    assert summary(tmp_path, now=4601.0)["unsupervised_pids"] == []
