"""How many steps a rerun or rollback trains again, with the RAM tier on (issue 50, item 4).

Runs the daemon (`llm-pretrain run`, tiny, dp 2, disk every 50 steps) with a NaN drill and with a
loss-spike drill (a poisoned window) at step 140, for each RAM interval given, and reads from the
event log where each generation after the incident resumed from: the decision's checkpoint step,
the tier it came from (the `checkpoint_restored` event's path), the steps of the incident's lead-up
trained again (first step - resume step) and the steps trained again in all (the previous
generation's last step - resume step, summed over the generations after the incident).
Prints one line per drill and writes bench/results/ram_tier_replay.json.

    python bench/ram_tier_replay.py [--memory-interval 1 10] [--drills nan spike] [--label after]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import results_file  # bench/results_file.py: the one writer of bench/results

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DRILLS = {"nan": (["nan", "--rank", "1", "--at-step", "90"], 130),
          "spike": (["spike", "--rank", "0", "--at-step", "140", "--steps", "6"], 200)}   # spikes judged from step 100


def _cli() -> list[str]:
    exe = Path(sys.executable).parent / "llm-pretrain"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "cli"]


def _rank0_last_steps(run: Path) -> dict[int, int]:
    """Rank 0's last step of each generation, from its step events."""
    out: dict[int, int] = {}
    for line in (run / "logs" / "rank-0.log").read_text().splitlines():
        if line.startswith('{"data_wait_s"'):
            e = json.loads(line)
            out[e["generation"]] = max(out.get(e["generation"], 0), e["step"])
    return out


def drill(name: str, memory_interval: int, corpus: str, env: dict, work: Path) -> dict:
    inject, steps = DRILLS[name]
    run = work / f"{name}-{memory_interval}"
    (run / "control").mkdir(parents=True, mode=0o750)
    cli = _cli()
    subprocess.run([*cli, "inject", *inject, str(run), "--queue"], env=env, check=True, capture_output=True)
    sets = [f'data.path="{corpus}"', f"train.steps={steps}", "checkpoint.interval_steps=50", "parallel.dp=2",
            "train.micro_batch=4", f'run.dir="{run}"', "health.allow_fault_injection=true",
            f"checkpoint.memory_interval_steps={memory_interval}"]
    done = subprocess.run([*cli, "run", *sum((["--set", s] for s in sets), [])], cwd=work, env=env,
                          capture_output=True, text=True, timeout=900)
    events = [json.loads(l) for l in (run / "logs" / "events.jsonl").read_text().splitlines() if l.endswith("}")]
    last = _rank0_last_steps(run)
    restored = {e["generation"]: e for e in events if e["event"] == "checkpoint_restored"}
    starts = {e["generation"]: e for e in events if e["event"] == "generation_start"}
    out = {"drill": name, "memory_interval_steps": memory_interval, "exit": done.returncode, "generations": []}
    total = 0
    for inc in (e for e in events if e["event"] == "incident" and e.get("action")):
        gen = inc["generation"] + 1
        action = inc["action"]
        got = restored.get(gen, {})
        resume = got.get("step")
        replayed = None if resume is None else last.get(inc["generation"], 0) - resume
        total += replayed or 0
        out["generations"].append({
            "incident": inc["kind"], "first_step": inc["first_step"], "action": action["type"],
            "checkpoint_step": action.get("checkpoint_step"), "restored_step": resume,
            "tier": "ram" if str(got.get("path", "")).startswith(("/dev/shm", "/run")) else "disk",
            "reported_resume_step": starts.get(gen, {}).get("resume_step"),
            "lead_up_replayed": None if resume is None else inc["first_step"] - resume,
            "replayed": replayed})
    out["replayed_total"] = total
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--memory-interval", type=int, nargs="+", default=[1, 10])
    ap.add_argument("--drills", nargs="+", default=list(DRILLS), choices=list(DRILLS))
    ap.add_argument("--label", default="after", help="the key the results are kept under (before, after)")
    args = ap.parse_args()
    from engine.data.prepare import STDLIB, prepare

    env = {**os.environ, "GLOG_v": "3"}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        env["XDG_CACHE_HOME"] = str(work / "cache")
        corpus = work / "corpus"
        prepare([STDLIB], corpus, log=open(os.devnull, "w"))
        for mi in args.memory_interval:
            for name in args.drills:
                r = drill(name, mi, str(corpus), env, work)
                results.append(r)
                for g in r["generations"]:
                    print(f"{name:5} RAM every {mi:2}: {g['incident']} at {g['first_step']} -> {g['action']} from "
                          f"{g['checkpoint_step']} (restored {g['restored_step']}, {g['tier']}; reported "
                          f"{g['reported_resume_step']}): {g['lead_up_replayed']} steps of lead-up, "
                          f"{g['replayed']} trained again", flush=True)
                print(f"{name:5} RAM every {mi:2}: {r['replayed_total']} steps trained again in all (exit {r['exit']})",
                      flush=True)
    try:
        previous = results_file.read("ram_tier_replay")
    except (OSError, ValueError, KeyError):
        previous = {}
    runs = {k: v for k, v in previous.items() if k in ("before", "after")}
    done = {(r["drill"], r["memory_interval_steps"]) for r in results}     # this sitting's replace the same drills'
    runs[args.label] = [r for r in runs.get(args.label, []) if (r["drill"], r["memory_interval_steps"]) not in done]
    runs[args.label] += results
    results_file.write("ram_tier_replay", runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
