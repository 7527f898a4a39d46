"""Whether the host's read of a step's results (loss, grad norm, overflow) holds the next step back.

The engine reads a step's outputs (`asnumpy`) before it launches the next: the daemon judges every
step. Where the graph runs asynchronously, that read is a host sync, and deferring it — launching
step N + 1 before reading step N, as a run that checks its loss every few steps or on another thread
would — lets the host prepare and launch the next step while the last one runs. This measures what
that buys on this host, one process, the config's own step (accumulation 1, one rank):
- the graph call's return against the read after it (medians): where the call returns at once and
  the read waits, the graph is asynchronous and the read is a host sync;
- blocks of steps run two ways, interleaved in rounds (the order alternating): one in flight (launch,
  read: the engine's way) and two in flight (launch N + 1, then read N): the median block's time a
  step, and their ratio (< 1: deferring the sync pays).
Tiny by default (`--configs` takes more, each measured in its own process). Writes bench/results/step_dispatch.json.

    python bench/step_dispatch.py [--configs configs/tiny.toml ...] [--rounds 12] [--steps 20]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=["configs/tiny.toml"])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20, help="steps a block")
    parser.add_argument("--one", help=argparse.SUPPRESS)      # measure this config in this process, print JSON
    args = parser.parse_args()
    if args.rounds < 2 or args.steps < 2:
        parser.error("--rounds and --steps must be >= 2")
    if args.one:
        print("RESULT " + json.dumps(measure(args.one, args.rounds, args.steps)))
        return
    results = {}
    for config in args.configs:
        out = subprocess.run([sys.executable, __file__, "--one", config, "--rounds", str(args.rounds),
                              "--steps", str(args.steps)], capture_output=True, text=True)
        line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
        if out.returncode or line is None:
            sys.exit(f"{config}: the measuring process failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
        r = results[config] = json.loads(line[len("RESULT "):])
        print(f"{config}: the graph call returns in {r['call_s_median'] * 1e3:.2f} ms, the read after it waits "
              f"{r['read_s_median'] * 1e3:.2f} ms (medians)")
        for way, what in (("one", "one in flight (launch, read)     "), ("two", "two in flight (the read deferred)")):
            lo, hi = r["step_s_range"][way]
            print(f"  a step, {what} {r['step_s'][way] * 1e3:8.2f} ms (median of {args.rounds} blocks of "
                  f"{args.steps}; {lo * 1e3:.2f}-{hi * 1e3:.2f})")
        print(f"  two in flight over one: x{r['two_over_one']:.2f}")
    results_file.write("step_dispatch", {"rounds": args.rounds, "block_steps": args.steps, "configs": results})


def measure(config: str, rounds: int, steps: int) -> dict:
    """The figures of one config, in this process."""
    os.environ.setdefault("GLOG_v", "3")
    sys.path.insert(0, str(ROOT))
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor

    from contracts.config import load_config
    from engine.data.prepare import STDLIB, prepare
    from engine.rank import runtime
    from engine.rank.trainer import Trainer

    with tempfile.TemporaryDirectory(dir=ROOT / "bench") as tmp:
        corpus = Path(tmp) / "stdlib"
        prepare([STDLIB], corpus, log=open(os.devnull, "w"))
        cfg = load_config(ROOT / config, [f'data.path="{corpus}"', "train.steps=1000000"])
        trainer = Trainer(cfg, runtime.setup(cfg))
        step = trainer.step_fn
        if step.accum_steps != 1 or getattr(step, "_make_local", None) is not None:
            sys.exit(f"{config}: one micro-batch a step and one rank only (this bench launches the fused graph)")
        for _ in range(5):
            trainer.train_step()                        # compiled and warm
        batch = Tensor(next(trainer._fed).batch[0])
        inputs = (Tensor(cfg.optim.lr * 0.01, ms.float32), Tensor(1.0, ms.float32), Tensor(np.zeros(1, np.int32)))

        def launch():
            return step._fused(batch, *inputs)

        def read(out) -> None:
            for x in out:
                x.asnumpy()

        return _race(launch, read, rounds, steps)


def _race(launch, read, rounds: int, steps: int) -> dict:
    """Blocks of `steps` steps one in flight and two in flight, `rounds` of each, the order alternating."""
    calls, reads = [], []

    def one_in_flight() -> float:
        started = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            out = launch()
            launched = time.perf_counter()
            read(out)
            calls.append(launched - t)
            reads.append(time.perf_counter() - launched)
        return (time.perf_counter() - started) / steps

    def two_in_flight() -> float:
        started = time.perf_counter()
        previous = launch()
        for _ in range(steps - 1):
            out = launch()
            read(previous)
            previous = out
        read(previous)
        return (time.perf_counter() - started) / steps

    ways = {"one": [], "two": []}
    for r in range(rounds):
        for name in (("one", "two") if r % 2 == 0 else ("two", "one")):
            ways[name].append((one_in_flight if name == "one" else two_in_flight)())

    one, two = statistics.median(ways["one"]), statistics.median(ways["two"])
    return {"call_s_median": statistics.median(calls), "read_s_median": statistics.median(reads),
            "step_s": {"one": one, "two": two},
            "step_s_range": {w: [min(v), max(v)] for w, v in ways.items()}, "two_over_one": two / one}


if __name__ == "__main__":
    main()
