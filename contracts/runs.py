"""What a run directory is (the marks a daemon or `train` leaves in one) and finding one from what an
operator types: a path, or a run name. Shared by the command line and the soak; stdlib only."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping


class RunNotFoundError(FileNotFoundError):
    """No run directory by that name or path; the message lists where it looked."""


RUN_MARKS = ("state.json", "checkpoints", "control", "daemon.lock", "logs")   # what a daemon or `train` leaves


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / mark).exists() for mark in RUN_MARKS)


def resolve_run_dir(run: str, env: Mapping[str, str] = os.environ) -> Path:
    """A run directory as given; else the name under $STATE_DIRECTORY (systemd), ./runs or
    /var/lib/llm-pretrain. A directory with none of RUN_MARKS (say, /etc) is no run."""
    path = Path(run)
    if is_run_dir(path):
        return path
    candidates = []
    state = env.get("STATE_DIRECTORY")
    if state:
        candidates.append(Path(state.split(":")[0]) / run)
    candidates += [Path("runs") / run, Path("/var/lib/llm-pretrain") / run]
    for candidate in candidates:
        if is_run_dir(candidate):
            return candidate
    if path.is_dir():
        raise RunNotFoundError(f"{run} is a directory but not a run: it has none of {', '.join(RUN_MARKS)}")
    tried = ", ".join(dict.fromkeys(str(c) for c in [path, *candidates]))
    raise RunNotFoundError(f"no run {run!r}: tried {tried}")
