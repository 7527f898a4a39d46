"""Prometheus metrics from the real supervisor: scraped over HTTP on loopback while it runs, and
the textfile after it ends."""
import re
import socket
import time
import urllib.request

from tests.integration.test_supervisor import _finish, _start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _value(text: str, name: str, labels: str = 'run="run"') -> float:
    m = re.search(rf"^llm_pretrain_{name}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    assert m, f"{name}{{{labels}}} missing from:\n{text}"
    return float(m.group(1))


def test_metrics_are_served_while_running_and_left_in_the_textfile(tmp_path):
    port, textfile = _free_port(), tmp_path / "textfile" / "llm_pretrain.prom"
    started = time.time()
    proc = _start(tmp_path / "run", overrides=[f"run.metrics_port={port}", f'run.metrics_textfile="{textfile}"'],
                  fake=["--steps", "120", "--step-s", "0.03", "--interval", "10", "--crash-at", "20",
                        "--fault-generations", "1"])
    scraped = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                text = r.read().decode()
                content_type = r.headers["Content-Type"]
            if _value(text, "generation") == 2 and _value(text, "step") > 30:
                scraped, scraped_at = text, time.time()
                break
        except (OSError, AssertionError):
            pass
        time.sleep(0.1)
    code, _, err = _finish(proc)
    assert code == 0, err
    assert scraped is not None, "never scraped generation 2 past step 30"
    assert content_type.startswith("text/plain; version=0.0.4")
    assert _value(scraped, "restarts_total") == 1
    assert _value(scraped, "incidents_total", 'run="run",kind="crash"') == 1
    assert _value(scraped, "loss") > 0 and _value(scraped, "tokens_per_second") > 0
    assert started <= _value(scraped, "last_checkpoint_timestamp_seconds") <= scraped_at    # a commit of this run
    assert _value(scraped, "tokens_total") > 0 and _value(scraped, "up") == 1
    assert _value(scraped, "state", 'run="run",state="running"') == 1
    assert _value(scraped, "state", 'run="run",state="paused"') == 0
    assert _value(scraped, "incidents_total", 'run="run",kind="loss_spike"') == 0      # every kind, from the start
    assert re.search(r'^llm_pretrain_info\{run="run",config_hash="[0-9a-f]{16}",version="[^"]+"\} 1$', scraped, re.M)
    final = textfile.read_text()
    assert _value(final, "step") == 120 and "# TYPE llm_pretrain_restarts_total counter" in final
    assert _value(final, "up") == 0 and _value(final, "exit_code") == 0                  # the daemon's exit, marked
    assert _value(final, "state", 'run="run",state="finished"') == 1


def test_a_busy_metrics_port_is_a_config_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, events, _ = _finish(_start(tmp_path / "run", overrides=[f"run.metrics_port={port}"],
                                         fake=["--steps", "3"]))
    assert code == 78
    assert "run.metrics_port" in [e for e in events if e["event"] == "daemon_exit"][0]["detail"]
