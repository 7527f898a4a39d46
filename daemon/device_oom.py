"""Telling a device out-of-memory from other crashes by what the rank wrote last.

On Ascend the kernel's OOM killer is not involved: the device allocator
fails and MindSpore raises. The messages below are MindSpore 2.x's own
(strings of its memory pool and runtime libraries) and CANN's error code for
a failed device allocation; they are matched only in the tail of the log of
a rank that has already exited with an error. Not verified on hardware here.
"""
from __future__ import annotations

import re
from pathlib import Path

_PATTERNS = re.compile(r"memory isn't enough|Out of Memory!!!|Malloc device memory failed|EL0004|"
                       r"out of memory", re.IGNORECASE)
TAIL_BYTES = 65536


def oom_line(log_path: Path, start: int = 0) -> str | None:
    """The last line of the log's tail (after byte `start`, where this process's output begins)
    that reports a device out-of-memory, or None."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(start, f.tell() - TAIL_BYTES))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    hits = [line.strip() for line in tail.splitlines() if _PATTERNS.search(line)]
    return hits[-1][:300] if hits else None
