"""Input pipeline throughput against what training consumes, on the tiny config and the stdlib corpus.

Measured side by side in one run: tokens/s the pipeline (engine.data.feed, through
mindspore.dataset) delivers on its own, and tokens/s the tiny config's
training consumes (data included). Target: the pipeline delivers at least 20×
what training consumes, so the step never waits for data. Prints the ratio,
writes bench/results/data_throughput.json.

    python bench/data_throughput.py [--pipeline-steps N] [--train-steps N]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import results_file  # bench/results_file.py: the one writer of bench/results

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TARGET = 20.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline-steps", type=int, default=3000)
    parser.add_argument("--train-steps", type=int, default=60)
    args = parser.parse_args()
    os.environ.setdefault("GLOG_v", "3")

    from contracts.config import load_config
    from engine.data.feed import feed
    from engine.data.prepare import STDLIB, prepare
    from engine.rank import runtime
    from engine.rank.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "stdlib"
        prepare([STDLIB], corpus, log=open(os.devnull, "w"))
        cfg = load_config(ROOT / "configs" / "tiny.toml", [f'data.path="{corpus}"',
                                                           f"train.steps={args.train_steps + 5}"])
        rank_info = runtime.setup(cfg)
        tokens_per_step = cfg.train.global_batch * cfg.data.seq_len

        trainer = Trainer(cfg, rank_info)
        for _ in range(5):                       # compile and warm up
            trainer.train_step()
        events = [trainer.train_step() for _ in range(args.train_steps)]
        train_tps = tokens_per_step / statistics.median(e.step_s for e in events)
        waits = [e.data_wait_s for e in events]

        started = time.perf_counter()
        n = sum(1 for _ in feed(trainer.source, cursor=0, steps=args.pipeline_steps,
                                share=lambda indices: indices.reshape(1, -1), global_batch=cfg.train.global_batch,
                                prefetch_steps=cfg.data.prefetch_steps))
        pipeline_tps = n * tokens_per_step / (time.perf_counter() - started)

    ratio = pipeline_tps / train_tps
    print(f"pipeline delivers   {pipeline_tps:>12,.0f} tokens/s ({args.pipeline_steps} steps of {tokens_per_step} tokens)")
    print(f"training consumes   {train_tps:>12,.0f} tokens/s (tiny config, median of {args.train_steps} steps)")
    print(f"ratio               {ratio:>12.1f}x  (target >= {TARGET:.0f}x: {'met' if ratio >= TARGET else 'NOT met'})")
    print(f"step's data wait    median {statistics.median(waits) * 1e3:.2f} ms, max {max(waits) * 1e3:.2f} ms")
    results_file.write("data_throughput", {
        "pipeline_tokens_per_s": pipeline_tps, "train_tokens_per_s": train_tps,
        "ratio": ratio, "target_ratio": TARGET, "met": ratio >= TARGET,
        "median_data_wait_s": statistics.median(waits), "max_data_wait_s": max(waits)})


if __name__ == "__main__":
    main()
