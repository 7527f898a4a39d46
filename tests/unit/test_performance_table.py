"""The Performance page's tables (docs/performance.md) are the bench results: rendered from bench/results/*.json,
never typed."""
import importlib.util
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _table():
    spec = importlib.util.spec_from_file_location("performance_table", ROOT / "bench" / "performance_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_performance_page_shows_what_the_committed_results_say():
    table = _table()
    page = (ROOT / "docs" / "performance.md").read_text()
    assert table.PAGE == ROOT / "docs" / "performance.md"
    assert table.current_block(page) == table.render(ROOT / "bench" / "results"), (
        "docs/performance.md's tables differ from bench/results: run `python bench/performance_table.py --write`")


def test_a_rerun_bench_changes_the_figures_shown(tmp_path):
    table = _table()
    shutil.copytree(ROOT / "bench" / "results", tmp_path / "results")
    path = tmp_path / "results" / "vs_pytorch.json"
    doc = json.loads(path.read_text())
    summary = doc["results"]["tiny"]["summary"]
    summary["project"]["tokens_per_s"] = 2 * summary["torch"]["tokens_per_s"]
    summary["project"]["tokens_per_s_range"] = [1234567.0, 7654321.0]
    path.write_text(json.dumps(doc))
    recovery = tmp_path / "results" / "recovery.json"
    rec = json.loads(recovery.read_text())
    rec["crash"]["standby"]["recovery_s"] = 42.125
    recovery.write_text(json.dumps(rec))

    block = table.render(tmp_path / "results")

    tiny = next(line for line in block.splitlines() if line.startswith("| tiny |") and "**" in line)
    assert "**2.00×**" in tiny and "(1,234,567–7,654,321)" in tiny
    assert "**42.12 s**" in block or "**42.13 s**" in block
    assert block != table.render(ROOT / "bench" / "results")


def test_writing_the_block_keeps_the_rest_of_the_page(tmp_path):
    table = _table()
    text = f"# title\n\nbefore\n{table.START}\nold rows\n{table.END}\nafter\n"
    out = table.replace_block(text, "new rows")
    assert out == f"# title\n\nbefore\n{table.START}\nnew rows\n{table.END}\nafter\n"
    assert table.current_block(out) == "new rows"
