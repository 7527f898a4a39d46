"""How fast a run comes back: crash → first completed step of the next generation, with and without
MindSpore's compile cache, and how fast a hang is detected. Two real ranks on the tiny config.

For each case a fresh daemon (`llm-pretrain run`) trains until step 15, then a
rank is SIGKILLed (or told to hang through the commands file) and the clock
runs until the restarted generation completes its first step (or the hang is
reported). Restart backoff is 0.2 s here (reported, not subtracted). Prints a
table and writes bench/results/recovery.json.

    python bench/recovery.py [--repeats N]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from daemon.protocol import Command  # noqa: E402
from daemon.state import RunState  # noqa: E402


def _steps(run: Path, rank: int = 0) -> list[dict]:
    path = run / "logs" / f"rank-{rank}.log"
    if not path.exists():
        return []
    return [json.loads(l) for l in path.read_text().splitlines() if l.startswith('{"data_wait_s"')]


def _events(run: Path) -> list[dict]:
    path = run / "logs" / "events.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []


def _wait(predicate, timeout_s=300.0, poll_s=0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        time.sleep(poll_s)
    raise TimeoutError("benchmark condition not reached")


def one_case(workdir: Path, corpus: Path, *, cache: bool, fault: str) -> dict:
    run = workdir / f"run-{fault}-{'cache' if cache else 'nocache'}-{time.monotonic_ns()}"
    sets = [f'data.path="{corpus}"', "train.steps=100000", "checkpoint.interval_steps=10", "parallel.dp=2",
            "train.micro_batch=4", f'run.dir="{run}"', f"run.compile_cache={'true' if cache else 'false'}",
            "health.restart_backoff_initial_s=0.2", "health.restart_backoff_max_s=0.2", "run.kill_grace_s=5",
            "health.allow_fault_injection=true", "health.hang_floor_s=5", "health.hang_step_multiplier=10"]
    cmd = [sys.executable, "-m", "daemon.cli", "run", *sum((["--set", s] for s in sets), [])]
    env = dict(os.environ, GLOG_v="3")
    daemon = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(lambda: len(_steps(run)) >= 15)
        first_step_s = _steps(run)[0]["step_s"]
        if fault == "crash":
            victim = next(p for p in RunState.load(run).processes if p["rank"] == 1)
            started = time.monotonic()
            os.kill(victim["pid"], signal.SIGKILL)
            back = _wait(lambda: any(s["generation"] == 2 for s in _steps(run)))
            second = next(s for s in _steps(run) if s["generation"] == 2)
            return {"fault": "crash", "compile_cache": cache, "recovery_s": back - started,
                    "first_step_s_gen1": first_step_s, "first_step_s_gen2": second["step_s"], "backoff_s": 0.2}
        with open(run / "commands.jsonl", "a") as f:
            f.write(Command(seq=1, name="inject", args={"fault": "hang", "rank": 1, "seconds": 3600}).to_json() + "\n")
        started = time.monotonic()
        seen = _wait(lambda: any(e["event"] == "hang" for e in _events(run)))
        hang = next(e for e in _events(run) if e["event"] == "hang")
        return {"fault": "hang", "detection_s": seen - started, "waited_s": hang["waited_s"],
                "timeout_s": hang["timeout_s"]}
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=120)
        except subprocess.TimeoutExpired:
            daemon.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from engine.prepare import STDLIB, prepare

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "stdlib"
        prepare([STDLIB], corpus, log=open(os.devnull, "w"))
        for _ in range(args.repeats):
            for cache in (False, True):
                results.append(one_case(Path(tmp), corpus, cache=cache, fault="crash"))
        results.append(one_case(Path(tmp), corpus, cache=True, fault="hang"))
    crash = {c: [r for r in results if r["fault"] == "crash" and r["compile_cache"] == c] for c in (False, True)}
    med = {c: statistics.median(r["recovery_s"] for r in crash[c]) for c in crash}
    gen2 = {c: statistics.median(r["first_step_s_gen2"] for r in crash[c]) for c in crash}
    hang = next(r for r in results if r["fault"] == "hang")
    print(f"{'crash → first step after restart':<36} {'median s':>9} {'first step (compile) s':>23}")
    for c in (False, True):
        print(f"{'  compile cache ' + ('on' if c else 'off'):<36} {med[c]:>9.2f} {gen2[c]:>23.2f}")
    print(f"compile cache speed-up of recovery: {med[False] / med[True]:.2f}x")
    print(f"hang detected {hang['detection_s']:.2f} s after injection (no progress for {hang['waited_s']} s; "
          f"timeout {hang['timeout_s']} s)")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "recovery.json").write_text(json.dumps({
        "benchmark": "recovery", "results": results, "median_recovery_s": {"no_cache": med[False], "cache": med[True]},
        "median_first_step_after_restart_s": {"no_cache": gen2[False], "cache": gen2[True]},
        "hang_detection_s": hang["detection_s"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2) + "\n")


if __name__ == "__main__":
    main()
