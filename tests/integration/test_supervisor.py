"""The real supervisor against the stdlib fake worker: crash, hang, crash loop, stop, lock, orphans."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from daemon.records.state import RunState

ROOT = Path(__file__).resolve().parents[2]
FAST = ["health.restart_backoff_initial_s=0.1", "health.restart_backoff_max_s=0.5", "run.kill_grace_s=2"]


def _start(run_dir, overrides=(), fake=(), ranks=1, env=None, config=None):
    sets = [f'run.dir="{run_dir}"', *FAST, *overrides]
    if ranks > 1:
        sets += [f"parallel.dp={ranks}", f"train.micro_batch={8 // ranks}"]
    args = sum((["--set", s] for s in sets), ["--config", str(config)] if config else [])
    env = dict(os.environ if env is None else env, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "tests.integration.supervise_fake", *args, "--", *fake],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc, timeout=60):
    out, err = proc.communicate(timeout=timeout)
    events = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    return proc.returncode, events, err


def _named(events, name):
    return [e for e in events if e["event"] == name]


def _logged(run, name):
    """The events named `name` in the run's events.jsonl so far (complete lines only)."""
    path = run / "logs" / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in (json.loads(l) for l in lines if l.endswith("}")) if e["event"] == name]


def _has_stepped(run, rank):
    log = run / "logs" / f"rank-{rank}.log"
    return log.exists() and '"kind": "step"' in log.read_text()


