"""What a rank that ended with an error wrote last: a device out-of-memory, its refusal, or its error.

A refusal is the one line `llm-pretrain: …` a rank prints before it exits 2, 65 or 78 (a usage,
data or config error that restarting cannot help): the daemon's own last line carries it.

On Ascend the kernel's OOM killer is not involved: the device allocator
fails and MindSpore raises. The messages below are MindSpore 2.x's own
(strings of its memory pool and runtime libraries) and CANN's error code for
a failed device allocation; they are matched only in the tail of the log of
a rank that has already exited with an error. Not verified on hardware here.
"""
from __future__ import annotations

import re
from pathlib import Path

# the last line of a Python traceback: `json.decoder.JSONDecodeError: Expecting value: …`, `RuntimeError: …`
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit|Warning)(?::\s.*)?$")

_PATTERNS = re.compile(r"memory isn't enough|Out of Memory!!!|Malloc device memory failed|EL0004|"
                       r"out of memory", re.IGNORECASE)
TAIL_BYTES = 65536
PREFIX = "llm-pretrain: "      # how the command line says why it ends


def _tail(log_path: Path, start: int) -> str | None:
    """The log's last TAIL_BYTES after byte `start` (where this process's output begins)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(start, f.tell() - TAIL_BYTES))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return None


def oom_line(log_path: Path, start: int = 0) -> str | None:
    """The last line of this process's part of the log that reports a device out-of-memory, or None."""
    hits = [line.strip() for line in (_tail(log_path, start) or "").splitlines() if _PATTERNS.search(line)]
    return hits[-1][:300] if hits else None


def refusal_line(log_path: Path, start: int = 0) -> str | None:
    """The rank's own one-line reason for ending with a usage, data or config error (without its
    `llm-pretrain: ` prefix), or None."""
    said = [line.strip()[len(PREFIX):] for line in (_tail(log_path, start) or "").splitlines()
            if line.startswith(PREFIX)]
    return said[-1][:500] if said else None


def error_line(log_path: Path, start: int = 0) -> str | None:
    """Why a rank that crashed says it did: the last exception line of a Python traceback in this process's
    part of the log (MindSpore's errors included), else its last `llm-pretrain: ` line; None if neither."""
    lines = [line.strip() for line in (_tail(log_path, start) or "").splitlines()]
    raised = [line for line in lines if _EXCEPTION.match(line)]
    if raised:
        return raised[-1][:300]
    return refusal_line(log_path, start)


def plog_dir(log_dir: Path, rank: int) -> Path:
    """Where an Ascend rank's CANN logs (plog) go (ASCEND_PROCESS_LOG_PATH, unless the operator set it): beside its
    own log, so the daemon reads HCCL's verdicts from them."""
    return log_dir / "plog" / f"rank-{rank}"


def hccl_verdicts(log_path: Path, start: int, plogs: Path | None, since_unix_s: float) -> list[dict]:
    """HCCL's located faults (daemon.judging.hccl_verdicts) in this process's part of its log and in the plog files
    written since `since_unix_s` (each file's tail), as dicts for the incident."""
    from daemon.judging import hccl_verdicts as hccl

    texts = [_tail(log_path, start) or ""]
    if plogs is not None and plogs.is_dir():
        for path in sorted(plogs.rglob("*.log")):
            try:
                if path.stat().st_mtime >= since_unix_s:
                    texts.append(_tail(path, 0) or "")
            except OSError:
                continue
    return [v.to_dict() for v in hccl.verdicts(line for text in texts for line in text.splitlines())]
