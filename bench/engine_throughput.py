"""Training throughput (tokens/s) of the compiled step on this machine, for the tiny and ~20M configs.

Each config runs in its own process (one MindSpore context each): compile and
warm up, then time a fixed number of steps; tokens/s is wall-clock (the timed steps' tokens over
their wall time, between-step work included), the step's own rate beside it; prints a table and writes
bench/results/engine_throughput.json. No targets yet: this measures.

    python bench/engine_throughput.py [--steps N] [--warmup N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import results_file  # bench/results_file.py: the one writer of bench/results

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {"tiny": "configs/tiny.toml", "small-20m": "configs/small-20m.toml"}


def measure(config: str, steps: int, warmup: int) -> dict:
    """Runs in a child process: returns per-step times after warm-up."""
    sys.path.insert(0, str(ROOT))
    from contracts.config import load_config
    from engine.model.causal_lm import parameter_count
    from engine.rank import runtime
    from engine.rank.trainer import Trainer

    cfg = load_config(ROOT / config, [f"train.steps={steps + warmup}"])
    trainer = Trainer(cfg, runtime.setup(cfg))
    started = time.perf_counter()
    trainer.train_step()
    compile_s = time.perf_counter() - started
    for _ in range(warmup - 1):
        trainer.train_step()
    wall0 = time.perf_counter()
    times = [trainer.train_step().step_s for _ in range(steps)]
    wall = time.perf_counter() - wall0
    tokens = cfg.train.global_batch * cfg.data.seq_len
    median = statistics.median(times)
    return {"config": config, "parameters": parameter_count(trainer.net), "tokens_per_step": tokens,
            "first_step_s": compile_s, "median_step_s": median, "tokens_per_s": tokens * steps / wall,
            "step_tokens_per_s": tokens / median,
            "steps_timed": steps, "threads": runtime.compute_threads(cfg, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.steps, args.warmup)))
        return
    results = {}
    env = dict(os.environ, GLOG_v="3")
    for name, path in CONFIGS.items():
        out = subprocess.run([sys.executable, __file__, "--child", path, "--steps", str(args.steps),
                              "--warmup", str(args.warmup)], capture_output=True, text=True, env=env, check=True)
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{'config':<10} {'params':>10} {'tokens/step':>11} {'first step s':>12} {'step s':>8} {'tokens/s':>10} {'step only':>10}")
    for name, r in results.items():
        print(f"{name:<10} {r['parameters']:>10,} {r['tokens_per_step']:>11} {r['first_step_s']:>12.2f} "
              f"{r['median_step_s']:>8.4f} {r['tokens_per_s']:>10.0f} {r['step_tokens_per_s']:>10.0f}")
    ratio = results["tiny"]["tokens_per_s"] / results["small-20m"]["tokens_per_s"]
    print(f"tiny / small-20m tokens/s ratio: {ratio:.1f}")
    payload = {"results": results, "tiny_over_small_tokens_per_s": ratio}
    results_file.write("engine_throughput", payload)


if __name__ == "__main__":
    main()
