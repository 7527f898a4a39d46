"""The node-exporter textfile follows the daemon's values on a timer: a paused run (no steps, no
events) is not left saying `running` at an old step."""
import time

from daemon.records.metrics import Metrics


def _eventually(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _text(path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def test_the_textfile_is_rewritten_on_a_timer_without_any_flush(tmp_path):
    metrics, path = Metrics("r"), tmp_path / "llm_pretrain.prom"
    metrics.textfile(path, every_s=0.05)
    try:
        metrics.update(status="paused", step=736)             # as a pause leaves them: no step follows
        assert _eventually(lambda: 'llm_pretrain_state{run="r",state="paused"} 1' in _text(path)
                           and 'llm_pretrain_step{run="r"} 736' in _text(path)), _text(path)
    finally:
        metrics.close()
    assert 'llm_pretrain_state{run="r",state="running"} 0' in path.read_text()


def test_closing_stops_the_timer(tmp_path):
    metrics, path = Metrics("r"), tmp_path / "llm_pretrain.prom"
    metrics.textfile(path, every_s=0.05)
    metrics.close()
    written = path.read_text()
    metrics.update(step=99)
    time.sleep(0.3)                                           # six periods: a live timer would have written
    assert path.read_text() == written
