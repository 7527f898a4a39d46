"""Metrics for dashboards in Prometheus' text exposition format: on a loopback HTTP port
(`run.metrics_port`), and/or as a node-exporter textfile (`run.metrics_textfile`).

Owns: the values the supervisor updates (step, loss, tokens/s and in all,
generation, restarts, incidents by kind — every kind from the start, at 0 —,
when the last checkpoint was committed, the run's state, whether the daemon
is up and how it exited, the goodput ledger's ratio and seconds by cause — every
cause from the start, at 0 —), their rendering, the HTTP endpoint (a daemon
thread; GET /metrics) and the textfile's atomic rewrite. The exposition format
is written here rather than with prometheus_client: a dozen series need little
stdlib code, the textfile goes through the project's one atomic writer,
and the daemon takes no dependency for it.
"""
from __future__ import annotations

import http.server
import threading
import time
from collections import Counter
from pathlib import Path

from checkpointing import layout
from daemon.judging.goodput import CAUSES
from daemon.judging.incidents import Kind
from daemon.judging.triage import VERDICTS
from durable import write_atomically

PREFIX = "llm_pretrain"
TEXTFILE_EVERY_S = 5.0     # node-exporter reads it on its own schedule: never staler than this
STATES = ("new", "running", "pausing", "paused", "restarting", "finished", "stopped", "gave_up", "failed")


class MetricsPortError(RuntimeError):
    """The metrics port cannot be listened on."""


