"""Finding a run's directory from what an operator types: a path, or a run name."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping


class RunNotFoundError(FileNotFoundError):
    """No run directory by that name or path; the message lists where it looked."""


def resolve_run_dir(run: str, env: Mapping[str, str] = os.environ) -> Path:
    """A directory as given if it exists; else the name under $STATE_DIRECTORY (systemd) or ./runs."""
    path = Path(run)
    if path.is_dir():
        return path
    candidates = []
    state = env.get("STATE_DIRECTORY")
    if state:
        candidates.append(Path(state.split(":")[0]) / run)
    candidates += [Path("runs") / run, Path("/var/lib/llm-pretrain") / run]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    tried = ", ".join(dict.fromkeys(str(c) for c in [path, *candidates]))
    raise RunNotFoundError(f"no run {run!r}: tried {tried}")
