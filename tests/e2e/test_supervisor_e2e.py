"""`llm-pretrain run` with two real MindSpore ranks on the tiny config, and real faults."""
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from checkpointing import layout
from contracts.protocol import Command
from daemon.records.state import RunState
from tests.e2e.cluster import daemon_events as _events
from tests.e2e.cluster import mount_tmpfs
from tests.e2e.cluster import wait_for as _wait_for


def _daemon(cli, env, tmp_path, corpus, *extra, steps=60):
    run = tmp_path / "run"
    sets = [f'data.path="{corpus}"', f"train.steps={steps}", "checkpoint.interval_steps=10", "parallel.dp=2",
            "train.micro_batch=4", f'run.dir="{run}"', "health.restart_backoff_initial_s=0.2",
            "health.restart_backoff_max_s=1", "run.kill_grace_s=5", *extra]
    args = sum((["--set", s] for s in sets), [])
    proc = subprocess.Popen([*cli, "run", *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    return proc, run


def _named(events, name):
    return [e for e in events if e["event"] == name]


def _rank_steps(run: Path, rank: int) -> list[dict]:
    lines = (run / "logs" / f"rank-{rank}.log").read_text().splitlines()
    return [json.loads(l) for l in lines if l.startswith('{"data_wait_s"')]


def _last_step(run, rank=0):
    steps = _rank_steps(run, rank) if (run / "logs" / f"rank-{rank}.log").exists() else []
    return steps[-1]["step"] if steps else 0


STANDBY_STEPS = 300      # a standby forms its cluster while the first generation trains: ~10 s here


def _tiers(run: Path) -> dict[str, int]:
    """The newest step committed in each checkpoint tier of `run`, read from the tiers themselves (a
    rank logs a commit only at its next step, which a held rank never takes)."""
    newest = lambda root: max(layout.committed_steps(root), default=0) if root.is_dir() else 0
    return {"committed": newest(run / "checkpoints"), "in_memory": newest(layout.memory_root(run, "/dev/shm"))}


def _final_params(run: Path) -> set[str]:
    return {json.loads(l)["params_sha256"] for r in (0, 1) for l in (run / "logs" / f"rank-{r}.log").read_text().splitlines()
            if l.startswith('{"generation"') and '"exit"' in l and '"finished"' in l}


def _idle_threads(pid: int) -> list[int]:
    """The threads of process `pid` under SCHED_IDLE."""
    idle = []
    for name in os.listdir(f"/proc/{pid}/task"):
        try:
            if os.sched_getscheduler(int(name)) == os.SCHED_IDLE:
                idle.append(int(name))
        except ProcessLookupError:          # ended meanwhile
            pass
    return idle


def test_kill_9_of_a_rank_is_survived_on_the_warm_standby_from_the_ram_tier_bit_exact(cli, quiet_env, tmp_path,
                                                                                     stdlib_corpus):
    proc, run = _daemon(cli, quiet_env, tmp_path, stdlib_corpus, "checkpoint.memory_interval_steps=3",
                        "health.allow_fault_injection=true", steps=STANDBY_STEPS)
    _wait_for(lambda: _last_step(run) >= 25 and _named(_events(run), "standby_ready"), what="step 25 and a standby")
    # the standby imported on idle CPU only (engine/rank/idle_cpu.py), and once ready every thread of it (MindSpore's
    # pools were started while it was idle) is back to normal scheduling
    standby_pids = _named(_events(run), "standby_started")[0]["pids"]
    assert {r: _idle_threads(pid) for r, pid in standby_pids.items()} == {r: [] for r in standby_pids}
    # kill while the RAM tier holds the newest checkpoint, a few steps before the next disk save: rank 1 is
    # held (a hang drill) before step `hold`, so the run cannot move on past that state while the kill is
    # on its way; the drill is asked for well ahead of the step, so every rank has agreed on it by then
    hold = next(s for s in range(_last_step(run) + 40, STANDBY_STEPS) if (s - 1) % 3 == 0 and (s - 1) % 10 in (3, 6))
    with open(run / "commands.jsonl", "a") as f:
        f.write(Command(seq=1, name="inject", args={"fault": "hang", "rank": 1, "at_step": hold,
                                                    "seconds": 3600}).to_json() + "\n")
    rank_1_log = run / "logs" / "rank-1.log"
    _wait_for(lambda: "drill: hanging" in rank_1_log.read_text(), what=f"rank 1 held before step {hold}")
    assert f"hang at step {hold} " in rank_1_log.read_text(), "the drill was agreed too late for this test's setup"
    # what the tiers hold at the kill: the RAM tier the step before the hold, the disk the interval save
    # before that (both settle there: no rank steps past the hold)
    at_kill = {"committed": (hold - 1) // 10 * 10, "in_memory": hold - 1}
    _wait_for(lambda: _tiers(run) == at_kill, timeout_s=45, what=f"the tiers to hold {at_kill}")   # hung at 60 s
    victim = next(p for p in RunState.load(run).processes if p["rank"] == 1 and not p.get("standby"))
    crashed_at = _last_step(run)
    os.kill(victim["pid"], signal.SIGKILL)
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-2000:]
    events = _events(run)
    crash = _named(events, "crash")[0]
    assert crash["rank"] == 1 and crash["cause"] == "killed by signal 9" and crash["step"] <= hold - 1
    restart = _named(events, "restart")[0]
    assert restart["cause"] == "crash" and restart["rank"] == 1
    assert restart["resume_step"] == at_kill["in_memory"]          # what the ranks restore: the RAM tier's newest
    assert _named(events, "daemon_exit")[0]["reason"] == "finished"
    assert layout.committed_steps(run / "checkpoints")[-1] == STANDBY_STEPS
    start = _named(events, "generation_start")[1]
    assert start["standby"] is True and start["pids"] == _named(events, "standby_started")[0]["pids"]
    # from the RAM tier's newest commit (every 3 steps), where the disk's (every 10) would have cost more
    restored = next(e for e in _named(events, "checkpoint_restored") if e["generation"] == 2)
    assert restored["step"] == at_kill["in_memory"] == restart["resume_step"] > at_kill["committed"]
    assert start["resume_step"] == at_kill["in_memory"]
    assert restored["path"].startswith("/dev/shm/llm-pretrain-")
    assert not list(Path("/dev/shm").glob(f"llm-pretrain-{(run / '.run-id').read_text().strip()}"))  # freed at the end
    assert all("imported on idle CPU only (SCHED_IDLE)" in (run / "logs" / f"rank-{r}.log").read_text() for r in (0, 1))
    back = next(e for e in events if e["event"] == "first_step" and e["generation"] == 2)
    print(f"killed at step ~{crashed_at}, resumed from {restart['resume_step']}; "
          f"start-up on the standby {_named(events, 'compiling')[1]['startup_s']}, "
          f"crash event to the first step {_seconds(crash, back):.2f} s")
    assert "-1" not in start["pids"]            # a local group (parallel.local_reduce): no MindSpore scheduler
    if len(os.sched_getaffinity(0)) >= 2:       # parallel.bind_cores: each rank, every generation, on its own core(s)
        bound = {r: re.findall(r"local rank \d of 2 runs on cores ([\d,]+) \(every thread: (\w+)\)",
                               (run / "logs" / f"rank-{r}.log").read_text()) for r in (0, 1)}
        assert all(len(b) >= 2 and all(ok == "True" for _, ok in b) for b in bound.values()), bound
        assert not set(bound[0][-1][0].split(",")) & set(bound[1][-1][0].split(",")), bound
    # the standby's ranks, from a RAM checkpoint, train exactly what fresh ranks would: the same parameters as a
    # run never killed (with no RAM tier), and summing through MindSpore's cluster and AllReduce instead
    (tmp_path / "again").mkdir()
    again, reference = _daemon(cli, quiet_env, tmp_path / "again", stdlib_corpus, "run.standby=false",
                               "parallel.local_reduce=false", steps=STANDBY_STEPS)
    _, err = again.communicate(timeout=400)
    assert again.returncode == 0, err[-2000:]
    assert len(_final_params(run)) == 1 and _final_params(run) == _final_params(reference)


def _seconds(a: dict, b: dict) -> float:
    from datetime import datetime

    at = lambda e: datetime.fromisoformat(e["ts"].replace("Z", "+00:00")).timestamp()
    return at(b) - at(a)


def test_a_rank_that_stops_stepping_is_detected_and_restarted(cli, quiet_env, tmp_path, stdlib_corpus):
    proc, run = _daemon(cli, quiet_env, tmp_path, stdlib_corpus, "health.allow_fault_injection=true",
                        "health.hang_floor_s=5", "health.hang_step_multiplier=10", steps=40)
    _wait_for(lambda: _last_step(run) >= 12, what="step 12")
    with open(run / "commands.jsonl", "a") as f:      # what `llm-pretrain inject hang` will write
        f.write(Command(seq=1, name="inject", args={"fault": "hang", "rank": 1, "seconds": 3600}).to_json() + "\n")
    injected = time.monotonic()
    _wait_for(lambda: _named(_events(run), "hang"), what="the hang to be detected")
    latency = time.monotonic() - injected
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-2000:]
    hang = _named(_events(run), "hang")[0]
    # the timeout adapts to the step time (10 steps, at least the 5 s floor): on a loaded machine it is above
    # the floor; what holds whatever the load is that the hang is never declared before it
    assert hang["phase"] == "train" and hang["waited_s"] >= hang["timeout_s"] >= 5
    for rank in (0, 1):     # every live rank's Python stacks, from faulthandler, in its log
        dump = (run / "logs" / f"rank-{rank}.log").read_text().split("most recent call first", 1)
        assert len(dump) == 2, f"no stack dump in rank {rank}'s log"
        assert re.search(r'engine/rank/trainer\.py", line \d+ in loop', dump[1][:5000]), dump[1][:2000]
    assert _named(_events(run), "restart")[0]["cause"] == "hang"
    print(f"hang detection latency: {latency:.1f} s after injection (waited {hang['waited_s']} s, "
          f"timeout {hang['timeout_s']} s)")


def test_a_rank_stopped_dead_is_named_with_its_phase_in_seconds(cli, quiet_env, tmp_path, stdlib_corpus):
    """Default health settings: rank 1 SIGSTOPped mid-run. Its phase board still says where it stopped while rank 0
    waits for it in the gradient sum: the hang is raised with rank 1 as the culprit and its phase after
    max(health.stall_floor_s = 10 s, 10 x p99 step) — not after the hang check's 60 s floor, nor naming rank 0,
    the one that waits — its kernel state read before the teardown, and the run trains on to its end."""
    proc, run = _daemon(cli, quiet_env, tmp_path, stdlib_corpus, "health.allow_fault_injection=true", steps=400)
    _wait_for(lambda: _last_step(run) >= 30, what="step 30")
    pid = next(p["pid"] for p in RunState.load(run).processes if p.get("role") == "rank" and p.get("rank") == 1)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    _wait_for(lambda: _named(_events(run), "hang"), what="the stopped rank to be named", timeout_s=120)
    latency = time.monotonic() - stopped
    # then rank 0 stuck inside a step's compute (the hang drill: as a kernel that never returns)
    _wait_for(lambda: len(_named(_events(run), "generation_start")) >= 2 and _last_step(run) >= 60, what="step 60")
    with open(run / "commands.jsonl", "a") as f:
        f.write(Command(seq=1, name="inject", args={"fault": "hang", "rank": 0, "seconds": 3600}).to_json() + "\n")
    _wait_for(lambda: len(_named(_events(run), "hang")) >= 2, what="the hung rank to be named", timeout_s=120)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    hang = _named(_events(run), "hang")[0]
    assert hang["rank"] == 1 and hang["culprits"] == [1] and hang["waiting"] == [0], hang
    assert hang["phase"] in ("data", "compute", "sum", "update", "between", "save"), hang
    assert hang["timeout_s"] >= 10 and hang["waited_s"] >= hang["timeout_s"]
    assert latency < 60, f"named {latency:.1f} s after the stop: no sooner than the hang check's floor"
    stacks = _named(_events(run), "stacks")[0]
    assert stacks["rank"] == 1 and stacks["state"].startswith("T"), stacks       # read while it was stopped
    assert _named(_events(run), "restart")[0]["cause"] == "hang"
    hung = _named(_events(run), "hang")[1]
    assert (hung["rank"], hung["phase"], hung["waiting"]) == (0, "compute", [1]), hung
    assert hung["waited_s"] < 60
    print(f"stopped rank named {latency:.1f} s after SIGSTOP (limit {hang['timeout_s']} s, phase {hang['phase']}); "
          f"the hung one after {hung['waited_s']} s in {hung['phase']}")


def test_kill_9_of_the_supervisor_then_restart(cli, quiet_env, tmp_path, stdlib_corpus):
    """Its ranks stop within seconds (the parent-death signal): they save at their next step and
    exit; a new daemon resumes from that commit and reaps whatever of the old generation is left (the
    scheduler ends by itself or is reaped). The kernel sends that signal once per daemon thread the
    rank is handed through, and MindSpore SIGTERMs a rank whose peer has exited: a rank that exited
    on a repeated SIGTERM lost this save, one kill in three (engine/contracts/stop_signal.py)."""
    proc, run = _daemon(cli, quiet_env, tmp_path, stdlib_corpus, steps=80)
    _wait_for(lambda: len(layout.committed_steps(run / "checkpoints")) >= 2, what="two checkpoints")
    old = RunState.load(run).processes
    ranks = [o for o in old if o["role"] == "rank"]
    at_kill = _last_step(run)
    proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    proc.communicate()
    _wait_for(lambda: not any(Path(f"/proc/{o['pid']}").exists() for o in ranks), timeout_s=60,
              what="the ranks of the killed daemon to stop")
    print(f"ranks stopped {time.monotonic() - killed_at:.1f} s after the daemon was killed")
    final = layout.committed_steps(run / "checkpoints")[-1]
    ends = [json.loads(l) for r in (0, 1) for l in (run / "logs" / f"rank-{r}.log").read_text().splitlines()
            if l.startswith('{"generation"') and '"exit"' in l]
    assert _last_step(run) == final                       # nothing trained on unsupervised: the last step saved
    # they saved: at one step, all of them
    assert [e["reason"] for e in ends] == ["stopped", "stopped"] and {e["step"] for e in ends} == {final}
    assert final >= at_kill
    again, _ = _daemon(cli, quiet_env, tmp_path, stdlib_corpus, steps=80)
    out, err = again.communicate(timeout=400)
    assert again.returncode == 0, err[-2000:]
    events = _events(run)
    reaped = [pid for e in _named(events, "orphans_killed") for pid in e["pids"]]
    assert not set(reaped) & {o["pid"] for o in ranks}
    assert set(reaped) <= {o["pid"] for o in old}
    starts = _named(events, "generation_start")
    assert starts[-1]["resume_step"] == final          # nothing trained since the last save was lost
    assert _named(events, "daemon_exit")[-1]["reason"] == "finished"


def test_sigterm_commits_a_final_checkpoint_and_exits_0(cli, quiet_env, tmp_path, stdlib_corpus):
    proc, run = _daemon(cli, quiet_env, tmp_path, stdlib_corpus, steps=100000)
    _wait_for(lambda: _last_step(run) >= 5, what="step 5")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    events = _events(run)
    assert _named(events, "daemon_exit")[0]["reason"] == "stopped"
    final = layout.committed_steps(run / "checkpoints")[-1]
    ends = [json.loads(l) for r in (0, 1) for l in (run / "logs" / f"rank-{r}.log").read_text().splitlines()
            if l.startswith('{"generation"') and '"exit"' in l]
    assert [e["reason"] for e in ends] == ["stopped", "stopped"] and {e["step"] for e in ends} == {final}


def test_a_clean_run_s_goodput_ledger_counts_the_loop_with_its_steps_and_the_ram_tier_as_checkpoint_time(
        cli, quiet_env, tmp_path, stdlib_corpus):
    """Tiny, the RAM tier every step: what the ranks do between steps (sending the step's event, reading the
    commands) is the steps' time and the RAM tier's saves are the checkpoint's — not `other`, which on a
    clean run is only what no rank said (before: the loop's work and every RAM save were `other`, 14 % of a
    clean run's time, measured)."""
    proc, run = _daemon(cli, quiet_env, tmp_path, stdlib_corpus, "checkpoint.memory_interval_steps=1", steps=400)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    g = RunState.load(run).goodput
    assert g["steps"] == 400 and g["retrained_steps"] == 0
    b = g["badput_s"]
    steps = [e for e in _rank_steps(run, 0) if e["generation"] == 1][1:]      # the first compiles
    assert all(e["loop_s"] > 0 for e in steps)
    ram = sum(e["memory_save_s"] for e in steps)
    assert ram > 0 and b["checkpoint"] >= 0.9 * ram              # every RAM save (and the disk saves' staging)
    assert b["other"] < 0.25 * b["checkpoint"]


def test_a_worker_that_always_dies_at_start_gives_up_with_3(cli, quiet_env, tmp_path, stdlib_corpus):
    broken = tmp_path / "broken"           # a broken environment: every rank dies as it starts
    broken.mkdir()
    (broken / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('LLM_PRETRAIN_GENERATION'):\n    os._exit(1)\n")   # every rank's, not the daemon's
    env = dict(quiet_env, PYTHONPATH=f"{broken}{os.pathsep}{quiet_env.get('PYTHONPATH', '')}")
    proc, run = _daemon(cli, env, tmp_path, stdlib_corpus, "health.max_restarts_without_progress=3")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err[-2000:]
    events = _events(run)
    assert len(_named(events, "crash")) == 3 and _named(events, "gave_up")[0]["code"] == 3


def test_a_full_disk_never_ends_the_daemon_and_saves_resume_when_space_returns(cli, quiet_env, tmp_path,
                                                                                stdlib_corpus):
    """The whole run directory (state.json, logs, checkpoints) on a 24 MiB tmpfs, filled to the last
    byte after two checkpoints: training goes on, a streak of failed saves is one warning, nothing
    leaks; space back, saves resume by themselves, and a stop commits a final checkpoint (exit 0)."""
    import threading

    run = tmp_path / "run"
    mount_tmpfs(run, "24m")
    events, filler = [], run / "filler"
    try:
        proc, _ = _daemon(cli, quiet_env, tmp_path, stdlib_corpus, "run.compile_cache=false",
                          "checkpoint.keep_last=2", steps=100000)
        reader = threading.Thread(target=lambda: events.extend(json.loads(l) for l in proc.stdout
                                                               if l.startswith("{")), daemon=True)
        reader.start()
        named = lambda name: [e for e in list(events) if e["event"] == name]
        _wait_for(lambda: len(named("checkpoint_committed")) >= 2, what="two checkpoints")
        with open(filler, "wb") as f:                     # every byte left, then some: ENOSPC
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        _wait_for(lambda: len(named("checkpoint_failed")) >= 3, what="three failed saves")
        assert proc.poll() is None, "a full disk ended the daemon"
        filler.unlink()
        warned = lambda: [e for e in named("health_warning") if e["kind"] == "checkpoint_failing"]
        _wait_for(lambda: len(named("checkpoints_resumed")) == len(warned()), what="saves to resume")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
        reader.join(timeout=10)
        assert proc.returncode == 0
        # a failed save frees its partial files at once, and the logs keep growing: whether the space
        # one failure frees lets the next save commit before the disk is full again is a race, so a run
        # may see more than one failing streak; each is one warning, closed by one resume
        streaks, open_since = [], None
        for e in events:
            if e["event"] == "health_warning" and e["kind"] == "checkpoint_failing":
                assert open_since is None, f"a second warning within one failing streak: {e}"
                assert "checkpoints failing since step" in e["detail"]
                open_since = e["first_step"]
                streaks.append(open_since)
            elif e["event"] == "checkpoints_resumed":
                assert open_since is not None and e["failing_since_step"] == open_since, e
                open_since = None
        assert streaks and open_since is None, "no failing streak, or one never closed by a resume"
        # state.json is refused only if a write lands while the disk is full to the byte: a failed save
        # frees its partial shard at once, so whether the daemon's one write then fails is a race (the
        # refusal itself is pinned down in tests/unit/test_disk_faults.py); refused, it is written again
        assert not named("state_save_failed") or named("state_saved")
        final = named("daemon_exit")[-1]
        assert final["reason"] == "stopped"
        state = json.loads((run / "state.json").read_text())
        assert state["status"] == "stopped" and state["checkpoints_failing_since"] is None
        assert not list(run.glob("checkpoints/step-*.tmp")) and not list(run.rglob(".*.tmp-*"))
        last = layout.committed_steps(run / "checkpoints")[-1]
        assert last == final["step"] and last > streaks[-1]
        print(f"saves failed from steps {streaks}, {len(named('checkpoint_failed'))} failed saves, "
              f"resumed at {[e['step'] for e in named('checkpoints_resumed')]}, final {last}")
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["umount", "-l", str(run)], capture_output=True)


def test_more_steps_train_on_with_the_schedule_kept_and_a_changed_trajectory_is_refused_up_front(
        cli, quiet_env, tmp_path, stdlib_corpus):
    """The README's `make demo ARGS="--set train.steps=400"`: a finished run trains on; its lr past
    the old end is the floor. A changed lr is refused by the daemon itself, naming the key, with
    nothing started."""
    proc, run = _daemon(cli, quiet_env, tmp_path, stdlib_corpus, steps=30)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-2000:]
    proc, _ = _daemon(cli, quiet_env, tmp_path, stdlib_corpus, steps=50)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert "lr schedule of the checkpoints is kept" in err and "steps 31..50 train at optim.min_lr" in err
    events = _events(run)
    assert _named(events, "generation_start")[-1]["resume_step"] == 30
    steps = {e["step"]: e for e in _rank_steps(run, 0)}
    assert max(steps) == 50 and all(steps[s]["lr"] == steps[50]["lr"] for s in range(31, 51))
    assert steps[20]["lr"] > steps[31]["lr"]                                  # the decay had ended at 30
    before = len(_named(events, "generation_start"))
    proc, _ = _daemon(cli, quiet_env, tmp_path, stdlib_corpus, "optim.lr=0.01", steps=60)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 78
    assert err.strip().splitlines()[-1].startswith("llm-pretrain: config error: checkpoint ")
    assert "(optim.lr)" in err and "Traceback" not in err
    assert len(_named(_events(run), "generation_start")) == before            # nothing was started
