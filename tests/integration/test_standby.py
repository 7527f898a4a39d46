"""The warm standby against the stdlib fake worker: the next generation's processes start while one
trains, wait, and become the ranks of the generation after an incident (daemon/processes/standby.py)."""
import os
import signal
import subprocess


from tests.integration.test_recovery_policy import QUICK_HEALTH, _steps
from tests.integration.test_supervisor import _finish, _logged, _named, _start, _wait


def _gated(tmp_path, step):
    """Fake-worker arguments that hold every rank before `step` until the test opens the gate."""
    return ["--gate-at", str(step), "--gate", str(tmp_path / "gate")]


def _open_gate_once_the_standby_is_ready(tmp_path, run):
    _wait(lambda: _logged(run, "standby_ready"), "the standby to be ready")
    (tmp_path / "gate").touch()


def test_a_rollback_runs_on_the_standby_with_the_decision_made_after_it_started(tmp_path):
    run = tmp_path / "run"
    proc = _start(run, overrides=QUICK_HEALTH, ranks=2, fake=[
        "--steps", "60", "--step-s", "0.05", "--interval", "5", "--spike-at", "30", "--fault-generations", "1",
        *_gated(tmp_path, 29)])                                   # the spike comes once the standby is ready
    _open_gate_once_the_standby_is_ready(tmp_path, run)
    code, events, err = _finish(proc)
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
                                      "--crash-at", "60", "--fault-generations", "1", *_gated(tmp_path, 59)])
    _wait(lambda: _logged(run, "standby_ready"), "the standby to be ready")
    standby_1 = _logged(run, "standby_started")[0]["pids"]["1"]
    os.kill(standby_1, signal.SIGKILL)
    _wait(lambda: _ended(standby_1), "the standby's rank 1 to die")
    (tmp_path / "gate").touch()                                   # then the crash at 60
    code, events, err = _finish(proc)
    assert code == 0, err
    (retired,) = _named(events, "standby_retired")
    assert "rank 1 ended (-9)" in retired["detail"] and "starting it cold" in retired["detail"]
    assert [g["standby"] for g in _named(events, "generation_start")] == [False, False]
    assert _named(events, "daemon_exit")[0]["reason"] == "finished"


def _ended(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_with_run_standby_off_every_generation_starts_cold(tmp_path):
    code, events, err = _finish(_start(tmp_path / "run", overrides=["run.standby=false"], fake=[
        "--steps", "30", "--interval", "5", "--crash-at", "10", "--fault-generations", "1"]))
    assert code == 0, err
    assert not _named(events, "standby_started")
    assert [g["standby"] for g in _named(events, "generation_start")] == [False, False]


def test_a_local_group_starts_no_scheduler_and_leaves_no_shared_memory_behind(tmp_path):
    """parallel.local_reduce on one CPU machine: the ranks are a local group (no MindSpore cluster), each
    generation with files of its own in /dev/shm, which the daemon removes when the generation ends
    (a rank that died before its first sum leaves them: the fake ranks never unlink them)."""
    from daemon.processes.mindspore_env import SHM_DIR

    run = tmp_path / "run"
    proc = _start(run, overrides=[*QUICK_HEALTH, "parallel.local_reduce=true"], ranks=2, fake=[
        "--steps", "60", "--step-s", "0.05", "--interval", "5", "--crash-at", "30", "--rank-faults", "1",
        "--fault-generations", "1", *_gated(tmp_path, 29)])            # the crash comes once the standby is ready
    _open_gate_once_the_standby_is_ready(tmp_path, run)
    code, events, err = _finish(proc)
    assert code == 0, err
    gens = _named(events, "generation_start")
    assert [sorted(g["pids"]) for g in gens] == [["0", "1"], ["0", "1"]]          # no scheduler (rank -1)
    assert [g["standby"] for g in gens] == [False, True]                          # the standby, without one too
    groups = [[l.split()[-1] for l in (run / "logs" / f"rank-{r}.log").read_text().splitlines()
               if l.startswith("local group ")] for r in (0, 1)]
    assert groups[0] == groups[1] and len(set(groups[0])) == 2                    # one group a generation
    daemon_pid = _named(events, "daemon_start")[0]["pid"]
    assert all(f"-{daemon_pid}-" in g for g in groups[0])
    assert not list(SHM_DIR.glob(f"llm-pretrain-reduce-{os.getuid()}-{daemon_pid}-*"))


def test_a_dead_daemons_shared_memory_files_are_removed_by_the_next_one(tmp_path):
    from daemon.processes.mindspore_env import SHM_DIR

    dead = subprocess.Popen(["true"])
    dead.wait()                                 # a pid no process has now
    left = SHM_DIR / f"llm-pretrain-reduce-{os.getuid()}-{dead.pid}-4711-g3.seg"
    left.write_bytes(b"x")
    mine = SHM_DIR / f"llm-pretrain-reduce-{os.getuid()}-{os.getpid()}-4711-g3.seg"    # a live daemon's
    mine.write_bytes(b"x")
    try:
        code, events, err = _finish(_start(tmp_path / "run", fake=["--steps", "3"]))
        assert code == 0, err
        assert not left.exists() and mine.exists()
    finally:
        left.unlink(missing_ok=True)
        mine.unlink(missing_ok=True)
