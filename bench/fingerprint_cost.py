"""What the replica fingerprints cost: the digest's time against the step time it is spread over.

One process, small-20m (configs/small-20m.toml) on its default data, one rank (the digest
is per rank: every replica computes its own at the same step, in parallel). After a warm-up, rounds
alternate K training steps (timed) with D digests of the same parameters (timed, as the rank computes
them: engine.rank.fingerprint over every trainable parameter). The cost at the default interval
(health.fingerprint_interval_steps = 100): digest / (interval × step), median of the rounds with
their range. Target: <= 0.5 %. Writes bench/results/fingerprint_cost.json.

    python bench/fingerprint_cost.py [--rounds 5] [--steps 5] [--digests 5]
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
TARGET = 0.005


def measure(rounds: int, steps: int, digests: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from contracts.config import load_config
    from engine.rank import runtime
    from engine.rank.trainer import Trainer

    cfg = load_config(ROOT / "configs" / "small-20m.toml", ["train.steps=100000"])
    trainer = Trainer(cfg, runtime.setup(cfg))
    for _ in range(3):                              # compile and warm the step
        trainer.train_step()
    trainer.fingerprint()
    interval = cfg.health.fingerprint_interval_steps
    step_s, digest_s, costs = [], [], []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(steps):
            trainer.train_step()
        step = (time.perf_counter() - started) / steps
        timed = []
        for _ in range(digests):
            t = time.perf_counter()
            trainer.fingerprint()
            timed.append(time.perf_counter() - t)
        digest = statistics.median(timed)
        step_s.append(step)
        digest_s.append(digest)
        costs.append(digest / (interval * step))
    params = sum(int(p.size) for p in trainer.net.trainable_params())
    return {"config": "small-20m", "parameters": params, "interval_steps": interval, "rounds": rounds,
            "steps_per_round": steps, "step_s": step_s, "digest_s": digest_s, "cost_per_round": costs,
            "cost_median": statistics.median(costs), "cost_range": [min(costs), max(costs)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--digests", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.rounds, args.steps, args.digests)))
        return
    env = dict(os.environ, GLOG_v="3")
    out = subprocess.run([sys.executable, __file__, "--child", "--rounds", str(args.rounds), "--steps", str(args.steps),
                          "--digests", str(args.digests)], capture_output=True, text=True, env=env, check=True, cwd=ROOT)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    lo, hi = r["cost_range"]
    print(f"replica fingerprints of small-20m ({r['parameters']:,} parameters), every {r['interval_steps']} steps, "
          f"{r['rounds']} rounds:")
    print(f"  a digest {1000 * statistics.median(r['digest_s']):.1f} ms, a step {statistics.median(r['step_s']):.3f} s "
          f"(medians)")
    print(f"  cost {100 * r['cost_median']:.3f}% of the step time (range {100 * lo:.3f}..{100 * hi:.3f}%; target <= "
          f"{100 * TARGET:.1f}%)")
    payload = {"target": TARGET, **r}
    results_file.write("fingerprint_cost", payload)


if __name__ == "__main__":
    main()
