"""What `run` starts as each rank and as MindSpore's scheduler: this project's engine, or a user's training script
(`[script]`, docs/bring-your-own-script.md) run by its own interpreter with `llm_pretrain_client` installed.

Owns: the two commands, the script's interpreter and working directory resolved to absolute paths (the daemon
may run elsewhere: systemd, another shell), and the checks a script can fail before any rank starts — each a
one-line ConfigError (exit 78) naming what is wrong.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from contracts.config import Config, with_changes
from contracts.errors import ConfigError

CLIENT = "llm_pretrain_client"
# Finds the client without importing it (its import loads MindSpore: seconds): exit 0 when it is there.
_FIND_CLIENT = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({CLIENT!r}) is None)"


def commands(cfg: Config, *, allow_config_change: bool = False) -> tuple[Config, list[str], list[str]]:
    """(the config with the script's paths resolved, the rank's command, the scheduler's command)."""
    if not cfg.script.command:
        worker = [sys.executable, "-m", "cli", "train", *(["--allow-config-change"] if allow_config_change else [])]
        return cfg, worker, [sys.executable, "-m", "engine.rank.scheduler"]
    cfg = resolved(cfg)
    python = cfg.script.python
    return cfg, [python, *cfg.script.argv], [python, "-m", f"{CLIENT}.scheduler"]


def resolved(cfg: Config) -> Config:
    """script.python and script.cwd as absolute paths, checked: the interpreter runs, the directory exists, the
    script (the command's first argument, unless it is an option such as -m) is a file there, and the
    interpreter finds llm_pretrain_client."""
    cwd = Path(cfg.script.cwd or os.getcwd()).expanduser().absolute()
    if not cwd.is_dir():
        raise ConfigError(f"script.cwd = {str(cwd)!r} is not a directory: give the directory the script runs in "
                          "(\"\" = where `run` is started)")
    python = _interpreter(cfg.script.python, cwd)
    first = cfg.script.argv[0]
    if not first.startswith("-") and not (cwd / first).is_file():
        raise ConfigError(f"script.command names {first!r}, which is not a file in {cwd}: give the script's path "
                          "(relative to script.cwd, or absolute), or a module as \"-m package.module\"")
    found = subprocess.run([python, "-c", _FIND_CLIENT], cwd=cwd, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=60, check=False)
    if found.returncode != 0:
        raise ConfigError(f"script.python = {python!r} cannot import {CLIENT}, which a supervised script reports "
                          "through: install it into the script's environment (pip install <this repo>/client), "
                          "or give the interpreter that has it")
    return with_changes(cfg, {"script.python": python, "script.cwd": str(cwd)})


def _interpreter(python: str, cwd: Path) -> str:
    if not python:
        return sys.executable
    found = shutil.which(python) if os.sep not in python else str(cwd / python)
    if not found or not os.access(found, os.X_OK) or not Path(found).is_file():
        raise ConfigError(f"script.python = {python!r} is not an executable interpreter: give the path of the "
                          "script's Python (its virtual environment's bin/python), or \"\" for the daemon's own")
    return str(Path(found).absolute())