def _wait(predicate, what, timeout_s=60.0):
    """Polls until `predicate()` holds: the deadline only keeps a broken run from hanging the tests."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_clean_run_finishes_with_0(tmp_path):
    code, events, err = _finish(_start(tmp_path / "run", fake=["--steps", "12"], ranks=2))
    assert code == 0, err
    assert RunState.load(tmp_path / "run").last_progress["step"] == 12      # `status` tells the last step
    assert _named(events, "daemon_exit")[0]["reason"] == "finished"
    assert len(_named(events, "generation_start")) == 1
    assert RunState.load(tmp_path / "run").status == "finished"
    logs = sorted(p.name for p in (tmp_path / "run" / "logs").iterdir())
    assert logs == ["events.jsonl", "rank-0.log", "rank-1.log"]
    assert all(set(e) >= {"ts", "level", "event", "run", "generation"} for e in events)


def test_crash_restarts_from_the_latest_checkpoint(tmp_path):
    code, events, err = _finish(_start(tmp_path / "run", fake=["--steps", "20", "--crash-at", "12",
                                                               "--rank-faults", "1", "--fault-generations", "1"],
                                       ranks=2))
    assert code == 0, err
    crash = _named(events, "crash")[0]
    assert (crash["rank"], crash["exit_code"], crash["generation"]) == (1, 1, 1)
    restart = _named(events, "restart")[0]
    # the fake ranks share no collective: rank 0 (the one that saves) is wherever it got to when the
    # generation was torn down, and saved there too; the newest of its saves is where the run goes on from
    logged = [json.loads(l) for l in (tmp_path / "run" / "logs" / "rank-0.log").read_text().splitlines()
              if l.startswith("{")]
    saved = [e["step"] for e in logged if e["kind"] == "checkpoint" and e["generation"] == 1 and e["stage"] == "committed"]
    assert restart["cause"] == "crash" and restart["rank"] == 1 and restart["resume_step"] == max(saved, default=0)
    starts = _named(events, "generation_start")
    assert [s["generation"] for s in starts] == [1, 2] and starts[1]["resume_step"] == restart["resume_step"]
    state = RunState.load(tmp_path / "run")
    assert state.restarts == 1 and state.incidents[0].kind == "crash" and state.incidents[0].incident.rank == 1


def test_death_by_signal_is_a_crash(tmp_path):
    code, events, _ = _finish(_start(tmp_path / "run", fake=["--steps", "15", "--signal-at", "7",
                                                             "--fault-generations", "1"]))
    assert code == 0
    assert _named(events, "crash")[0]["cause"] == "killed by signal 9"


def test_hang_is_detected_stacks_dumped_and_restarted(tmp_path):
    run = tmp_path / "run"
    code, events, err = _finish(_start(run, overrides=["health.hang_floor_s=1.5", "health.hang_step_multiplier=5"],
                                       fake=["--steps", "20", "--hang-at", "8", "--fault-generations", "1"]))
    assert code == 0, err
    hang = _named(events, "hang")[0]
    assert hang["rank"] == 0 and hang["phase"] == "train" and hang["step"] == 8
    assert hang["waited_s"] >= 1.5 and hang["timeout_s"] == 1.5          # not before the floor
    print(f"hang detected after {hang['waited_s']} s (timeout {hang['timeout_s']} s)")
    log = (run / "logs" / "rank-0.log").read_text()
    assert "most recent call first" in log and "fake_worker.py" in log          # faulthandler's dump
    assert _named(events, "restart")[0]["cause"] == "hang"


def test_no_false_alarm_during_a_slow_start(tmp_path):
    # 2.5 s before the first event, with a 1 s training floor: the start timeout applies, not the floor
    code, events, _ = _finish(_start(tmp_path / "run", overrides=["health.hang_floor_s=1.0"],
                                     fake=["--steps", "5", "--start-delay-s", "2.5"]))
    assert code == 0 and not _named(events, "hang")


def test_crash_loop_gives_up_with_3(tmp_path):
    code, events, _ = _finish(_start(tmp_path / "run", overrides=["health.max_restarts_without_progress=3"],
                                     fake=["--die-at-start"]))
    assert code == 3
    assert len(_named(events, "crash")) == 3 and len(_named(events, "restart")) == 2
    gave_up = _named(events, "gave_up")[0]
    assert gave_up["code"] == 3 and gave_up["restarts_without_progress"] == 3
    assert RunState.load(tmp_path / "run").status == "gave_up"
    # why the rank died is said without opening its log: in each crash, the incident and the daemon's last word
    why = "RuntimeError: the model's safetensors header is not JSON (dying at start, as asked)"
    assert all(e["error"] == why for e in _named(events, "crash"))
    assert all(why in e["detail"] for e in _named(events, "incident"))
    assert why in _named(events, "daemon_exit")[0]["detail"] and "restarts without" in _named(events, "daemon_exit")[0]["detail"]
    # the run's first restart is at once (a fault that has not repeated); the one after it, without progress, waits
    first, second = _named(events, "restart")
    assert first["backoff_s"] == 0.0 and second["backoff_s"] >= 0.1 and second["restarts_without_progress"] == 2


def test_sigterm_stops_with_a_checkpoint_and_0(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, fake=["--steps", "100000", "--step-s", "0.02", "--interval", "100000"], ranks=2)
    _wait(lambda: _has_stepped(run, 0) and _has_stepped(run, 1), "both ranks training")
    proc.send_signal(signal.SIGTERM)
    code, events, err = _finish(proc)
    assert code == 0, err
    assert _named(events, "command_sent")[0]["name"] == "stop"
    assert _named(events, "daemon_exit")[0]["reason"] == "stopped"
    # the fake's ranks are not in lockstep (real ranks agree on the stop step): rank 0's own last step
    exits = [json.loads(l) for l in (run / "logs" / "rank-0.log").read_text().splitlines() if '"exit"' in l]
    assert RunState.load(run).last_progress["step"] == exits[-1]["step"]       # not the step of the last 10 s
    # the exit names the step the ranks ended at (the furthest: under load the fake ranks drift apart)
    last = [json.loads(l)["step"] for r in (0, 1) for l in (run / "logs" / f"rank-{r}.log").read_text().splitlines()
            if '"exit"' in l]
    assert _named(events, "daemon_exit")[0]["step"] == max(last)
    assert list((run / "checkpoints").glob("step-*")), "no final checkpoint"


def test_a_second_daemon_on_the_same_run_exits_5(tmp_path):
    run = tmp_path / "run"
    first = _start(run, fake=["--steps", "100000"])
    _wait(lambda: _logged(run, "generation_start"), "the first daemon's generation")     # it holds the lock
    before = (run / "logs" / "events.jsonl").read_text()
    code, events, _ = _finish(_start(run, fake=["--steps", "3"]))
    during = (run / "logs" / "events.jsonl").read_text()
    first.send_signal(signal.SIGTERM)
    _finish(first)
    assert code == 5
    assert _named(events, "locked")[0]["detail"].startswith("run directory is in use")
    assert '"locked"' not in during and during.startswith(before), "the second daemon wrote into the live run's log"


def test_a_lock_file_that_cannot_be_opened_is_a_config_error_78(tmp_path):
    run = tmp_path / "run"
    (run / "daemon.lock").mkdir(parents=True)                  # opening it for writing fails (even as root)
    code, events, _ = _finish(_start(run, fake=["--steps", "3"]))
    assert code == 78
    (exit_event,) = _named(events, "daemon_exit")
    assert exit_event["code"] == 78 and "cannot take the run's lock" in exit_event["detail"]
    assert not (run / "logs").exists() and not (run / "state.json").exists()


def test_editing_the_operators_config_mid_run_changes_nothing_until_the_daemon_restarts(tmp_path):
    run, toml = tmp_path / "run", tmp_path / "op.toml"
    toml.write_text("[optim]\nlr = 0.002\n")
    proc = _start(run, config=toml, fake=["--steps", "40", "--interval", "5", "--start-delay-s", "1",
                                          "--crash-at", "12", "--fault-generations", "1"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (run / "logs" / "rank-0.log").exists():
        time.sleep(0.05)
    toml.write_text("[optim]\nlr = 0.5\n")                     # the operator edits the file mid-run
    code, events, err = _finish(proc)
    assert code == 0, err
    assert [s["generation"] for s in _named(events, "generation_start")] == [1, 2]   # the crash restarted it
    configs = [l for l in (run / "logs" / "rank-0.log").read_text().splitlines() if l.startswith("config ")]
    assert len(configs) == 2 and all("optim.lr=0.002 " in l and "config.resolved.toml" in l for l in configs)
    assert "lr = 0.002\n" in (run / "config.resolved.toml").read_text()


def test_ranks_of_a_killed_daemon_checkpoint_and_stop_within_seconds(tmp_path):
    """The kernel's parent-death signal: SIGKILL the daemon, and its ranks save at the next step and exit."""
    run = tmp_path / "run"
    first = _start(run, fake=["--steps", "100000", "--interval", "100000"], ranks=2)
    _wait(lambda: _has_stepped(run, 0) and _has_stepped(run, 1) and _logged(run, "standby_started"),
          "both ranks training and a standby")
    processes = RunState.load(run).processes
    ranks = [r for r in processes if not r.get("standby")]
    assert len(ranks) == 2 and len(processes) == 4           # and the next generation's, on standby
    first.send_signal(signal.SIGKILL)
    first.communicate()
    # they stop by themselves (100000 steps would take an hour): the deadline only bounds a failure
    _wait(lambda: not any(_runs_fake_worker(r["pid"]) for r in processes), "the ranks to stop")
    alive = [r["pid"] for r in processes if Path(f"/proc/{r['pid']}").exists() and
             "fake_worker" in Path(f"/proc/{r['pid']}/cmdline").read_text()]
    assert not alive, f"ranks {alive} trained on unsupervised"
    for r in (0, 1):
        ends = [json.loads(l) for l in (run / "logs" / f"rank-{r}.log").read_text().splitlines()
                if l.startswith("{") and '"kind": "exit"' in l]
        assert ends and ends[-1]["reason"] == "stopped"
    assert list((run / "checkpoints").glob("step-*")), "no final checkpoint"


