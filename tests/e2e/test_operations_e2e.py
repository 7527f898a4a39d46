"""Operating a real 2-rank run through its control directory: pause holds every rank at the same
step and resume continues bit-exactly — with the ranks held, and with them released and restarted
from the pause checkpoint; status and logs tell the operator what happened."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.cluster import daemon_events as _events
from tests.e2e.cluster import wait_for as _wait_for



def _start(cli, env, run: Path, corpus, *extra, steps=40):
    sets = [f'data.path="{corpus}"', f"train.steps={steps}", "checkpoint.interval_steps=100", "parallel.dp=2",
            "train.micro_batch=4", f'run.dir="{run}"', "health.allow_fault_injection=true", *extra]
    return subprocess.Popen([*cli, "run", *sum((["--set", s] for s in sets), [])], cwd=run.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _named(run, name):
    return [e for e in _events(run) if e["event"] == name]


def _steps(run: Path, rank: int) -> dict[int, float]:
    """loss by step, the last generation's word for each step."""
    out = {}
    for line in (run / "logs" / f"rank-{rank}.log").read_text().splitlines():
        if line.startswith('{"data_wait_s"'):
            e = json.loads(line)
            out[e["step"]] = e["loss"]
    return out


def _digests(run: Path) -> set[str]:
    """The parameter digests of each rank's last exit (the end of the run)."""
    out = set()
    for rank in (0, 1):
        exits = [json.loads(l) for l in (run / "logs" / f"rank-{rank}.log").read_text().splitlines()
                 if l.startswith("{") and '"kind": "exit"' in l]
        out.add(exits[-1]["params_sha256"])
    return out


@pytest.fixture(scope="module")
def reference(cli, quiet_env, tmp_path_factory, stdlib_corpus):
    run = tmp_path_factory.mktemp("reference") / "run"
    proc = _start(cli, quiet_env, run, stdlib_corpus)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    return _steps(run, 0), _digests(run)


def _pause_mid_run(cli, env, run, corpus, *extra):
    (run / "control").mkdir(parents=True, mode=0o750)
    # 0.3 s of sleep per step on rank 0 (a `slow` drill: no effect on the numbers) leaves time to act: 12 s
    # for three CLI calls before the run's 40 steps are done
    subprocess.run([*cli, "inject", "slow", str(run), "--steps", "1000", "--seconds", "0.3", "--queue"], env=env,
                   check=True)
    proc = _start(cli, env, run, corpus, *extra)
    _wait_for(lambda: (run / "logs" / "rank-0.log").exists() and len(_steps(run, 0)) >= 5, what="step 5")
    subprocess.run([*cli, "checkpoint", str(run)], env=env, check=True)
    _wait_for(lambda: _named(run, "checkpoint_committed"), what="the requested checkpoint")
    _wait_for(lambda: len(_steps(run, 0)) >= _named(run, "checkpoint_committed")[0]["step"] + 2, what="two more steps")
    subprocess.run([*cli, "pause", str(run), "--reason", "test"], env=env, check=True)
    _wait_for(lambda: _named(run, "paused"), what="the paused event")
    return proc


def test_pause_holds_every_rank_at_one_step_and_resume_is_bit_exact(cli, quiet_env, tmp_path, stdlib_corpus,
                                                                   reference):
    run = tmp_path / "run"
    proc = _pause_mid_run(cli, quiet_env, run, stdlib_corpus)
    paused = _named(run, "paused")[0]
    assert len(set(paused["rank_steps"].values())) == 1, paused       # both ranks at the same step
    step = paused["step"]
    status = json.loads(subprocess.run([*cli, "status", str(run), "--json"], env=quiet_env, capture_output=True,
                                       text=True, check=True).stdout)
    assert status["status"] == "paused"
    assert len(_steps(run, 0)) == step
    subprocess.run([*cli, "resume", str(run)], env=quiet_env, check=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    for rank in (0, 1):         # nothing stepped while paused: each rank's log from "paused" to "train" again
        logged = [json.loads(l) for l in (run / "logs" / f"rank-{rank}.log").read_text().splitlines()
                  if l.startswith("{")]
        phases = [(i, e["phase"], e["step"]) for i, e in enumerate(logged) if e["kind"] == "phase"]
        at = next(n for n, (_, name, _) in enumerate(phases) if name == "paused")
        (held, _, held_step), (again, name, again_step) = phases[at], phases[at + 1]
        assert (name, held_step, again_step) == ("train", step, step), phases
        assert not [e for e in logged[held:again] if e["kind"] == "step"], f"rank {rank} stepped while paused"
    losses, digests = reference
    assert _steps(run, 0) == losses and _digests(run) == digests
    print(f"paused at step {step} on both ranks; resumed; 40 losses and the final weights identical")
    acks = [e["name"] for e in _named(run, "control")]
    assert acks == ["inject", "checkpoint", "pause", "resume"]
    (requested,) = _named(run, "checkpoint_committed")[:1]
    assert requested["step"] < step and requested["step"] % 100 != 0     # not an interval checkpoint


def test_a_long_pause_releases_the_ranks_and_resume_restarts_them_bit_exactly(cli, quiet_env, tmp_path,
                                                                              stdlib_corpus, reference):
    run = tmp_path / "run"
    proc = _pause_mid_run(cli, quiet_env, run, stdlib_corpus, "run.pause_release_after_s=1")
    _wait_for(lambda: _named(run, "released"), what="the ranks' release")
    standby = [pid for e in _named(run, "standby_started") for pid in e["pids"].values()]
    _wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in standby), timeout_s=30,
              what="the standby's processes to end with the release")
    text = subprocess.run([*cli, "status", str(run)], env=quiet_env, capture_output=True, text=True,
                          check=True).stdout
    assert "paused" in text
    subprocess.run([*cli, "resume", str(run)], env=quiet_env, check=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    starts = _named(run, "generation_start")
    assert len(starts) == 2 and starts[1]["resume_step"] == _named(run, "paused")[0]["step"]
    assert starts[1]["standby"] is False                  # released with the ranks: the machine was freed
    losses, digests = reference
    assert _steps(run, 0) == losses and _digests(run) == digests
    lines = subprocess.run([*cli, "logs", str(run), "--event", "paused", "--event", "released"], env=quiet_env,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(lines) == 2 and " paused " in lines[0] and " released " in lines[1]
