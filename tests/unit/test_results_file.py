"""Every bench writes its results through bench/results_file.py, which names the host each figure is from
(performance_table.py reads them)."""
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_no_bench_writes_its_results_by_itself():
    writers = [p.name for p in sorted((ROOT / "bench").glob("*.py"))
               if p.name not in ("results_file.py", "performance_table.py") and ("bench\" / \"results\"" in p.read_text() or "json.dumps(payload" in p.read_text())]
    assert writers == []
    users = [p.name for p in sorted((ROOT / "bench").glob("*.py")) if "results_file.write(" in p.read_text()]
    assert len(users) >= 13, users


def test_a_result_names_its_host_and_keeps_a_merged_files_date(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import results_file
    finally:
        sys.path.remove(str(ROOT / "bench"))
    monkeypatch.setattr(results_file, "RESULTS", tmp_path)
    results_file.write("x", {"ratio": 1.5})
    data = results_file.read("x")
    assert data["benchmark"] == "x" and data["ratio"] == 1.5 and data["created"].endswith("Z")
    assert data["machine"]["cpus"] >= 1 and "python" in data["machine"] and "isa" in data["machine"]
    results_file.write("x", {**data, "created": "2026-01-01T00:00:00Z"})
    assert results_file.read("x")["created"] == "2026-01-01T00:00:00Z"
