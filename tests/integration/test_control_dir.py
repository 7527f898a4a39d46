"""The control directory with the real supervisor and the fake worker: requests take effect,
garbage is reported and never crashes the daemon, an unsafe directory is refused."""
import time

from tests.integration.test_supervisor import _finish, _logged, _named, _start, _wait


def _wait_for(path, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not path.exists():
        time.sleep(0.05)
    assert path.exists(), f"{path} never appeared"


def test_garbage_is_reported_and_ignored_then_a_stop_file_stops_with_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, fake=["--steps", "100000", "--interval", "100000"])
    _wait_for(run / "logs" / "rank-0.log")
    control = run / "control"
    (control / "reboot").write_text("")                       # unknown name: reported once, left alone
    (control / "checkpoint").write_text("{not json")          # malformed body: renamed aside
    (control / "inject").write_text('{"fault": "nan"}')       # drills are off by default
    _wait(lambda: len(_logged(run, "control_rejected")) >= 3 or proc.poll() is not None, "the garbage rejected")
    assert proc.poll() is None, "garbage in the control directory ended the daemon"
    (control / "stop").write_text('{"reason": "maintenance"}')
    code, events, err = _finish(proc)
    assert code == 0, err
    rejected = {e["file"]: e["detail"] for e in _named(events, "control_rejected")}
    assert set(rejected) == {"reboot", "checkpoint", "inject"}
    assert "unknown control file" in rejected["reboot"] and "allow_fault_injection" in rejected["inject"]
    assert (control / "reboot").exists() and (control / ".checkpoint.rejected").exists()
    assert not (control / "stop").exists() and not (control / "inject").exists()
    assert "maintenance" in _named(events, "stopping")[0]["detail"]
    assert _named(events, "daemon_exit")[0]["reason"] == "stopped"
    assert list((run / "checkpoints").glob("step-*")), "no final checkpoint"


def test_a_world_writable_control_directory_is_refused_with_78(tmp_path):
    run = tmp_path / "run"
    (run / "control").mkdir(parents=True)
    (run / "control").chmod(0o777)
    code, events, _ = _finish(_start(run, fake=["--steps", "3"]))
    assert code == 78
    assert "world-writable" in _named(events, "daemon_exit")[0]["detail"]


def test_an_inject_request_becomes_a_command(tmp_path, cli, quiet_env):
    import subprocess

    run = tmp_path / "run"
    (run / "control").mkdir(parents=True, mode=0o750)
    done = subprocess.run([*cli, "inject", "hang", str(run), "--rank", "0", "--at-step", "5", "--seconds", "1", "--queue"],
                          env=quiet_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    code, events, err = _finish(_start(run, overrides=["health.allow_fault_injection=true"],
                                       fake=["--steps", "10"]))
    assert code == 0, err
    sent = _named(events, "command_sent")[0]
    assert sent["name"] == "inject" and sent["args"] == {"fault": "hang", "rank": 0, "at_step": 5, "seconds": 1.0}
    assert not list((run / "control").iterdir())


def test_churn_links_directories_fifos_and_huge_bodies_never_crash_or_block_the_daemon(tmp_path):
    """Another process creates and deletes files as fast as it can while the daemon scans; a symlink
    named like a request is never followed (even to an empty file), a directory and a FIFO are
    reported, a 64 GiB sparse body is refused without being read."""
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    proc = _start(run, fake=["--steps", "100000", "--interval", "100000"])
    _wait_for(run / "logs" / "rank-0.log")
    control = run / "control"
    churn = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "d, end = sys.argv[1], time.monotonic() + 6\n"
        "i = 0\n"
        "while time.monotonic() < end:\n"
        "    for name in (f'zz{i}', f'checkpoint.{i}'):\n"
        "        p = os.path.join(d, name)\n"
        "        try:\n"
        "            with open(p, 'w') as f: f.write('{}')\n"
        "            os.unlink(p)\n"
        "        except OSError: pass\n"
        "    i += 1\n"), str(control)])
    (tmp_path / "empty").write_text("")
    os.symlink(tmp_path / "empty", control / "pause.empty")
    (control / "resume").mkdir()
    os.mkfifo(control / "stop.fifo")
    with open(control / "checkpoint.huge", "wb") as f:
        f.truncate(64 << 30)
    churn.wait(timeout=30)
    odd = {"pause.empty", "resume", "stop.fifo", "checkpoint.huge"}
    _wait(lambda: odd <= {e["file"] for e in _logged(run, "control_rejected")} or proc.poll() is not None,
          "the odd files rejected")
    assert proc.poll() is None, "the control directory ended the daemon"
    (control / "stop").write_text("")
    code, events, err = _finish(proc)
    assert code == 0, err
    assert "Traceback" not in err
    rejected = {e["file"]: e["detail"] for e in _named(events, "control_rejected")}
    assert "symbolic link" in rejected["pause.empty"] and "directory" in rejected["resume"]
    assert "FIFO" in rejected["stop.fifo"] and "longer than 65536 bytes" in rejected["checkpoint.huge"]
    assert not [e for e in _named(events, "command_sent") if e["name"] == "pause"], "a symlink was acted on"
    assert (control / ".pause.empty.rejected").is_symlink() and (control / ".stop.fifo.rejected").exists()