def _runs_fake_worker(pid: int) -> bool:
    """The process runs the fake worker still (a zombie no one reaps runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z" and "fake_worker" in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:                  # gone, or exited between the open and the read (ESRCH)
        return False


def test_sighup_reopens_the_log_and_the_run_goes_on(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, fake=["--steps", "100000", "--interval", "100000"])
    log = run / "logs" / "events.jsonl"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (run / "logs" / "rank-0.log").exists():
        time.sleep(0.05)
    log.rename(log.with_name("events.jsonl.rotated"))          # what logrotate does, then SIGHUP
    proc.send_signal(signal.SIGHUP)
    _wait(lambda: _logged(run, "log_reopened") or proc.poll() is not None, "the log reopened")
    assert proc.poll() is None, "SIGHUP ended the daemon"
    proc.send_signal(signal.SIGTERM)
    code, events, err = _finish(proc)
    assert code == 0, err
    assert _named(events, "log_reopened") and _named(events, "daemon_exit")[0]["reason"] == "stopped"
    reopened = [json.loads(l)["event"] for l in log.read_text().splitlines()]
    assert reopened[0] == "log_reopened" and "daemon_exit" in reopened


def test_killed_daemon_orphans_are_cleaned_up_and_the_run_continues(tmp_path):
    # ranks that ignore SIGTERM (stuck where no handler runs) outlive the parent-death signal
    run = tmp_path / "run"
    first = _start(run, fake=["--steps", "100000", "--interval", "10", "--ignore-term"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any((run / "checkpoints").glob("step-*")) \
            if (run / "checkpoints").exists() else time.monotonic() < deadline:
        time.sleep(0.1)
    recorded = RunState.load(run).processes
    orphans = [o for o in recorded if not o.get("standby")]     # a standby exits when its pipe closes
    assert orphans, "the daemon recorded no worker processes"
    first.send_signal(signal.SIGKILL)
    first.communicate()
    assert all(Path(f"/proc/{o['pid']}").exists() for o in orphans)          # the workers outlived it
    code, events, err = _finish(_start(run, fake=["--steps", "30", "--interval", "10"]), timeout=60)
    assert code == 0, err
    assert _named(events, "orphans_killed")[0]["pids"] == [o["pid"] for o in orphans]
    assert not any(Path(f"/proc/{o['pid']}").exists() and
                   "fake_worker" in Path(f"/proc/{o['pid']}/cmdline").read_text() for o in recorded)
    assert _named(events, "generation_start")[0]["generation"] == 2               # continues the run's count
    assert _named(events, "generation_start")[0]["resume_step"] >= 10


def test_a_killed_daemons_ranks_that_saved_are_not_waited_for_while_they_tear_down(tmp_path):
    """They save on the parent-death signal and log their exit; what follows (a second of MindSpore's
    teardown, here a minute) is not waited for: the next daemon ends them, does not count them as
    killed, and resumes from their save."""
    run = tmp_path / "run"
    # a grace far longer than the wait below: waiting it out would fail the test, not slow it down
    first = _start(run, fake=["--steps", "100000", "--interval", "100000", "--linger-s", "3600"], ranks=2,
                   overrides=["run.kill_grace_s=600", "run.standby=false"])
    deadline = time.monotonic() + 30
    ranks = []
    # both training (a rank that has not yet set its SIGTERM handler dies of the parent-death signal with
    # nothing to save: under load rank 0 can be that far behind rank 1), and recorded by the daemon (a rank
    # may step before its daemon has written state.json: killed then, the next daemon could not know them)
    logs = [run / "logs" / f"rank-{r}.log" for r in (0, 1)]
    while not all(f.exists() and '"kind": "step"' in f.read_text() for f in logs) \
            or len(ranks := [o for o in RunState.load(run).processes if o["role"] == "rank"]) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.communicate()
    code, events, err = _finish(_start(run, fake=["--steps", "3"], ranks=2,
                                       overrides=["run.kill_grace_s=600", "run.standby=false"]), timeout=300)
    assert code == 0, err
    assert not _named(events, "orphans_killed")               # they had finished, not been killed
    assert not any(Path(f"/proc/{o['pid']}").exists() and
                   "fake_worker" in Path(f"/proc/{o['pid']}/cmdline").read_text() for o in ranks)
    saved = [json.loads(l)["step"] for l in (run / "logs" / "rank-0.log").read_text().splitlines()
             if l.startswith("{") and json.loads(l).get("kind") == "exit"][0]
    assert _named(events, "generation_start")[0]["resume_step"] == saved


def test_an_orphan_that_exited_unreaped_is_not_waited_for():
    """A killed daemon's rank that saved and exited stays a zombie until PID 1 reaps it, which in a
    container may be never: it has exited, so the next daemon neither waits out its grace for it
    nor counts it as killed."""
    from daemon.processes.generation import is_running, kill_orphans, start_ticks

    child = subprocess.Popen(["true"])
    stat = Path(f"/proc/{child.pid}/stat")
    deadline = time.monotonic() + 10
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    record = {"role": "rank", "rank": 0, "pid": child.pid, "pgid": child.pid, "start_ticks": start_ticks(child.pid)}
    try:
        assert not is_running(record) and is_running({"pid": os.getpid(), "start_ticks": start_ticks(os.getpid())})
        assert kill_orphans([record], grace_s=60) == []
    finally:
        child.wait()


def test_a_worker_config_error_is_passed_on_not_retried(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    refuse = ("import sys; print('loading'); print('llm-pretrain: config error: model.init_from: x does not match "
              "the config: rope_theta', file=sys.stderr); sys.exit(78)")
    code = subprocess.run([sys.executable, "-c", (
        "import sys; from daemon.supervisor import Supervisor; from contracts.config import load_config; "
        f"cfg = load_config(None, ['run.dir=\"{run}\"']); "
        f"sys.exit(Supervisor(cfg, worker_cmd=[sys.executable, '-c', {refuse!r}], "
        "scheduler_cmd=None).run())")], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert code.returncode == 78, code.stderr
    events = [json.loads(line) for line in code.stdout.splitlines() if line.startswith("{")]
    assert not [e for e in events if e["event"] == "restart"]
    last = events[-1]
    assert last["event"] == "daemon_exit" and last["code"] == 78 and last["reason"] == "worker_error"
    # the rank's own reason, not only "see its log"
    assert "rank 0 ended with exit code 78: config error: model.init_from: x does not match the config: rope_theta" \
        in last["detail"] and "rank-0.log" in last["detail"]


def test_the_resume_step_reported_is_one_the_ranks_can_load(tmp_path):
    """A committed directory whose manifest is gone is not named as the resume point (the ranks would
    set it aside and load the one before)."""
    run = tmp_path / "run"
    code, _, err = _finish(_start(run, fake=["--steps", "20", "--interval", "5"]))
    assert code == 0, err
    (run / "checkpoints" / "step-00000020" / "manifest.json").unlink()
    code, events, err = _finish(_start(run, fake=["--steps", "25", "--interval", "5"]))
    assert code == 0, err
    assert _named(events, "daemon_start")[0]["last_committed_step"] == 15
    assert _named(events, "generation_start")[0]["resume_step"] == 15


def test_a_run_directory_that_refuses_the_generation_s_files_is_a_crash_loop_not_a_traceback(tmp_path):
    run = tmp_path / "run"
    (run / "config.resolved.toml").mkdir(parents=True)      # the resolved config cannot be written there
    code, events, err = _finish(_start(run, overrides=["health.max_restarts_without_progress=2"],
                                       fake=["--steps", "3"]))
    assert code == 3 and "Traceback" not in err
    crashes = _named(events, "incident")
    assert len(crashes) == 2 and "cannot write the generation's files" in crashes[0]["detail"]
