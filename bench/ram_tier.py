"""What the RAM tier of checkpoints costs the training step, on the tiny config.

Side by side in one process, interleaved windows, medians: training throughput
with a RAM checkpoint (checkpoint.memory_interval_steps) every 10 steps against
none — target: at most 2% lower — and how long a RAM save blocks the step (the
host copy; writing to the tmpfs, hashing and the commit run on the writer's
thread), and the process's CPU time a step with and without (every thread's: what the saves
cost in CPU, which other tenants of a shared machine move less than they move throughput).
Prints the ratio and writes bench/results/ram_tier.json.

    python bench/ram_tier.py [--repeats N] [--window-steps N] [--interval-steps N]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TARGET_LOSS = 0.02


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--window-steps", type=int, default=200)
    parser.add_argument("--interval-steps", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("GLOG_v", "3")

    from engine import runtime
    from engine.checkpoint import TrainerCheckpoints
    from engine.config import load_config
    from engine.prepare import STDLIB, prepare
    from engine.worker import Trainer

    with tempfile.TemporaryDirectory(dir=ROOT / "bench") as tmp:
        corpus = Path(tmp) / "stdlib"
        prepare([STDLIB], corpus, log=open(os.devnull, "w"))
        cfg = load_config(ROOT / "configs" / "tiny.toml", [
            f'data.path="{corpus}"', "train.steps=1000000", f"checkpoint.memory_interval_steps={args.interval_steps}"])
        trainer = Trainer(cfg, runtime.setup(cfg))
        events = []
        ckpt = TrainerCheckpoints(Path(tmp) / "checkpoints", cfg, params=trainer.state_params(),
                                  run_state=trainer.run_state, load_run_state=trainer.load_run_state, rank=0,
                                  world=1, generation=0, emit=events.append)
        state_bytes = sum(p.asnumpy().nbytes for p in ckpt.params)
        for _ in range(5):
            trainer.train_step()
        blocking: list[float] = []

        cpu = {False: [], True: []}      # the process's CPU seconds a step (every thread, the writer's too)

        def window(save: bool) -> float:
            t, c = time.perf_counter(), time.process_time()
            for _ in range(args.window_steps):
                trainer.train_step()
                if save and trainer.step % args.interval_steps == 0:
                    s = time.perf_counter()
                    ckpt.save({}, memory=True)
                    blocking.append(time.perf_counter() - s)
            elapsed = time.perf_counter() - t
            ckpt.wait()
            cpu[save].append((time.process_time() - c) / args.window_steps)
            return args.window_steps / elapsed

        plain, saving = [], []
        for _ in range(args.repeats):
            plain.append(window(False))
            saving.append(window(True))
        committed = sum(e.stage == "in_memory" for e in events)
        failed = [e.detail for e in events if e.stage == "in_memory_failed"]
        step_s = 1 / statistics.median(plain)
        shutil.rmtree(ckpt.memory_root, ignore_errors=True)

    loss = 1 - statistics.median(saving) / statistics.median(plain)
    print(f"tiny: {state_bytes / 1e6:.1f} MB of state; step {step_s * 1e3:.1f} ms")
    print(f"steps/s without RAM checkpoints   {statistics.median(plain):8.2f} (median of {args.repeats} windows "
          f"of {args.window_steps} steps)")
    print(f"steps/s, RAM checkpoint every {args.interval_steps:<3} {statistics.median(saving):8.2f}   "
          f"({committed} committed, {len(failed)} failed)")
    share = statistics.median(blocking) / (args.interval_steps * step_s)
    print(f"a RAM save blocks the step        {statistics.median(blocking) * 1e3:8.2f} ms (median): "
          f"{share:.1%} of {args.interval_steps} steps, the part of the cost that is not noise")
    cpu_plain, cpu_saving = statistics.median(cpu[False]), statistics.median(cpu[True])
    cpu_share = cpu_saving / cpu_plain - 1
    print(f"CPU a step (all threads)          {cpu_plain * 1e3:8.2f} ms without, {cpu_saving * 1e3:.2f} ms with: "
          f"{cpu_share:+.1%} (what the saves cost, less moved by other tenants than throughput)")
    print(f"throughput loss                   {loss:8.1%}   (target <= {TARGET_LOSS:.0%}: "
          f"{'met' if loss <= TARGET_LOSS else 'NOT met'})")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "ram_tier.json").write_text(json.dumps({
        "benchmark": "ram_tier", "config": "configs/tiny.toml", "state_bytes": state_bytes,
        "interval_steps": args.interval_steps, "steps_per_s_plain": plain, "steps_per_s_saving": saving,
        "blocking_s": blocking, "blocking_share": share, "throughput_loss": loss, "committed": committed, "failed": failed,
        "cpu_s_per_step_plain": cpu[False], "cpu_s_per_step_saving": cpu[True], "cpu_share": cpu_share,
        "target_throughput_loss": TARGET_LOSS,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2) + "\n")


if __name__ == "__main__":
    main()
