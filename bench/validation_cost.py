"""What the validation loss costs: training throughput with it at the default interval against without it.

One process (one MindSpore context, the graphs compiled once): the tiny config on the standard-library
corpus with 1 % of its documents held out. After a warm-up (which also compiles the validation graph:
its one-time cost is reported apart, as `first_eval_s`), rounds alternate — K steps with the validation
loss every train.eval_interval_steps (default 100), then K steps without — so both see the same machine.
The cost: the share of a round's wall time its evaluations took (timed each), median of the rounds with
their range; beside it the A/B figure, 1 - (tokens/s with) / (tokens/s without) wall-clock, whose
round-to-round spread on a shared 2-core machine (±10 % at 200 steps) is far wider than the cost
itself. Target: <= 2 %. Writes bench/results/validation_cost.json.

    python bench/validation_cost.py [--rounds 5] [--steps 1000]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_file  # bench/results_file.py: the one writer of bench/results

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.02


def measure(corpus: str, rounds: int, steps: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from contracts.config import load_config
    from engine.data import order
    from engine.rank import runtime
    from engine.rank.trainer import Trainer
    from engine.training.evaluate import Evaluator

    cfg = load_config(None, [f'data.path="{corpus}"', f"train.steps={(2 * rounds + 1) * steps + 10}"])
    trainer = Trainer(cfg, runtime.setup(cfg))
    batches = order.validation_batches(cfg, trainer.source)
    evaluator = Evaluator(trainer.net, batches)
    for _ in range(10):                            # compile and warm the step
        trainer.train_step()
    first_eval_s = evaluator.run()[2]              # compiles the validation graph
    interval, with_eval, without, shares = cfg.train.eval_interval_steps, [], [], []
    eval_s: list[float] = []
    for _ in range(rounds):
        for evaluate, out in ((True, with_eval), (False, without)):
            started, evaluating = time.perf_counter(), 0.0
            for _ in range(steps):
                trainer.train_step()
                if evaluate and trainer.step % interval == 0:
                    eval_s.append(evaluator.run()[2])
                    evaluating += eval_s[-1]
            wall = time.perf_counter() - started
            out.append(steps * cfg.train.global_batch * cfg.data.seq_len / wall)
            if evaluate:
                shares.append(evaluating / wall)
    costs = [1 - w / o for w, o in zip(with_eval, without)]
    return {"interval_steps": interval, "eval_batches": cfg.train.eval_batches, "micro_batch": cfg.train.micro_batch,
            "steps_per_round": steps, "rounds": rounds, "first_eval_s": first_eval_s,
            "eval_s_median": statistics.median(eval_s) if eval_s else None,
            "tokens_per_s_with": with_eval, "tokens_per_s_without": without,
            "cost_per_round": shares, "cost_median": statistics.median(shares), "cost_range": [min(shares), max(shares)],
            "ab_cost_per_round": costs, "ab_cost_median": statistics.median(costs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000, help="steps per round (ten evaluations at the default)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.rounds, args.steps)))
        return
    env = dict(os.environ, GLOG_v="3")
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "stdlib-split"
        subprocess.run([sys.executable, "-m", "cli", "prepare-data", "--input", "@stdlib", "--output", str(corpus),
                        "--validation-fraction", "0.01", "--log-format", "json"], cwd=ROOT, env=env, check=True,
                       capture_output=True)
        out = subprocess.run([sys.executable, __file__, "--child", str(corpus), "--rounds", str(args.rounds),
                              "--steps", str(args.steps)], capture_output=True, text=True, env=env, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    lo, hi = r["cost_range"]
    print(f"validation loss every {r['interval_steps']} steps ({r['eval_batches']} batches of {r['micro_batch']}), "
          f"{r['rounds']} rounds of {r['steps_per_round']} steps:")
    print(f"  tokens/s with {statistics.median(r['tokens_per_s_with']):,.0f}, without "
          f"{statistics.median(r['tokens_per_s_without']):,.0f} (medians)")
    print(f"  cost {100 * r['cost_median']:.2f}% of the wall time (range {100 * lo:.2f}..{100 * hi:.2f}%; target <= "
          f"{100 * TARGET:.0f}%); an evaluation {r['eval_s_median']:.3f} s, the first (compiling) {r['first_eval_s']:.2f} s")
    print(f"  A/B: {100 * r['ab_cost_median']:.2f}% (per round: "
          f"{', '.join(f'{100 * c:.1f}' for c in r['ab_cost_per_round'])}%; within the machine's noise)")
    payload = {"target": TARGET, **r}
    results_file.write("validation_cost", payload)


if __name__ == "__main__":
    main()
