"""A real etcd for tests: started on free loopback ports (or given addresses, in a namespace),
its data in a temporary directory, stopped (or paused with SIGSTOP, or killed) by the test.

Without an `etcd` binary the tests that need one are skipped, saying how to get it, except under
CI (`CI` set), where that is a failure: `.ci/run` installs Debian's etcd-server.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Sequence

import pytest


def etcd_binary() -> str:
    from daemon.machines.embedded_etcd import INSTALL_ETCD, find_etcd

    path = find_etcd()
    if path is None:
        message = f"no etcd binary: {INSTALL_ETCD}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _stopped(pid: int) -> bool:
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):      # the thread exited while we looked (gone, or ESRCH on read)
            continue
    return bool(states) and all(s in ("T", "t") for s in states)


class EtcdServer:
    def __init__(self, data_dir: Path, *, host: str = "127.0.0.1", client_port: int = 0, peer_port: int = 0,
                 prefix: Sequence[str] = ()):
        self.host, self.data_dir, self.prefix = host, data_dir, list(prefix)
        self.client_port = client_port or _free_port(host)
        self.peer_port = peer_port or _free_port(host)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"etcd://{self.host}:{self.client_port}"

    def start(self, timeout_s: float = 20.0) -> "EtcdServer":
        client, peer = f"http://{self.host}:{self.client_port}", f"http://{self.host}:{self.peer_port}"
        cmd = [*self.prefix, etcd_binary(), "--name", "test", "--data-dir", str(self.data_dir),
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"test={peer}", "--log-level", "error"]
        self.log = open(self.data_dir.parent / f"{self.data_dir.name}.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        from daemon.machines.etcd_client import Etcd, EtcdError

        client = Etcd.from_url(self.url, timeout_s=1.0)
        while True:
            try:
                client.get("/ready")
                return self
            except EtcdError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"etcd did not start: see {self.log.name}")
                time.sleep(0.1)

    def pause(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP, returning once every thread of etcd is stopped (a loaded machine may take a moment to
        stop a thread that was running: until then it could still answer)."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not _stopped(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None:
            self.log.close()
