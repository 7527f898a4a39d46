"""Marks every test by its tier (its directory), so `pytest -m unit` runs the fast set in seconds."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIERS = ("unit", "integration", "e2e")



def _mindspore_importable() -> bool:
    """Asked without importing it (the fast tiers never load MindSpore)."""
    import importlib.util

    try:
        return importlib.util.find_spec("mindspore") is not None
    except ImportError:
        return False


# where MindSpore cannot be imported, `pytest -m "unit or integration"` must still collect: the e2e tier
# imports it at module level, so it is left out
collect_ignore_glob = [] if _mindspore_importable() else ["e2e/*"]


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
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "cli"]


@pytest.fixture(scope="session")
def quiet_env(tmp_path_factory) -> dict[str, str]:
    """The environment for processes under test: quiet MindSpore, and a cache of this session's own
    (the embedded corpus is prepared there once, never in the user's ~/.cache)."""
    env = dict(os.environ)
    env.setdefault("GLOG_v", "3")   # MindSpore's C++ log level: errors only
    env["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    env.pop("CACHE_DIRECTORY", None)
    return env


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line: how many tests were skipped and why (for `make test`, tests.skips sums both sessions)."""
    from collections import Counter

    from tests import skips

    counts = Counter(skips.reason(r) for r in terminalreporter.stats.get("skipped", []))
    terminalreporter.write_line(skips.line(counts))
    if os.environ.get("LLM_PRETRAIN_SKIP_LOG"):
        skips.record(os.environ["LLM_PRETRAIN_SKIP_LOG"], counts)
