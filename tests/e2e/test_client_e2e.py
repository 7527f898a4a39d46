"""Issue 49: a user's own MindSpore training script — not this project's engine — supervised by the real daemon
through llm_pretrain_client: the small LLaMA-like network of client_scripts/tiny_llama.py under `Model.train`
(the callback) and in a custom loop (the calls), with real faults: a rank SIGKILLed, a window of bad data, a NaN;
pause, resume and stop by the control directory."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cluster import daemon_events
from tests.e2e.cluster import wait_for as _wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MODEL_TRAIN = "-m tests.e2e.client_scripts.model_train"
CUSTOM_LOOP = "-m tests.e2e.client_scripts.custom_loop"
LR = 3e-3          # the scripts' own lr


def _settings(run: Path, script: str, steps: int, *extra: str) -> list[str]:
    sets = [f"run.dir={str(run)!r}", f"train.steps={steps}", f"script.command={script!r}",
            f"script.python={sys.executable!r}", f"script.cwd={str(ROOT)!r}", "train.global_batch=8",
            "data.seq_len=16", "checkpoint.interval_steps=10", "health.allow_fault_injection=true",
            "health.restart_backoff_initial_s=0.2", *extra]
    return sum((["--set", s] for s in sets), [])


def _run(cli, env, run: Path, script: str, *extra: str, steps: int, injects=(), timeout=420):
    """Queues fault drills (`inject --queue`), then runs the daemon on the script to its end."""
    (run / "control").mkdir(parents=True, mode=0o750)
    for args in injects:
        done = subprocess.run([*cli, "inject", *args, str(run), "--queue"], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    done = subprocess.run([*cli, "run", *_settings(run, script, steps, *extra)], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return daemon_events(run)


def _rank_events(run: Path, kind: str, rank: int = 0) -> list[dict]:
    lines = (run / "logs" / f"rank-{rank}.log").read_text().splitlines()
    return [e for e in (json.loads(l) for l in lines if l.startswith("{")) if e.get("kind") == kind]


def _steps(run: Path, generation: int) -> dict[int, dict]:
    return {e["step"]: e for e in _rank_events(run, "step") if e["generation"] == generation}


def _named(events, name):
    return [e for e in events if e["event"] == name]


def test_a_model_train_script_killed_resumes_from_its_checkpoint_and_ends_as_an_uninterrupted_run(
        cli, quiet_env, tmp_path):
    """kill -9 (the crash drill SIGKILLs the rank) at step 35: restarted from step 30's checkpoint — weights,
    Adam's moments and step count, the data position — it ends with the uninterrupted run's parameters. The
    script reports no grad norm: said once, and `status` says which detectors are off."""
    whole = _run(cli, quiet_env, tmp_path / "whole", MODEL_TRAIN, steps=50)
    textfile = tmp_path / "metrics.prom"
    killed = _run(cli, quiet_env, tmp_path / "killed", MODEL_TRAIN, f'run.metrics_textfile="{textfile}"', steps=50,
                  injects=[("crash", "--rank", "0", "--at-step", "35")])
    starts = _named(killed, "generation_start")
    assert len(starts) == 2 and starts[1]["resume_step"] == 30 and _named(killed, "crash")
    exits = {name: _rank_events(tmp_path / name, "exit")[-1] for name in ("whole", "killed")}
    assert exits["killed"]["step"] == exits["whole"]["step"] == 50
    assert exits["killed"]["params_sha256"] == exits["whole"]["params_sha256"]
    restored = [e for e in _rank_events(tmp_path / "killed", "checkpoint") if e["stage"] == "restored"]
    assert [e["step"] for e in restored] == [30]
    # the data position came back too: generation 2 trained the samples the first run trained at those steps
    first, second = _steps(tmp_path / "whole", 1), _steps(tmp_path / "killed", 2)
    assert min(second) == 31 and all(second[s]["sample_start"] == first[s]["sample_start"] for s in second)
    assert all(second[s]["loss"] == first[s]["loss"] for s in second)
    said = _named(whole, "script_reports")
    assert len(said) == 1 and "grad_norm" in said[0]["missing"] and "loss_scale" in said[0]["missing"]
    status = subprocess.run([*cli, "status", str(tmp_path / "killed"), "--json"], env=quiet_env,
                            capture_output=True, text=True, timeout=60)
    state = json.loads(status.stdout)
    assert state["status"] == "finished" and "grad_norm" in state["script_reports"]["missing"]
    metrics = textfile.read_text()                       # the metrics as for the engine's runs
    assert 'llm_pretrain_step{run="killed"} 50' in metrics and 'llm_pretrain_restarts_total{run="killed"} 1' in metrics
    plot = subprocess.run([*cli, "plot", str(tmp_path / "killed"), "-o", str(tmp_path / "killed.png")],
                          env=quiet_env, capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0 and (tmp_path / "killed.png").stat().st_size > 0, plot.stderr


def test_a_data_parallel_model_train_script_killed_resumes_on_both_ranks_as_an_uninterrupted_run(
        cli, quiet_env, tmp_path):
    """Two ranks of the script (msrun's environment, mindspore.communication.init(), data parallel): the
    crash drill reaches rank 1 through the commands both ranks agree on (one AllReduce a step); after the
    kill -9 both resume from step 20's checkpoint, written as a share by each rank, and end with the
    parameters of an uninterrupted two-rank run — the same on both ranks."""
    dp = ("parallel.dp=2", "train.micro_batch=4")
    whole = _run(cli, quiet_env, tmp_path / "whole", MODEL_TRAIN, *dp, steps=30)
    killed = _run(cli, quiet_env, tmp_path / "killed", MODEL_TRAIN, *dp, steps=30,
                  injects=[("crash", "--rank", "1", "--at-step", "25")])
    assert len(_named(whole, "generation_start")) == 1
    starts = _named(killed, "generation_start")
    assert len(starts) == 2 and starts[1]["resume_step"] == 20 and _named(killed, "crash")
    digests = {(name, rank): _rank_events(tmp_path / name, "exit", rank)[-1]
               for name in ("whole", "killed") for rank in (0, 1)}
    assert {e["step"] for e in digests.values()} == {30}
    assert len({e["params_sha256"] for e in digests.values()}) == 1, digests
    for rank in (0, 1):
        restored = [e for e in _rank_events(tmp_path / "killed", "checkpoint", rank) if e["stage"] == "restored"]
        assert [e["step"] for e in restored] == [20]


def test_a_custom_loops_bad_data_is_rerun_rolled_back_skipped_and_its_lr_cut_is_in_the_optimizer(
        cli, quiet_env, tmp_path):
    """A spike drill: rank 0's batches of steps 50-55 are uniformly random ids (read through client.source).
    The daemon reruns the window from the checkpoint before it, the rerun reads the same bad data and repeats
    the steps bit for bit, and the run is rolled back with the window skipped and the lr halved — in the lr the
    script's optimizer itself computed (optimizer.get_lr(), reported by the script)."""
    run = tmp_path / "spike"
    events = _run(cli, quiet_env, run, CUSTOM_LOOP, "health.loss_spike_warmup_steps=20",
                  "health.loss_spike_window_steps=20", steps=90,
                  injects=[("spike", "--rank", "0", "--at-step", "50", "--steps", "6")])
    incidents = [e for e in _named(events, "incident") if e["kind"] == "loss_spike" and e.get("action")]
    actions = [e["action"]["type"] for e in incidents]
    assert actions[:1] == ["rerun"] and "rollback" in actions, actions
    triage = _named(events, "triage")
    assert triage and triage[0]["verdict"] == "deterministic"
    assert all(c["first_run"] == c["rerun"] for c in triage[0]["compared"])
    rollback = next(e for e in incidents if e["action"]["type"] == "rollback")["action"]
    skip = rollback["skip"]
    first = _steps(run, 1)
    assert skip[0] == first[50]["sample_start"]
    last_generation = max(e["generation"] for e in _rank_events(run, "step"))
    resumed = _steps(run, last_generation)
    assert min(resumed) == rollback["checkpoint_step"] + 1 and max(resumed) == 90
    assert all(e["sample_end"] <= skip[0] or e["sample_start"] >= skip[1] for e in resumed.values())
    # the cut is the optimizer's own lr on the steps after the rollback, not only a reported number
    assert all(e["lr_multiplier"] == 0.5 and e["lr"] == pytest.approx(0.5 * LR, rel=1e-6) for e in resumed.values())
    assert all(e["lr"] == pytest.approx(LR, rel=1e-6) for e in first.values())
    assert all(e["loss"] < 2 * first[45]["loss"] for s, e in resumed.items() if s > rollback["checkpoint_step"] + 5)


def test_a_custom_loops_one_off_nan_is_found_transient_and_trained_through(cli, quiet_env, tmp_path):
    """A nan drill at step 25: the script's loss times NaN, its update not applied (reported as skipped).
    The rerun from step 20 does not repeat it: transient, no skip, no lr cut, and the run ends with the
    parameters of one that never met the NaN."""
    run = tmp_path / "nan"
    events = _run(cli, quiet_env, run, CUSTOM_LOOP, steps=40, injects=[("nan", "--rank", "0", "--at-step", "25")])
    _run(cli, quiet_env, tmp_path / "reference", CUSTOM_LOOP, steps=40)
    first = _steps(run, 1)
    assert first[25]["skipped"] and first[25]["grad_norm"] == "nan"
    triage = _named(events, "triage")
    assert triage and triage[0]["verdict"] == "transient"
    acted = [e["action"]["type"] for e in _named(events, "incident") if e.get("action")]
    assert acted == ["rerun"], acted
    assert all(not e.get("skip") for e in _named(events, "rollback"))     # the rerun's own return to step 20 only
    assert _rank_events(run, "exit")[-1]["params_sha256"] == _rank_events(tmp_path / "reference",
                                                                          "exit")[-1]["params_sha256"]
    rerun = _steps(run, 2)
    assert min(rerun) == 21 and max(rerun) == 40 and not any(e["skipped"] for e in rerun.values())
    assert all(e["lr_multiplier"] == 1.0 for e in rerun.values())
    assert _named(events, "daemon_exit")[-1]["reason"] == "finished"


def test_pause_resume_and_stop_reach_a_model_train_script_at_a_step_boundary(cli, quiet_env, tmp_path):
    run = tmp_path / "ops"
    (run / "control").mkdir(parents=True, mode=0o750)
    proc = subprocess.Popen([*cli, "run", *_settings(run, MODEL_TRAIN, 100_000)], env=quiet_env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (run / "logs" / "rank-0.log").exists() and len(_rank_events(run, "step")) >= 20,
                  what="step 20", timeout_s=180)
        subprocess.run([*cli, "pause", str(run), "--reason", "test"], env=quiet_env, check=True)
        _wait_for(lambda: _named(daemon_events(run), "paused"), what="the paused event", timeout_s=60)
        paused = _named(daemon_events(run), "paused")[0]["step"]
        committed = [e["step"] for e in _rank_events(run, "checkpoint") if e["stage"] == "committed"]
        assert paused in committed                         # the pause checkpoint, committed before holding
        status = json.loads(subprocess.run([*cli, "status", str(run), "--json"], env=quiet_env, capture_output=True,
                                           text=True, timeout=60).stdout)
        assert status["status"] == "paused"
        held = len(_rank_events(run, "step"))
        subprocess.run([*cli, "resume", str(run)], env=quiet_env, check=True)
        _wait_for(lambda: len(_rank_events(run, "step")) >= held + 10, what="ten steps after resuming", timeout_s=60)
        steps = [e["step"] for e in _rank_events(run, "step")]
        assert steps == list(range(1, len(steps) + 1))       # nothing lost or repeated across the pause
        subprocess.run([*cli, "stop", str(run), "--reason", "test"], env=quiet_env, check=True)
        assert proc.wait(timeout=120) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    end = _rank_events(run, "exit")[-1]
    assert end["reason"] == "stopped"
    committed = [e["step"] for e in _rank_events(run, "checkpoint") if e["stage"] == "committed"]
    assert committed[-1] == end["step"]                    # the stop saved the step it stopped after
    assert _named(daemon_events(run), "daemon_exit")[-1]["reason"] == "stopped"
