"""bench/goodput.py's arithmetic: what the restarts alone cost, by the ledgers of the pair of runs."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def goodput(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("goodput_bench", ROOT / "bench" / "goodput.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("goodput_bench", None)


def _run(wall, productive, badput):
    return {"final_step": 1000, "period_s": 0.01, "wall_s": wall, "faults": [], "bitflips": [],
            "ledger": {"ratio": productive / wall, "productive_s": productive, "wall_s": wall, "badput_s": badput}}


def test_the_restart_share_counts_only_what_the_kills_added_to_restarting(goodput):
    faulty = _run(200.0, 150.0, {"teardown": 2.0, "start": 3.0, "retrained": 1.0, "checkpoint": 30.0})
    clean = _run(200.0, 160.0, {"start": 1.0, "checkpoint": 25.0})
    assert goodput.restart_share(faulty, clean) == pytest.approx(1 - (6.0 - 1.0) / 200.0)   # checkpoint not counted
    assert goodput.restart_share(_run(200.0, 150.0, {}), {"ledger": {}}) is None     # a ledger missing: no figure
