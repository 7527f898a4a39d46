"""What the RAM tier of checkpoints costs the training step, on the tiny config.

Two measures, side by side in one process:
- per save (judged against the target): cycles of 2 x interval steps with a RAM
  save after the first step, every step timed. A save costs its blocking time
  (the host copy) plus how much longer each of the `interval` steps after it
  ran than the steps of the cycle's second half, at least `interval` steps from
  any save: medians per position over all cycles, so a drift in the machine's
  speed moves both alike. That cost over `interval` steps is the throughput
  lost at one RAM checkpoint per interval (target <= 2% at 10): the excess is
  printed per position; it is gone by the third step after a save (measured),
  so saves 10 steps apart do not add up differently. (Cycles without a save as
  the baseline instead, alternating, were tried: their steps ran ~0.4 ms slower
  than the far steps of the saving cycles (one run of 250, the thread writer), a
  bias larger than the cost measured, so they are not used.)
- windows: throughput of windows with a save every interval against windows
  without, adjacent pairs in ABBA order, the median of the pairs' losses with
  its quartiles: the figure a user sees, and how noisy this machine makes it
  (whole windows moved +-10% on a shared 2-core VM).
Also the writer process's CPU a save. Prints the figures and writes
bench/results/ram_tier.json.

    python bench/ram_tier.py [--cycles N] [--pairs N] [--window-steps N] [--interval-steps N]
"""
from __future__ import annotations

import argparse
import json
import os
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
    parser.add_argument("--cycles", type=int, default=300, help="cycles of 2 x interval steps, one save each")
    parser.add_argument("--pairs", type=int, default=6, help="pairs of windows (one plain, one saving)")
    parser.add_argument("--window-steps", type=int, default=200)
    parser.add_argument("--interval-steps", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("GLOG_v", "3")

    from engine import runtime
    from engine.checkpoint import TrainerCheckpoints
    from engine.config import load_config
    from engine.prepare import STDLIB, prepare
    from engine.worker import Trainer

    interval = args.interval_steps
    with tempfile.TemporaryDirectory(dir=ROOT / "bench") as tmp:
        corpus = Path(tmp) / "stdlib"
        prepare([STDLIB], corpus, log=open(os.devnull, "w"))
        cfg = load_config(ROOT / "configs" / "tiny.toml", [
            f'data.path="{corpus}"', "train.steps=1000000", f"checkpoint.memory_interval_steps={interval}"])
        trainer = Trainer(cfg, runtime.setup(cfg))
        events = []
        ckpt = TrainerCheckpoints(Path(tmp) / "checkpoints", cfg, params=trainer.state_params(),
                                  run_state=trainer.run_state, load_run_state=trainer.load_run_state, rank=0,
                                  world=1, generation=0, emit=events.append)
        state_bytes = sum(p.asnumpy().nbytes for p in ckpt.params)
        for _ in range(5):
            trainer.train_step()
        blocking: list[float] = []

        def save() -> None:
            s = time.perf_counter()
            ckpt.save({}, memory=True)
            blocking.append(time.perf_counter() - s)

        # per save: cycles of 2 x interval steps with a save after the first, every step timed by its
        # position; the baseline is the second half of the same cycles (at least `interval` steps from
        # any save), so a drift in the machine's speed moves both alike
        save()                                          # the writer (process) started before timing
        ckpt.wait()
        writer_cpu_before = _cpu_s(getattr(ckpt.memory_writer, "pid", None))
        by_position: list[list[float]] = [[] for _ in range(2 * interval)]
        for _ in range(args.cycles):
            for k in range(2 * interval):
                t = time.perf_counter()
                trainer.train_step()
                by_position[k].append(time.perf_counter() - t)
                if k == 0:
                    save()
            ckpt.poll()
        ckpt.wait()
        writer_cpu = _cpu_s(getattr(ckpt.memory_writer, "pid", None))
        writer_cpu_per_save = ((writer_cpu - writer_cpu_before) / args.cycles
                               if writer_cpu is not None and writer_cpu_before is not None else None)
        baseline = statistics.median(t for k in range(interval + 1, 2 * interval) for t in by_position[k])
        excess = [statistics.median(by_position[k]) - baseline for k in range(1, interval + 1)]
        cost = statistics.median(blocking) + sum(excess)
        loss = cost / (interval * baseline)

        def window(saving: bool) -> float:
            t = time.perf_counter()
            for _ in range(args.window_steps):
                trainer.train_step()
                if saving and trainer.step % interval == 0:
                    save()
            elapsed = time.perf_counter() - t
            ckpt.wait()
            return args.window_steps / elapsed

        # windows: adjacent pairs, in turn plain-first and saving-first (ABBA)
        plain, saving, pair_losses = [], [], []
        for r in range(args.pairs):
            got = {s: window(s) for s in ((False, True) if r % 2 == 0 else (True, False))}
            plain.append(got[False])
            saving.append(got[True])
            pair_losses.append(1 - got[True] / got[False])
        ckpt.poll()
        committed = sum(e.stage == "in_memory" for e in events)
        failed = [e.detail for e in events if e.stage == "in_memory_failed"]
        ckpt.drop_memory_tier()              # its writer process ends, the tier is deleted

    window_loss = statistics.median(pair_losses)
    quartiles = statistics.quantiles(pair_losses, n=4) if len(pair_losses) > 1 else [window_loss] * 3
    print(f"tiny: {state_bytes / 1e6:.1f} MB of state; step {baseline * 1e3:.2f} ms (median, >= {interval} steps "
          f"from a save); "
          f"{committed} RAM checkpoints committed, {len(failed)} failed")
    print(f"a RAM save blocks the step        {statistics.median(blocking) * 1e3:6.2f} ms (median of {len(blocking)})")
    print(f"the steps after it run longer by  " + " ".join(f"{e * 1e3:+.2f}" for e in excess)
          + f" ms (each position's median against the steps {interval + 1}..{2 * interval - 1} after it; "
          f"{args.cycles} cycles)")
    if writer_cpu_per_save is not None:
        print(f"the writer process's CPU a save   {writer_cpu_per_save * 1e3:6.2f} ms (from /proc, 10 ms ticks)")
    print(f"cost of a save (blocking + after) {cost * 1e3:6.2f} ms = {loss:.1%} of {interval} steps "
          f"(target <= {TARGET_LOSS:.0%}: {'met' if loss <= TARGET_LOSS else 'NOT met'})")
    print(f"windows of {args.window_steps} steps: throughput lost {window_loss:+.1%} with a save every {interval} "
          f"(median of {len(pair_losses)} ABBA pairs; quartiles {quartiles[0]:+.1%} .. {quartiles[2]:+.1%}: "
          "this machine's noise)")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "ram_tier.json").write_text(json.dumps({
        "benchmark": "ram_tier", "config": "configs/tiny.toml", "state_bytes": state_bytes,
        "interval_steps": interval, "cycles": args.cycles, "step_s": baseline, "blocking_s_median": statistics.median(blocking),
        "excess_s_by_position": excess, "cost_s_per_save": cost, "throughput_loss": loss,
        "writer_cpu_s_per_save": writer_cpu_per_save, "target_throughput_loss": TARGET_LOSS,
        "window_steps_per_s_plain": plain, "window_steps_per_s_saving": saving, "window_pair_losses": pair_losses,
        "window_loss_median": window_loss, "window_loss_quartiles": [quartiles[0], quartiles[2]],
        "committed": committed, "failed": failed,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2) + "\n")


def _cpu_s(pid: int | None) -> float | None:
    """A process's user + system CPU seconds so far (None: no such process, or none given)."""
    if pid is None:
        return None
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    main()