class Metrics:
    def __init__(self, run: str):
        self.run = run
        self.step = 0
        self.loss = float("nan")
        self.tokens_per_s = 0.0
        self.generation = 0
        self.restarts = 0
        self.incidents: Counter[str] = Counter()
        self.triage: Counter[str] = Counter()     # reruns' verdicts (daemon.judging.triage)
        self.last_checkpoint_unix_s: float | None = None
        self.checkpoints_failing_since_step = 0
        self.tokens_total = 0
        self.validation_loss = float("nan")      # NaN until the first validation
        self.validation_step = 0
        self.status = "new"
        self.up = 1                       # 0 once the daemon has exited (the textfile outlives it)
        self.exit_code: int | None = None
        self.info: dict[str, str] = {}    # version, config_hash
        self.goodput: dict = {}           # daemon.judging.goodput.Goodput.to_dict(), as the ledger last said it
        self._lock = threading.Lock()
        self._server: http.server.ThreadingHTTPServer | None = None
        self._textfile: Path | None = None
        self._written_at = 0.0
        self._flushing = threading.Lock()          # the timer's writes and the daemon's, one at a time
        self._stop_timer = threading.Event()
        self.textfile_error: str | None = None     # why the last textfile write failed (a full disk)

    def update(self, **values) -> None:
        with self._lock:
            for key, value in values.items():
                setattr(self, key, value)

    def count_incident(self, kind: str) -> None:
        with self._lock:
            self.incidents[kind] += 1

    def count_triage(self, verdict: str) -> None:
        with self._lock:
            self.triage[verdict] += 1

    def render(self, now: float | None = None) -> str:
        label = f'run="{self.run}"'
        with self._lock:
            last = self.last_checkpoint_unix_s if self.last_checkpoint_unix_s is not None else float("nan")
            rows = [
                ("up", "gauge", "1 while the daemon runs; 0 once it has exited", self.up),
                ("step", "gauge", "optimizer steps completed", self.step),
                ("loss", "gauge", "training loss of the latest step", self.loss),
                ("validation_loss", "gauge", "mean next-token loss on the held-out sequences (NaN: none yet)",
                 self.validation_loss),
                ("validation_step", "gauge", "the step the validation loss was measured after", self.validation_step),
                ("tokens_per_second", "gauge", "training throughput, all ranks", self.tokens_per_s),
                ("tokens_total", "counter", "tokens trained on by this daemon's generations, all ranks",
                 self.tokens_total),
                ("generation", "gauge", "generations started (restarts + 1)", self.generation),
                ("restarts_total", "counter", "restarts after incidents", self.restarts),
                ("last_checkpoint_timestamp_seconds", "gauge", "Unix time of the last committed checkpoint", last),
                ("checkpoints_failing_since_step", "gauge",
                 "the step of the first failed save since the last commit (0: saves succeed)",
                 self.checkpoints_failing_since_step),
            ]
            goodput = dict(self.goodput)
            ratio = goodput.get("ratio")
            rows += [("goodput_ratio", "gauge", "productive seconds over the run's wall seconds (NaN: none yet)",
                      float("nan") if ratio is None else ratio),
                     ("productive_seconds", "counter", "wall seconds of steps trained for the first time, less their "
                      "data waits", goodput.get("productive_s", 0.0))]
            if self.exit_code is not None:
                rows.append(("exit_code", "gauge", "the daemon's exit status (see the README's table)", self.exit_code))
            incidents, status, info = dict(self.incidents), self.status, dict(self.info)
            triage = dict(self.triage)
        out = []
        for name, kind, help_text, value in rows:
            out += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} {kind}",
                    f"{PREFIX}_{name}{{{label}}} {_number(value)}"]
        out += [f"# HELP {PREFIX}_state the run's state: 1 for the current one", f"# TYPE {PREFIX}_state gauge"]
        out += [f'{PREFIX}_state{{{label},state="{s}"}} {int(s == status)}' for s in STATES]
        extra = "".join(f',{k}="{v}"' for k, v in sorted(info.items()))
        out += [f"# HELP {PREFIX}_info the build and the config's trajectory hash", f"# TYPE {PREFIX}_info gauge",
                f"{PREFIX}_info{{{label}{extra}}} 1"]
        out += [f"# HELP {PREFIX}_incidents_total incidents by kind (warnings included)",
                f"# TYPE {PREFIX}_incidents_total counter"]
        out += [f'{PREFIX}_incidents_total{{{label},kind="{k.value}"}} {incidents.get(k.value, 0)}' for k in Kind]
        out += [f"# HELP {PREFIX}_reruns_total numerical incidents re-run before acting, by verdict "
                "(transient: training went on from the rerun; deterministic: the policy acted)",
                f"# TYPE {PREFIX}_reruns_total counter"]
        out += [f'{PREFIX}_reruns_total{{{label},verdict="{v}"}} {triage.get(v, 0)}' for v in VERDICTS]
        badput = goodput.get("badput_s") or {}
        out += [f"# HELP {PREFIX}_badput_seconds_total the run's wall seconds lost, by cause (docs/operating.md)",
                f"# TYPE {PREFIX}_badput_seconds_total counter"]
        out += [f'{PREFIX}_badput_seconds_total{{{label},cause="{c}"}} {_number(badput.get(c, 0.0))}' for c in CAUSES]
        return "\n".join(out) + "\n"

    # outputs -----------------------------------------------------------------
    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Starts the endpoint; returns the port (useful with port 0 in tests)."""
        metrics = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404)
                    return
                body = metrics.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True, name="metrics").start()
        return self._server.server_address[1]

    def textfile(self, path: Path, every_s: float = TEXTFILE_EVERY_S) -> None:
        """Keeps `path` written: on a timer (every `every_s`, whatever the daemon is doing: paused,
        waiting for a decision, restarting), and at once where the daemon flushes with force."""
        self._textfile = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._stop_timer.clear()
        threading.Thread(target=self._rewrite_every, args=(every_s,), daemon=True, name="metrics-textfile").start()

    def _rewrite_every(self, every_s: float) -> None:
        while not self._stop_timer.wait(every_s):
            self.flush(every_s, timer=True)

    def flush(self, every_s: float = 5.0, force: bool = False, timer: bool = False) -> None:
        """Rewrites the textfile (atomically) at most every `every_s`. A disk that refuses it (full,
        read-only) costs the textfile's freshness, never the daemon: the next flush tries again."""
        if self._textfile is None:
            return
        with self._flushing:
            if timer and self._stop_timer.is_set():         # closed: the last write was close()'s
                return
            now = time.monotonic()
            if not force and now - self._written_at < every_s:
                return
            self._written_at = now
            try:
                write_atomically(self._textfile, self.render())
                self.textfile_error = None
            except OSError as e:
                self.textfile_error = f"{self._textfile}: {e.strerror or e}"

    def start(self, cfg, state, ckpt_root: Path) -> str | None:
        """Seeds the values from the run so far (`state`: daemon.records.state.RunState; `cfg`: the config),
        opens the textfile and the endpoint; returns the endpoint's URL, if any.
        Raises MetricsPortError when the port cannot be listened on."""
        from importlib import metadata

        from contracts.config import config_hash

        run = cfg.run
        try:
            version = metadata.version("llm-pretrain")
        except metadata.PackageNotFoundError:
            version = "unknown"
        self.update(info={"version": version, "config_hash": config_hash(cfg)}, status=state.status)
        steps = layout.committed_steps(ckpt_root)
        if steps:
            self.update(last_checkpoint_unix_s=layout.step_dir(ckpt_root, steps[-1]).stat().st_mtime, step=steps[-1])
        self.update(restarts=state.restarts, generation=state.generation,
                    checkpoints_failing_since_step=state.checkpoints_failing_since or 0)
        for record in state.incidents:
            self.count_incident(record.kind.value)
        self.update(triage=Counter(state.triage), goodput=dict(state.goodput))
        if run.metrics_textfile:
            self.textfile(Path(run.metrics_textfile))
            self.flush(force=True)
        if not run.metrics_port:
            return None
        try:
            return f"http://127.0.0.1:{self.serve(run.metrics_port)}/metrics"
        except OSError as e:
            raise MetricsPortError(f"run.metrics_port = {run.metrics_port}: cannot listen on 127.0.0.1: "
                                   f"{e.strerror or e}") from e

    def close(self) -> None:
        self._stop_timer.set()
        self.flush(force=True)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _number(value) -> str:
    value = float(value)
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value) if not value.is_integer() else str(int(value))
