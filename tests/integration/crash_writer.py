"""A numpy-only checkpoint writer for crash tests: saves step 1, 2, 3, … until killed.

Two ranks' writers in one process (threads; the RAM tier's: child processes),
so the shard markers and the commit are exercised. Step s's tensors are filled
with s, so a loader can check that what it got is exactly one step's state.
Prints each step once saved, after the first the pids of any writer processes.
"""
import sys
from pathlib import Path

import numpy as np

from checkpointing.writer import ShardWriter
from checkpointing.writer_process import ProcessShardWriter

SHAPES = {"a": (512, 512), "b": (256, 1024), "c": (1000,), "d": (300, 300)}
PLAN = {"a": 0, "b": 1, "c": 0, "d": 1}


def tensors(step: int, rank: int) -> dict:
    return {n: np.full(s, step, dtype=np.float32) for n, s in SHAPES.items() if PLAN[n] == rank}


def main(root: str, tier: str = "disk") -> None:
    """tier "ram": the RAM tier's writers (in processes of their own, CRC32C, each save written over
    a retired shard)."""
    kind, ram = ((ProcessShardWriter, dict(checksum="crc32c", recycle=True, latest_hint=False)) if tier == "ram"
                 else (ShardWriter, {}))
    writers = [kind(Path(root), rank=r, world=2, keep_last=2, low_priority=False, **ram) for r in range(2)]
    step = 0
    while True:
        step += 1
        writers[1].save(step, tensors(step, 1))
        writers[0].save(step, tensors(step, 0), run_state={"step": step})
        for w in writers:
            w.wait()
        pids = [w.pid for w in writers if getattr(w, "pid", None)] if step == 1 else []
        print(step, *pids, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
