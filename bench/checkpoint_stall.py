"""What a disk checkpoint costs the training step, on the ~20M-parameter config, with each shard checksum.

Measured side by side in one process (small-20m: 20.5M parameters, ~245 MB of state with the AdamW
moments; the batch cut to 2 sequences of 64 tokens so a block of steps takes seconds on 2 CPU cores —
the state, and so the checkpoint, is the full size), for `checkpoint.checksum` = sha256 and crc32c,
each shard written past the page cache (O_DIRECT, the writer's default: durable.write_direct), and
crc32c through the page cache beside them (as the writer wrote before):
1. the step-blocking time of an async save (the host copy; then training goes on) against a
   synchronous save (copy, serialise, checksum, write, fsync, commit) — target: blocking ≤ 10 %;
   the copy runs on the rank's share of the CPUs (checkpointing.staging_copy), and is measured on
   one thread beside it;
   and the CPU seconds a save costs (the process's CPU time over a synchronous save);
2. what a save costs the training around it: blocks of --block-steps steps in rounds — none, none
   (the A/A control), one save at the block's first step in each variant, in rotating order —
   timed to the save's end (the block waits for its writer before it stops the clock). A save's cost
   is its block's time less the mean of its round's two plain blocks; mean ± standard error over
   --quads. The throughput lost with a save every --interval-steps (50) is that cost over the
   interval's plain time — target ≤ 2 % (issue 50). A ratio of two long windows with and without
   saves, as this bench measured before, moved by ±5 % between runs on a shared host.
Prints the figures and writes bench/results/checkpoint_stall.json.

    python bench/checkpoint_stall.py [--quads N] [--block-steps N] [--interval-steps N]
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
# name -> (checkpoint.checksum, checkpoint.direct_io): the default's write beside the buffered one
VARIANTS = {"sha256": ("sha256", True), "crc32c": ("crc32c", True), "crc32c_buffered": ("crc32c", False)}
CHECKSUMS = ("sha256", "crc32c")
TARGETS = {"blocking_over_synchronous": 0.10, "throughput_loss": 0.02}


def _mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0)


def _blocking_on_one_thread(trainer, ckpt) -> float:
    """A save's blocking part with its staging copy on one thread (as before checkpointing.staging_copy)."""
    from checkpointing.staging_copy import StagingCopier

    kept, ckpt._copier = ckpt._copier, StagingCopier(1)
    try:
        trainer.train_step()
        t = time.perf_counter()
        ckpt.save({})
        took = time.perf_counter() - t
        ckpt.wait()
        return took
    finally:
        ckpt._copier = kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quads", type=int, default=16)
    parser.add_argument("--block-steps", type=int, default=20)
    parser.add_argument("--interval-steps", type=int, default=50)
    parser.add_argument("--sync-repeats", type=int, default=5)
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
        base = [f'data.path="{corpus}"', *BATCH, "checkpoint.keep_last=2"]
        cfg = load_config(ROOT / "configs" / "small-20m.toml", base)
        trainer = Trainer(cfg, runtime.setup(cfg))
        events = []
        configs = {v: load_config(ROOT / "configs" / "small-20m.toml",
                                  [*base, f'checkpoint.checksum="{c}"', f"checkpoint.direct_io={str(d).lower()}"])
                   for v, (c, d) in VARIANTS.items()}
        ckpts = {v: TrainerCheckpoints(Path(tmp) / f"checkpoints-{v}", configs[v],
                                       params=trainer.state_params(), run_state=trainer.run_state,
                                       load_run_state=trainer.load_run_state, rank=0, world=1, generation=0,
                                       emit=events.append, parallelism=trainer.parallelism, retain=True)
                 for v in VARIANTS}
        state_bytes = sum(p.asnumpy().nbytes for p in ckpts[CHECKSUMS[0]].params)
        for _ in range(3):
            trainer.train_step()
        for ckpt in ckpts.values():           # each writer's first save allocates its buffers: not timed
            ckpt.save({})
            ckpt.wait()

        blocking = {c: [] for c in VARIANTS}
        synchronous = {c: [] for c in VARIANTS}
        one_thread: list[float] = []          # the blocking copy on the caller's thread alone, side by side
        cpu = {c: [] for c in VARIANTS}
        for _ in range(args.sync_repeats):
            for c, ckpt in ckpts.items():
                trainer.train_step()
                t = time.perf_counter()
                ckpt.save({})
                blocking[c].append(time.perf_counter() - t)
                ckpt.wait()
                trainer.train_step()
                t, used = time.perf_counter(), time.process_time()
                ckpt.save({})
                ckpt.wait()
                synchronous[c].append(time.perf_counter() - t)
                cpu[c].append(time.process_time() - used)
            one_thread.append(_blocking_on_one_thread(trainer, ckpts[CHECKSUMS[-1]]))

        def block(kind: str | None) -> float:
            t = time.perf_counter()
            for k in range(args.block_steps):
                trainer.train_step()
                if kind and k == 0:
                    ckpts[kind].save({})
            if kind:
                ckpts[kind].wait()            # the save's cost is all inside its block
            return time.perf_counter() - t

        kinds = [None, None, *VARIANTS]
        costs = {c: [] for c in VARIANTS}
        control, plain = [], []
        for q in range(args.quads):
            order = kinds[q % len(kinds):] + kinds[:q % len(kinds)]
            times, plains = {}, []
            for kind in order:
                s = block(kind)
                if kind is None:
                    plains.append(s)
                else:
                    times[kind] = s
            base_s = statistics.fmean(plains)
            plain.extend(plains)
            control.append(plains[1] - plains[0])
            for c in VARIANTS:
                costs[c].append(times[c] - base_s)
        waited = [e for e in events if e.stage == "waited"]
        failed = [e for e in events if e.stage == "failed"]

    step_s = statistics.median(plain) / args.block_steps
    interval_s = args.interval_steps * step_s
    per = {}
    print(f"state: {parameter_count(trainer.net):,} parameters, {state_bytes / 1e6:.0f} MB with optimizer state; "
          f"a step {1000 * step_s:.0f} ms; {results_file.host()['cpu']}")
    print(f"{'variant':>15} {'blocking':>9} {'sync s':>7} {'ratio':>6} {'CPU s':>6} {'cost s/save':>16} "
          f"{'lost @' + str(args.interval_steps):>16}")
    for c in VARIANTS:
        b, s = statistics.median(blocking[c]), statistics.median(synchronous[c])
        cost, se = _mean_se(costs[c])
        per[c] = {"blocking_s": blocking[c], "synchronous_s": synchronous[c], "cpu_s": cpu[c],
                  "blocking_over_synchronous": b / s, "cpu_s_per_save": statistics.median(cpu[c]),
                  "cost_s_per_save": cost, "cost_s_per_save_se": se, "costs_s": costs[c],
                  "throughput_loss": cost / (interval_s + cost), "throughput_loss_se": se / (interval_s + cost)}
        r = per[c]
        print(f"{c:>15} {b:>9.3f} {s:>7.3f} {r['blocking_over_synchronous']:>6.1%} {r['cpu_s_per_save']:>6.2f} "
              f"{cost:>9.3f} ± {se:.3f} {r['throughput_loss']:>9.2%} ± {r['throughput_loss_se']:.2%}")
    threads = ckpts[CHECKSUMS[-1]]._copier.threads
    print(f"the blocking copy on {threads} thread(s): {statistics.median(blocking[CHECKSUMS[-1]]):.3f} s; on one: "
          f"{statistics.median(one_thread):.3f} s ({CHECKSUMS[-1]}, side by side)")
    aa, aa_se = _mean_se(control)
    print(f"A/A control (plain − plain): {aa:+.3f} ± {aa_se:.3f} s a block; {len(waited)} saves waited, "
          f"{len(failed)} failed; targets: blocking ≤ {TARGETS['blocking_over_synchronous']:.0%}, "
          f"lost ≤ {TARGETS['throughput_loss']:.0%}")
    default = cfg.checkpoint.checksum             # the config's default
    results_file.write("checkpoint_stall", {
        "config": "configs/small-20m.toml", "overrides": BATCH, "state_bytes": state_bytes,
        "interval_steps": args.interval_steps, "block_steps": args.block_steps, "quads": args.quads,
        "step_s": step_s, "control_s": aa, "control_s_se": aa_se,
        "checksums": {c: per[c] for c in CHECKSUMS}, "buffered": per["crc32c_buffered"], "default_checksum": default,
        # the default checksum's figures, where the table reads them
        "blocking_over_synchronous": per[default]["blocking_over_synchronous"],
        "throughput_loss": per[default]["throughput_loss"], "steps_per_s_plain": [1 / step_s],
        "saves_waited": len(waited), "targets": TARGETS,
        "staging_threads": threads, "blocking_one_thread_s": one_thread})


if __name__ == "__main__":
    main()
