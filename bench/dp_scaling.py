"""Data-parallel scaling on one machine: 2 ranks x 1 thread against 1 rank x 1 thread, same global batch.

Each side is a real `llm-pretrain run` (the daemon; the 2 ranks a local group,
summing through shared memory with no MindSpore cluster; synthetic data, no
checkpoints), interleaved A B A B; the figure is rank 0's
median tokens/s over the steps after warm-up, from its step events. The two
sides train the same samples; their final losses are printed (equal, or apart by the
rounding of a different reduction order). Prints a
table and writes bench/results/dp_scaling.json; the target (issue 17) is
2 ranks >= 1.6x one rank on small-20m.

    python bench/dp_scaling.py [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {  # config, steps, warm-up steps left out of the median
    "tiny": ("configs/tiny.toml", 400, 50),
    "small-20m": ("configs/small-20m.toml", 30, 5),
}


def one_run(config: str, steps: int, skip: int, dp: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="llm-pretrain-dp-") as tmp:
        cfg_args = ["--config", str(ROOT / config)]
        from engine.config import load_config

        global_batch = load_config(ROOT / config, []).train.global_batch
        sets = [f"parallel.dp={dp}", f"train.micro_batch={global_batch // dp}", "train.grad_accum_steps=1",
                "train.compute_threads=1", f"train.steps={steps}", 'data.source="synthetic"',
                "checkpoint.interval_steps=0", f"run.dir='{tmp}'", "parallel.local_reduce=true"]
        argv = [sys.executable, "-m", "daemon.cli", "run", "--log-format", "json", *cfg_args]
        for s in sets:
            argv += ["--set", s]
        subprocess.run(argv, cwd=ROOT, env=dict(os.environ, GLOG_v="3"), capture_output=True, check=True, timeout=1800)
        events = [json.loads(line) for line in (Path(tmp) / "logs" / "rank-0.log").read_text().splitlines()
                  if '"kind": "step"' in line]
    timed = [e for e in events if e["step"] > skip]
    return {"dp": dp, "tokens_per_s": statistics.median(e["tokens_per_s"] for e in timed),
            "sync_s": statistics.median(e["sync_s"] for e in timed), "final_loss": events[-1]["loss"],
            "steps_timed": len(timed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", choices=sorted(CASES))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    results = {}
    for name, (config, steps, skip) in CASES.items():
        if args.only and name != args.only:
            continue
        runs = {1: [], 2: []}
        for _ in range(args.rounds):
            for dp in (1, 2):
                runs[dp].append(one_run(config, steps, skip, dp))
        one, two = (statistics.median(r["tokens_per_s"] for r in runs[dp]) for dp in (1, 2))
        results[name] = {"one_rank_tokens_per_s": one, "two_ranks_tokens_per_s": two, "ratio": two / one,
                         "final_loss": [runs[1][-1]["final_loss"], runs[2][-1]["final_loss"]], "runs": runs}
    print(f"{'config':<10} {'1 rank x 1 thread':>18} {'2 ranks x 1 thread':>19} {'ratio':>6}  final loss (1 | 2)")
    for name, r in results.items():
        print(f"{name:<10} {r['one_rank_tokens_per_s']:>18,.0f} {r['two_ranks_tokens_per_s']:>19,.0f} "
              f"{r['ratio']:>6.2f}  {r['final_loss'][0]:.6f} | {r['final_loss'][1]:.6f}")
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": "dp_scaling", "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
               "results": results, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (out_dir / "dp_scaling.json").write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
