"""The memory model's activations against a measured CPU step, with and without recompute.

Activations are what grows with the batch, so each setting is measured at two
micro-batch sizes, B and 2B, in fresh processes (compile, then two training
steps of small-20m), and the difference is set beside the model's difference
for the same two sizes; what does not grow with the batch (parameters,
optimizer state, gradients) cancels. The measure is the compiler's own: with
`memory_optimize_level = "O1"` MindSpore plans the step graph's tensors with
SOMAS and logs the memory the plan needs ("Reused Size"), the CPU's
counterpart of the Ascend dry run's peak. The peak RSS of the process is shown
too: MindSpore's CPU runtime holds far more than the plan (see the README).
fp16 runs on CPU too, which checks the claim that recompute saves more than
60% of activation memory in half precision. Prints a table and writes
bench/results/memory_model.json.

    python bench/memory_model.py [--batch B] [--config configs/small-20m.toml]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import results_file  # bench/results_file.py: the one writer of bench/results

ROOT = Path(__file__).resolve().parent.parent


def _overrides(batch: int, precision: str, recompute: bool) -> list[str]:
    return [f"train.global_batch={batch}", f"train.micro_batch={batch}", "train.grad_accum_steps=1",
            f'train.precision="{precision}"', f"train.recompute={str(recompute).lower()}", "train.steps=2",
            'data.source="synthetic"']


def measure(config: str, overrides: list[str]) -> dict:
    """In a child process: two steps, then this process's peak RSS."""
    sys.path.insert(0, str(ROOT))
    import mindspore as ms

    from contracts.config import load_config
    from engine.rank import runtime
    from engine.rank.trainer import Trainer

    cfg = load_config(ROOT / config, overrides)
    rank = runtime.setup(cfg)
    ms.set_context(memory_optimize_level="O1")        # SOMAS plans the graph and logs what it needs
    trainer = Trainer(cfg, rank)
    for _ in range(2):
        trainer.train_step()
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/small-20m.toml")
    parser.add_argument("--batch", type=int, default=4, help="B: the smaller micro-batch (the other is 2B)")
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.config, args.child)))
        return
    sys.path.insert(0, str(ROOT))
    from contracts.config import load_config
    from engine.layout import memory_model as mm

    env = dict(os.environ, GLOG_v="1")
    planned = re.compile(r"Reused Size\(Allocate Size\):\s*(\d+)")
    rows = []
    for precision in ("fp32", "fp16"):
        for recompute in (False, True):
            plans, peaks, model = [], [], []
            for batch in (args.batch, 2 * args.batch):
                overrides = _overrides(batch, precision, recompute)
                out = subprocess.run([sys.executable, __file__, "--config", args.config, "--child", *overrides],
                                     capture_output=True, text=True, env=env, check=True, cwd=ROOT)
                peaks.append(json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_bytes"])
                plans.append(max(int(n) for n in planned.findall(out.stdout + out.stderr)))
                model.append(mm.estimate(load_config(ROOT / args.config, overrides))[0].activations)
            measured, estimated = plans[1] - plans[0], model[1] - model[0]
            rows.append({"precision": precision, "recompute": recompute, "batch": args.batch,
                         "planned_bytes": plans, "peak_rss_bytes": peaks, "measured_activation_bytes": measured,
                         "rss_growth_bytes": peaks[1] - peaks[0], "estimated_activation_bytes": estimated,
                         "estimate_over_measured": estimated / measured})
    mib = 1024 ** 2
    print(f"activations of {args.batch} more sequences ({args.config}): the compiler's planned memory at "
          f"micro-batch {2 * args.batch} minus at {args.batch}, beside the estimate (and the peak RSS's growth)")
    print(f"{'precision':<10} {'recompute':<10} {'planned MiB':>12} {'estimate MiB':>13} {'estimate/planned':>17} "
          f"{'RSS MiB':>9}")
    for r in rows:
        print(f"{r['precision']:<10} {str(r['recompute']):<10} {r['measured_activation_bytes'] / mib:>12.1f} "
              f"{r['estimated_activation_bytes'] / mib:>13.1f} {r['estimate_over_measured']:>17.2f} "
              f"{r['rss_growth_bytes'] / mib:>9.1f}")
    savings = {}
    for precision in ("fp32", "fp16"):
        plain, recomputed = (next(r for r in rows if r["precision"] == precision and r["recompute"] == on)
                             for on in (False, True))
        savings[precision] = {
            "measured": 1 - recomputed["measured_activation_bytes"] / plain["measured_activation_bytes"],
            "estimated": 1 - recomputed["estimated_activation_bytes"] / plain["estimated_activation_bytes"]}
        print(f"recompute saves, {precision}: measured {savings[precision]['measured']:.0%}, "
              f"estimated {savings[precision]['estimated']:.0%}")
    payload = {"config": args.config,
               "rows": rows, "recompute_savings": savings}
    results_file.write("memory_model", payload)


if __name__ == "__main__":
    main()
