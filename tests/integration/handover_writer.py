"""A rank's last RAM save handed to its writer process, then the rank's end: for the tests that the save lands.

    python -m tests.integration.handover_writer ROOT kill|stay [WORLD]

Saves step 1 of one 64-MB tensor filled with 1 through a ProcessShardWriter (the RAM tier's options) and waits
for it (the writer process is running), then step 2 filled with 7, prints the writer process's pid as soon as
save() returns, then SIGKILLs itself ("kill") or sleeps until a signal ends it ("stay": the daemon's teardown
SIGTERMs its process group). WORLD (1): with more, this is rank 0 of a checkpoint whose other ranks never save —
the committer waits for shards that never come (no step 1 first, for that reason).
"""
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from checkpointing.writer_process import ProcessShardWriter

VALUE, ELEMENTS = 7.0, 16 << 20          # 64 MB: writing and checksumming it takes the writer tens of ms


def main(root: str, end: str, world: str = "1") -> None:
    writer = ProcessShardWriter(Path(root), rank=0, world=int(world), keep_last=2, low_priority=False, checksum="crc32c",
                                recycle=True, latest_hint=False)
    staging = writer.staging({"w": np.empty(ELEMENTS, np.float32)})
    if world == "1":
        staging["w"].fill(1.0)
        writer.save(1, staging, run_state={"step": 1})
        writer.wait()
    staging["w"].fill(VALUE)
    writer.save(2, staging, run_state={"step": 2})
    print(writer.pid, flush=True)
    if end == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main(*sys.argv[1:])
