"""A multi-node run's membership: this daemon's place among the run's machines, through etcd.

Owns joining and leaving (this node's lease, daemon.etcd_keys), the check that every node sees the
same run directory (node 0's marker), which nodes are live, node 0's gathering of its nodes for a
generation (all of them, or after run.node_rejoin_timeout_s the live ones if there are enough), how
long etcd has been silent (`cut_off`), the waits and retried writes that go on only while etcd and
node 0 are there, and how the run ended (node 0 records it; the others follow). The generation
handshake (daemon.generation_handshake) and the decision exchange (daemon.decision_exchange) build
on it; daemon.nodes composes the three into the supervisor's Peers.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Callable

from contracts.config import Config
from contracts.protocol import ExitCode
from daemon import watch
from daemon.etcd_client import Etcd, EtcdError
from daemon.etcd_keys import Coordinator
from daemon.ledger import Ledger
from daemon.peers import PeersUnavailableError
from daemon.run_files import RunFiles

POLL_S = 0.2
MARKER = "coordinator.marker"        # node 0 writes it into the run directory; the others must see it


class Membership:
    """This node among the run's nodes."""

    def __init__(self, cfg: Config, *, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.clock = cfg, clock
        self.coord = Coordinator(cfg, Etcd.from_url(cfg.run.coordinator, timeout_s=2.0), clock=clock)
        self.is_leader = self.coord.is_leader
        self.joined_at: int | None = None       # the generation number stored when this daemon joined
        self.marker = ""                        # node 0's token for this daemon's run (see _check_shared)
        self._waiting_since: float | None = None  # node 0 began to wait for missing nodes

    def start(self, ledger: Ledger, files: RunFiles) -> None:
        try:
            # read before joining: node 0 starts no generation with this node until it has joined, so
            # any generation stored now that names this node was one of a previous daemon's
            stored = self.coord.client.get(self.coord.prefix + "generation")
            self.joined_at = json.loads(stored.value).get("number", 0) if stored else 0
            self.coord.join()
            self._check_shared(files)
        except EtcdError as e:
            raise PeersUnavailableError(f"run.coordinator {self.cfg.run.coordinator}: {e}", ExitCode.TEMP_FAIL) from e
        ledger.emit("node_joined", node=self.coord.node, nodes=self.cfg.run.nodes, leader=self.is_leader,
                    live=self.coord.live_nodes(), stored_generation=self.joined_at, prefix=self.coord.prefix)

    def close(self) -> None:
        self.coord.leave()

    def _check_shared(self, files: RunFiles) -> None:
        """The run directory must be one filesystem for all nodes: node 0 writes a token into it and
        into etcd; the others must find the same token in the file."""
        path = files.run_dir / MARKER
        if self.is_leader:
            self.marker = uuid.uuid4().hex
            files.run_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(self.marker)
            self.coord.client.delete(self.coord.prefix + "run")        # a new daemon: the run goes on
            self.coord.client.put(self.coord.prefix + "marker", self.marker)
            return
        deadline = self.clock() + max(10.0, self.cfg.run.node_rejoin_timeout_s)
        while self.clock() < deadline:
            stored = self.coord.client.get(self.coord.prefix + "marker")
            try:
                if stored is not None and path.read_text() == stored.value.decode():
                    self.marker = stored.value.decode()
                    return
            except OSError:
                pass
            time.sleep(POLL_S)
        raise PeersUnavailableError(
            f"run.dir {files.run_dir} is not shared with node 0: its {MARKER} does not match what node 0 "
            "published (every node must see the same run directory)", ExitCode.CONFIG_ERROR)

    def live(self) -> list[int]:
        return [n for n in self.coord.live_nodes() if 0 <= n < self.cfg.run.nodes]

    def gathered(self) -> tuple[int, ...] | None:
        """Node 0: every node; or, once run.node_rejoin_timeout_s has passed since node 0 began to
        wait with some missing, the live ones if they are at least run.min_nodes (else the run ends)."""
        live, run = self.live(), self.cfg.run
        if len(live) == run.nodes:
            self._waiting_since = None
            return tuple(live)
        now = self.clock()
        self._waiting_since = self._waiting_since if self._waiting_since is not None else now
        if now - self._waiting_since < run.node_rejoin_timeout_s:
            return None
        if len(live) >= run.quorum:
            self._waiting_since = None
            return tuple(live)
        raise PeersUnavailableError(
            f"only {len(live)} of run.nodes = {run.nodes} nodes are up (nodes {live}) after run.node_rejoin_timeout_s "
            f"= {run.node_rejoin_timeout_s:g} s, fewer than run.min_nodes = {run.quorum}", ExitCode.TEMP_FAIL)

    def missing(self) -> dict:
        return {"live": self.coord.live_nodes(), "nodes": self.cfg.run.nodes}

    def wait_for(self, ready, ledger: Ledger, stopping, note: str, fields: Callable[[], dict], *,
                  need_leader: bool = False):
        """Polls `ready()` until it returns something truthy (returned), or a stop (None); says once
        what it waits for, and again every minute. Raises PeersUnavailableError once etcd has been
        unreachable past run.coordinator_timeout_s or (`need_leader`) node 0 gone past
        run.node_rejoin_timeout_s."""
        said, leader_seen = None, self.clock()
        while not stopping() and self.ended_run() is None:
            got = ready()
            if got:
                return got
            now = self.clock()
            self.check_coordinator(now)
            if not need_leader or 0 in self.live() or self.coord.unreachable_s(now) > 0.5 * self.coord.ttl_s:
                leader_seen = now
            elif now - leader_seen > self.cfg.run.node_rejoin_timeout_s:
                raise PeersUnavailableError(
                    f"node 0's daemon has been gone for more than run.node_rejoin_timeout_s = "
                    f"{self.cfg.run.node_rejoin_timeout_s:g} s; node 0 decides for the run", ExitCode.TEMP_FAIL)
            if said is None or now - said > 60:
                ledger.emit(note, level="warning" if said else "info", **fields())
                said = now
            ledger.tick()
            time.sleep(POLL_S)
        return None

    def retrying(self, write: Callable[[], bool | None], ledger: Ledger, stopping) -> bool | None:
        """A write to etcd, retried while etcd is away (decisions wait for it to return), until
        run.coordinator_timeout_s (PeersUnavailableError). The write's answer (False: a lost
        compare-and-swap; a plain put: True); None when a stop came first."""
        said = False
        while not stopping():
            try:
                result = write()
                return True if result is None else bool(result)
            except EtcdError as e:
                if not said:
                    ledger.emit("coordinator_unreachable", level="warning", detail=str(e))
                    said = True
                self.check_coordinator(self.clock())
                time.sleep(1.0)
        return None

    def check_coordinator(self, now: float) -> None:
        if self.cut_off(now):
            raise PeersUnavailableError(
                f"etcd at {self.cfg.run.coordinator} has been unreachable for more than "
                f"run.coordinator_timeout_s = {self.cfg.run.coordinator_timeout_s:g} s", ExitCode.TEMP_FAIL)

    def cut_off(self, now: float) -> bool:
        """etcd silent past run.coordinator_timeout_s: the run checkpoints and stops (exit 75)."""
        return self.coord.unreachable_s(now) > self.cfg.run.coordinator_timeout_s

    def finish(self, code: int, status: str) -> None:
        """Node 0's daemon ends: the others, waiting for a generation, end the same way."""
        if self.is_leader:
            try:
                self.coord.finish_run({"code": int(code), "status": status, "marker": self.marker})
            except EtcdError:
                pass

    def ended_run(self) -> watch.Outcome | None:
        """How node 0 ended the run this daemon belongs to, as this node's outcome; None: it goes on."""
        end = None if self.is_leader else self.coord.run_end()
        if not end or end.get("marker") != self.marker:
            return None
        if end.get("status") in ("finished", "stopped") and end.get("code") == 0:
            return watch.Finished(None) if end["status"] == "finished" else watch.Stopped(None)
        return watch.WorkerFailed(int(end.get("code", 1)), None, f"node 0's daemon ended the run: {end.get('status')}")
