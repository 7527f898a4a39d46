"""A machine's RAM tier served to its peers (issue 50, item 2); what is taken from them is daemon.machines.ram_parts'.

A machine that joins or rejoins a multi-node run with no usable RAM state (rebooted: its tmpfs empty;
replaced; or stale, back after the run went on) would make every machine resume from the disk, since the run
resumes from a step all of them hold (daemon.machines.memory_agreement). With data parallelism every live
peer holds the same state: the machine copies the newest step its peers all hold from one of them, over
plain HTTP from that peer's daemon, into its own RAM tier, verified by the manifest's checksums before it is
committed (renamed into place, as a save is), then says it holds it.

The server answers GET /<step-dir>/<file> for committed steps only (and GET /steps: their numbers), to a request that names the run's id
(X-Llm-Pretrain-Run: the run directory's `.run-id`, which every machine of the run reads from the shared
run directory), from a thread of the daemon; it never writes. Never imports MindSpore.
"""
from __future__ import annotations

import http.server
import json
import re
import shutil
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from checkpointing import layout

RUN_HEADER = "X-Llm-Pretrain-Run"
CHUNK = 1 << 20
_PATH = re.compile(r"^/(step-\d{8,})/([A-Za-z0-9._-]+)$")
STEPS = "/steps"                     # the committed steps, a JSON list (what a buddy copies: the newest)


class RamServer:
    """This machine's RAM tier, read-only, to its peers."""

    def __init__(self, root: Callable[[], Path | None], run_id: str, host: str):
        """Listens on every address of the machine, on a port of the kernel's choosing; `url` names it at `host`
        (this machine's address its peers reach: the run's records in etcd carry it)."""
        self._root, self._run_id = root, run_id
        handler = _handler(self)
        six = ":" in host
        server = type("Server", (http.server.ThreadingHTTPServer,), {"address_family": socket.AF_INET6}) if six \
            else http.server.ThreadingHTTPServer
        self.httpd = server(("::" if six else "0.0.0.0", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{f'[{host}]' if six else host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="ram-peers", daemon=True)

    def start(self) -> "RamServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def file(self, step_dir: str, name: str) -> Path | None:
        """A committed step's file, or None (not committed, not one of its files, no RAM tier)."""
        root = self._root()
        if root is None or layout.parse_step(step_dir) is None:
            return None
        path = root / step_dir / name
        return path if path.is_file() else None


def _handler(server: RamServer):
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):                                            # noqa: N802 (http.server's name)
            if self.headers.get(RUN_HEADER) != server._run_id:
                return self.send_error(403, "not of this run")
            if self.path == STEPS:
                return self._steps()
            m = _PATH.match(self.path)
            path = server.file(*m.groups()) if m else None
            if path is None:
                return self.send_error(404)
            try:
                with open(path, "rb") as f:
                    size = f.seek(0, 2)
                    f.seek(0)
                    self.send_response(200)
                    self.send_header("Content-Length", str(size))
                    self.end_headers()
                    shutil.copyfileobj(f, self.wfile, CHUNK)
            except FileNotFoundError:            # retired while it was asked for
                self.send_error(404)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _steps(self):
            root = server._root()
            body = json.dumps(layout.committed_steps(root) if root is not None else []).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args):           # the daemon's events say what matters
            pass

    return Handler


class FetchError(RuntimeError):
    """A step could not be taken from a peer (said in one event; the run resumes from the disk)."""


def get(url: str, run_id: str, path: str, out, left_s: float, tick: Callable[[], None] = lambda: None):
    """The body of GET `path` (into `out`, returning its length, or as bytes when `out` is None)."""
    if left_s <= 0:
        raise FetchError(f"out of time taking {path} from {url}")
    request = urllib.request.Request(url + path, headers={RUN_HEADER: run_id})
    with urllib.request.urlopen(request, timeout=min(left_s, 30.0)) as response:
        expected = int(response.headers.get("Content-Length", -1))
        if out is None:
            body = response.read()
            if expected >= 0 and len(body) != expected:
                raise FetchError(f"{path} from {url}: {len(body)} of {expected} bytes")
            return body
        copied = 0
        while chunk := response.read(CHUNK):
            out.write(chunk)
            copied += len(chunk)
            tick()
        if expected >= 0 and copied != expected:
            raise FetchError(f"{path} from {url}: {copied} of {expected} bytes")
        return copied
