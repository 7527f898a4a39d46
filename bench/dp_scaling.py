"""Data-parallel scaling on one machine: 2 ranks of 1 core each against 1 rank of 1 core, same global batch.

Three sides, each a real `llm-pretrain run` (the daemon; the 2 ranks a local
group, summing through shared memory with no MindSpore cluster; synthetic data,
no checkpoints), interleaved A B C A B C:
- 1 rank x 1 core: train.compute_threads = 1, the daemon and its rank bound to
  the first core this process may use (as a rank of the 2-rank run is);
- 2 ranks x 1 core: train.compute_threads = 1, parallel.bind_cores (the default:
  each rank on its own core);
- 1 rank, every core: the default threads, unbound — what one rank does with the
  whole machine, the figure data parallel must beat to be worth running here.
("1 thread" is not one core: MindSpore's runtime runs a rank's independent kernels
side by side on its actor threads, ~1.8 cores busy with compute_threads = 1.)
The figure is rank 0's median wall-clock tokens/s over the logged steps after warm-up
(from the previous step's end to the step's end, from its step events), with its range over
the rounds. The sides train the same samples; their final losses are printed (equal,
or apart by the rounding of a different reduction order). Prints a table and
writes bench/results/dp_scaling.json; the target (issue 17) is 2 ranks >= 1.6x
one rank of one core on small-20m.

    python bench/dp_scaling.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import results_file  # bench/results_file.py: the one writer of bench/results

ROOT = Path(__file__).resolve().parent.parent
CASES = {  # config, steps, warm-up steps left out of the median
    "tiny": ("configs/tiny.toml", 400, 50),
    "small-20m": ("configs/small-20m.toml", 30, 5),
}


SIDES = {  # name: (dp, compute_threads, the daemon bound to one core)
    "one_core": (1, 1, True),
    "two_ranks": (2, 1, False),
    "whole_machine": (1, 0, False),
}


def one_run(config: str, steps: int, skip: int, dp: int, threads: int = 1, one_core: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="llm-pretrain-dp-") as tmp:
        cfg_args = ["--config", str(ROOT / config)]
        from contracts.config import load_config

        global_batch = load_config(ROOT / config, []).train.global_batch
        sets = [f"parallel.dp={dp}", f"train.micro_batch={global_batch // dp}", "train.grad_accum_steps=1",
                f"train.compute_threads={threads}", f"train.steps={steps}", 'data.source="synthetic"',
                "checkpoint.interval_steps=0", f"run.dir='{tmp}'", "parallel.local_reduce=true"]
        argv = [sys.executable, "-m", "cli", "run", "--log-format", "json", *cfg_args]
        for s in sets:
            argv += ["--set", s]
        first = min(os.sched_getaffinity(0))
        bind = (lambda: os.sched_setaffinity(0, {first})) if one_core else None
        subprocess.run(argv, cwd=ROOT, env=dict(os.environ, GLOG_v="3"), capture_output=True, check=True, timeout=1800,
                       preexec_fn=bind)
        events = [json.loads(line) for line in (Path(tmp) / "logs" / "rank-0.log").read_text().splitlines()
                  if '"kind": "step"' in line]
    timed = [e for e in events if e["step"] > skip]
    # wall-clock: from the previous step's end to this one's (the host's work between steps included;
    # the event's own tokens_per_s starts the clock after it)
    wall = [e["tokens"] / (e["step_s"] - e["data_wait_s"] + e["host_s"]) for e in timed]
    return {"dp": dp, "compute_threads": threads, "one_core": one_core, "tokens_per_s": statistics.median(wall),
            "step_tokens_per_s": statistics.median(e["tokens_per_s"] for e in timed),
            "sync_s": statistics.median(e["sync_s"] for e in timed), "final_loss": events[-1]["loss"],
            "steps_timed": len(timed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=sorted(CASES))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    results = {}
    for name, (config, steps, skip) in CASES.items():
        if args.only and name != args.only:
            continue
        runs = {side: [] for side in SIDES}
        for _ in range(args.rounds):
            for side, (dp, threads, one_core) in SIDES.items():
                runs[side].append(one_run(config, steps, skip, dp, threads, one_core))
        tps = {side: statistics.median(r["tokens_per_s"] for r in runs[side]) for side in SIDES}
        spread = {side: [min(r["tokens_per_s"] for r in runs[side]), max(r["tokens_per_s"] for r in runs[side])]
                  for side in SIDES}
        results[name] = {"tokens_per_s": tps, "tokens_per_s_range": spread, "rounds": args.rounds, "ratio": tps["two_ranks"] / tps["one_core"],
                         "ratio_to_whole_machine": tps["two_ranks"] / tps["whole_machine"],
                         "final_loss": {side: runs[side][-1]["final_loss"] for side in SIDES}, "runs": runs}
    print(f"{'config':<10} {'1 rank x 1 core':>16} {'2 ranks x 1 core':>17} {'ratio':>6} {'1 rank, all cores':>18} "
          f"{'ratio':>6}  final loss (1 core | 2 ranks)")
    for name, r in results.items():
        t = r["tokens_per_s"]
        print(f"{name:<10} {t['one_core']:>16,.0f} {t['two_ranks']:>17,.0f} {r['ratio']:>6.2f} "
              f"{t['whole_machine']:>18,.0f} {r['ratio_to_whole_machine']:>6.2f}  "
              f"{r['final_loss']['one_core']:.6f} | {r['final_loss']['two_ranks']:.6f}")
    payload = {"results": results}
    results_file.write("dp_scaling", payload)


if __name__ == "__main__":
    main()
