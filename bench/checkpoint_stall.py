"""What checkpointing costs the training step, on the ~20M-parameter config.

Measured side by side in one process, interleaved, medians:
1. the step-blocking time of an async save (host copy, then training goes on)
   against the time of a synchronous save (host copy, serialise, sha256,
   fsync, commit) — target: blocking <= 10% of synchronous;
2. training throughput with a checkpoint every 50 steps against none —
   target: at most 5% lower.
The model is configs/small-20m.toml (20.5M parameters, ~245 MB of state with
the AdamW moments); the batch is cut to 2 sequences of 64 tokens so that a
window of 100 steps takes seconds rather than minutes on 2 CPU cores — the
state, and so the checkpoint, is the full size. Prints the ratios and writes
bench/results/checkpoint_stall.json.

    python bench/checkpoint_stall.py [--repeats N] [--window-steps N]
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
BATCH = ["train.global_batch=2", "train.micro_batch=2", "data.seq_len=64", "train.steps=100000"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--window-steps", type=int, default=100)
    parser.add_argument("--interval-steps", type=int, default=50)
    args = parser.parse_args()
    os.environ.setdefault("GLOG_v", "3")

    from contracts.config import load_config
    from engine.data.prepare import STDLIB, prepare
    from engine.model.causal_lm import parameter_count
    from engine.rank import runtime
    from engine.rank.checkpoint import TrainerCheckpoints
    from engine.rank.trainer import Trainer

    with tempfile.TemporaryDirectory(dir=ROOT / "bench") as tmp:
        corpus = Path(tmp) / "stdlib"
        prepare([STDLIB], corpus, log=open(os.devnull, "w"))
        cfg = load_config(ROOT / "configs" / "small-20m.toml", [f'data.path="{corpus}"', *BATCH,
                                                                "checkpoint.keep_last=2"])
        trainer = Trainer(cfg, runtime.setup(cfg))
        events = []
        ckpt = TrainerCheckpoints(Path(tmp) / "checkpoints", cfg, params=trainer.state_params(),
                                  run_state=trainer.run_state, load_run_state=trainer.load_run_state, rank=0,
                                  world=1, generation=0, emit=events.append, parallelism=trainer.parallelism,
                                  retain=True)
        state_bytes = sum(p.asnumpy().nbytes for p in ckpt.params)
        for _ in range(3):
            trainer.train_step()

        blocking, synchronous = [], []
        for _ in range(args.repeats):
            trainer.train_step()
            t = time.perf_counter()
            ckpt.save({})
            blocking.append(time.perf_counter() - t)
            ckpt.wait()
            trainer.train_step()
            t = time.perf_counter()
            ckpt.save({})
            ckpt.wait()
            synchronous.append(time.perf_counter() - t)

        def window(save: bool) -> float:
            t = time.perf_counter()
            for _ in range(args.window_steps):
                trainer.train_step()
                if save and trainer.step % args.interval_steps == 0:
                    ckpt.save({})
            elapsed = time.perf_counter() - t
            ckpt.wait()                       # let the last save finish outside the timed window
            return args.window_steps / elapsed

        plain, saving = [], []
        for _ in range(args.repeats):
            plain.append(window(False))
            saving.append(window(True))
        waited = [e for e in events if e.stage == "waited"]
        failed = [e for e in events if e.stage == "failed"]

    block_ratio = statistics.median(blocking) / statistics.median(synchronous)
    loss = 1 - statistics.median(saving) / statistics.median(plain)
    print(f"state: {parameter_count(trainer.net):,} parameters, {state_bytes / 1e6:.0f} MB with optimizer state")
    print(f"async save blocks the step  {statistics.median(blocking):8.3f} s (median of {args.repeats})")
    print(f"synchronous save takes      {statistics.median(synchronous):8.3f} s")
    print(f"blocking / synchronous      {block_ratio:8.1%}   (target <= 10%: {'met' if block_ratio <= 0.10 else 'NOT met'})")
    print(f"steps/s without saves       {statistics.median(plain):8.3f}")
    print(f"steps/s, save every {args.interval_steps:<3}     {statistics.median(saving):8.3f}   "
          f"({len(waited)} saves waited for the previous one, {len(failed)} failed)")
    print(f"throughput loss             {loss:8.1%}   (target <= 5%: {'met' if loss <= 0.05 else 'NOT met'})")
    results_file.write("checkpoint_stall", {
        "config": "configs/small-20m.toml", "overrides": BATCH,
        "state_bytes": state_bytes, "blocking_s": blocking, "synchronous_s": synchronous,
        "blocking_over_synchronous": block_ratio, "steps_per_s_plain": plain, "steps_per_s_saving": saving,
        "interval_steps": args.interval_steps, "throughput_loss": loss, "saves_waited": len(waited),
        "targets": {"blocking_over_synchronous": 0.10, "throughput_loss": 0.05}})


if __name__ == "__main__":
    main()
