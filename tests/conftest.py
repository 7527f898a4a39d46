"""Marks every test by its tier (its directory), so `pytest -m unit` runs the fast set in seconds."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = Path(item.fspath).relative_to(ROOT / "tests").parts[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: tests live in tests/unit, tests/integration or tests/e2e")
        item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def cli() -> list[str]:
    """The `llm-pretrain` command of the environment running the tests."""
    exe = Path(sys.executable).parent / "llm-pretrain"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "daemon.cli"]


@pytest.fixture(scope="session")
def quiet_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GLOG_v", "3")   # MindSpore's C++ log level: errors only
    return env
