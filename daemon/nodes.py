"""A node of a multi-node run: the other nodes' daemons through etcd (the supervisor's `peers`).

Owns what the supervisor's loop does differently when a run spans machines, behind the calls of
daemon.peers: open a generation (node 0 gathers its nodes — all, or after the rejoin timeout the
live ones if enough — prepares the shared files for their shape and publishes it; the others wait
for a generation with them in it), hear during a generation that it ends elsewhere (a peer's
incident, a node lost, a lost node back), say why it ended here (the first node to say it sets the
cause for all), and, between generations, the recovery decision: node 0 decides and publishes it,
the others apply exactly that and say so loudly if their own policy disagrees. Operator requests
made on any node reach node 0, the only writer of the ranks' commands file. The etcd keys
themselves are daemon.coordinator's.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Callable

from contracts.config import Config, with_changes
from contracts.elastic import shape_on
from contracts.protocol import ExitCode
from daemon import recovery, watch
from daemon.control import Request
from daemon.coordinator import Coordinator
from daemon.etcd import Etcd, EtcdError
from daemon.incidents import Incident, Kind
from daemon.ledger import Ledger
from daemon.peers import Opened, PeersUnavailableError
from daemon.run_files import RunFiles

POLL_S = 0.2
MARKER = "coordinator.marker"        # node 0 writes it into the run directory; the others must see it


class Nodes:
    """A node of a multi-node run."""

    def __init__(self, cfg: Config, *, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.clock = cfg, clock
        self.coord = Coordinator(cfg, Etcd.from_url(cfg.run.coordinator, timeout_s=2.0), clock=clock)
        self.is_leader = self.coord.is_leader
        self.members: tuple[int, ...] = ()
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

    # Opening a generation -----------------------------------------------------------------------
    def open(self, ledger: Ledger, files: RunFiles, base: Config, stopping: Callable[[], bool]) -> Opened | None:
        """Node 0: its nodes gathered, then the shared files and the generation published. The others:
        the next generation node 0 publishes with them in it. None: a stop came first. Raises
        PeersUnavailableError when the run cannot go on (too few nodes, etcd or node 0 gone too long)."""
        return self._lead(ledger, files, base, stopping) if self.is_leader else self._follow(ledger, base, stopping)

    def _lead(self, ledger: Ledger, files: RunFiles, base: Config, stopping) -> Opened | None:
        members = self._wait_for(self._gathered, ledger, stopping, "waiting_for_nodes", self._missing)
        if members is None:
            return None
        cfg = self._shaped(base, ledger.state.config_changes, members)
        resume = files.prepare_generation(cfg, ledger.state.recovery)
        stored = self.coord.generation()
        number = max(ledger.state.generation, stored["number"] if stored else 0) + 1
        written = self._retrying(lambda: self.coord.publish_generation(
            number, members=list(members), port=cfg.run.master_port, resume_step=resume,
            config_changes=ledger.state.config_changes), ledger, stopping)
        if written is None:
            return None
        if not written:          # only node 0 writes it: another daemon believes it is node 0
            raise PeersUnavailableError(
                f"generation {number} was published by another daemon under {self.coord.prefix}: is a second "
                "machine configured with run.node_rank = 0, or another run using the same run.coordinator_prefix?",
                ExitCode.CONFIG_ERROR)
        before = self.members
        self._set_generation(ledger, number, members)
        if len(members) < self.cfg.run.nodes:          # said as the new generation's
            ledger.emit("nodes_shrunk", level="warning", members=list(members),
                        lost=sorted(set(range(self.cfg.run.nodes)) - set(members)), dp=cfg.parallel.dp,
                        micro_batch=cfg.train.micro_batch, grad_accum_steps=cfg.train.grad_accum_steps,
                        detail=f"going on with {len(members)} of {self.cfg.run.nodes} nodes, the same global batch")
        elif before and len(before) < self.cfg.run.nodes:
            ledger.emit("nodes_rejoined", members=list(members), dp=cfg.parallel.dp)
        return Opened(number, cfg.run.master_port, resume, cfg, self._ranks(members), members)

    def _follow(self, ledger: Ledger, base: Config, stopping) -> Opened | None:
        def published():
            g = self.coord.generation()
            after = max(ledger.state.generation, self.joined_at or 0)
            return g if g and g["number"] > after and self.coord.node in g.get("members", ()) else None

        g = self._wait_for(published, ledger, stopping, "waiting_for_generation",
                           lambda: {"after": max(ledger.state.generation, self.joined_at or 0)}, need_leader=True)
        if g is None:
            return None
        ledger.state.set_config_changes(g.get("config_changes") or {})
        members = tuple(g["members"])
        self._set_generation(ledger, g["number"], members)
        return Opened(g["number"], int(g["port"]), int(g["resume_step"]),
                      self._shaped(base, ledger.state.config_changes, members), self._ranks(members), members)

    def _live(self) -> list[int]:
        return [n for n in self.coord.live_nodes() if 0 <= n < self.cfg.run.nodes]

    def _gathered(self) -> tuple[int, ...] | None:
        """Node 0: every node; or, once run.node_rejoin_timeout_s has passed since node 0 began to
        wait with some missing, the live ones if they are at least run.min_nodes (else the run ends)."""
        live, run = self._live(), self.cfg.run
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

    def _shaped(self, base: Config, changes: dict, members: tuple[int, ...]) -> Config:
        """The config of a generation of `members`: the policy's changes, and the data-parallel size of
        these nodes with the same global batch (contracts.elastic); the same on every node."""
        merged = dict(changes)
        micro = merged.get("train.micro_batch", base.train.micro_batch)
        per_node = base.parallel.world_size // base.run.nodes
        shape = shape_on(len(members), ranks_per_node=per_node, model_parallel=base.parallel.tp * base.parallel.pp,
                         global_batch=base.train.global_batch, micro_batch=micro)
        if shape is None:       # refused when the config was read (contracts.config._check_elastic)
            raise PeersUnavailableError(f"no shape keeps train.global_batch on {len(members)} nodes", ExitCode.CONFIG_ERROR)
        slot = members.index(self.coord.node) if self.coord.node in members else 0
        merged.update({"parallel.dp": shape.dp, "train.micro_batch": shape.micro_batch,
                       "train.grad_accum_steps": shape.grad_accum_steps, "run.nodes": len(members),
                       "run.node_rank": slot, "run.min_nodes": 0})
        return with_changes(base, merged)

    def _ranks(self, members: tuple[int, ...]) -> tuple[int, ...]:
        per_node = self.cfg.parallel.world_size // self.cfg.run.nodes
        slot = members.index(self.coord.node)
        return tuple(range(slot * per_node, (slot + 1) * per_node))

    def _set_generation(self, ledger: Ledger, number: int, members: tuple[int, ...]) -> None:
        ledger.next_generation(number)
        self.members = members

    def _missing(self) -> dict:
        return {"live": self.coord.live_nodes(), "nodes": self.cfg.run.nodes}

    def _wait_for(self, ready, ledger: Ledger, stopping, note: str, fields: Callable[[], dict], *,
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
            self._check_coordinator(now)
            if not need_leader or 0 in self._live() or self.coord.unreachable_s(now) > 0.5 * self.coord.ttl_s:
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

    def _retrying(self, write: Callable[[], bool | None], ledger: Ledger, stopping) -> bool | None:
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
                self._check_coordinator(self.clock())
                time.sleep(1.0)
        return None

    def _check_coordinator(self, now: float) -> None:
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

    # During a generation ------------------------------------------------------------------------
    def hear(self, number: int, now: float) -> watch.Outcome | None:
        """The generation ends elsewhere: a peer said why, or a member node's daemon is gone; or, on
        node 0 of a smaller generation, a lost node is back (regroup: the ranks save and the next
        generation takes it back)."""
        cause = self.coord.ended(number)
        if cause is not None:
            return _outcome(cause)
        live = self._live()
        if self.is_leader and (back := sorted(set(live) - set(self.members))):
            return watch.Regroup(None, tuple(back))
        lost = sorted(set(self.members) - set(live))
        if lost and self.coord.unreachable_s(now) < self.coord.ttl_s:     # etcd's silence is not a node's loss
            return watch.Failed(Incident(kind=Kind.NODE_LOST, first_step=0, last_step=0, rank=None,
                                         detail=f"node {lost[0]}'s daemon is gone (its etcd lease expired)",
                                         evidence={"nodes": lost}))
        return None

    def requests(self) -> list[Request]:
        """Node 0: operator requests dropped on any node."""
        if not self.is_leader:
            return []
        return [Request(r["name"], dict(r.get("body") or {}), f"node {r.get('node')}: {r.get('file', '')}".rstrip(": "))
                for r in self.coord.new_requests() if r.get("name")]

    def forward(self, request: Request) -> bool:
        """A request on a node that does not write the ranks' commands: sent to node 0 (True)."""
        if self.is_leader:
            return False
        try:
            self.coord.send_request(request.name, {**request.body, "file": request.file})
        except EtcdError:
            return False
        return True

    def send(self, name: str, args: dict, ledger: Ledger, append: Callable[[str, dict], int]) -> None:
        """A command for the ranks: node 0 writes it for all; another node asks node 0 for a stop (its
        own signal) and leaves the rest to node 0, which saw the same requests."""
        if self.is_leader:
            ledger.command_sent(name, args, append)
        elif name == "stop" and self.forward(Request("stop", {"reason": f"node {self.coord.node} stopping"}, "signal")):
            ledger.emit("stop_forwarded", node=self.coord.node, detail="asked node 0 to stop the run")

    def conclude(self, number: int, outcome: watch.Outcome, *, requested: bool = False) -> watch.Outcome:
        """Says why the generation ended here; the cause every node goes by (the first one said).
        Ranks that stopped with no stop asked for here (`requested`) ended for a reason elsewhere:
        a stop node 0 asked for, or a node whose daemon died (its ranks, told by their parent-death
        signal, saved and stopped every rank): that cause is awaited, not declared."""
        if isinstance(outcome, watch.Stopped) and not requested:
            outcome = self._unasked_stop(number)
        try:
            return _outcome(self.coord.end_generation(number, _cause(outcome)))
        except EtcdError:
            return outcome

    def _unasked_stop(self, number: int) -> watch.Outcome:
        deadline = self.clock() + self.coord.ttl_s + 2.0
        while self.clock() < deadline:
            if (elsewhere := self.hear(number, self.clock())) is not None and not isinstance(elsewhere, watch.Regroup):
                return elsewhere
            time.sleep(POLL_S)
        return watch.Failed(Incident(kind=Kind.CRASH, first_step=0, last_step=0, detail=(
            "the ranks saved and stopped with no stop asked for (a SIGTERM from outside the daemon?)")))

    def unfinished(self, ledger: Ledger) -> Incident | None:
        """At the start: the generation this node was in when its daemon died may still run elsewhere
        without it: it ends (a node lost) so the run restarts with this node. Node 0 returns the
        incident of a generation that ended undecided: it decides that first."""
        g = self.coord.generation()
        if not g:
            return None
        number, members = g["number"], tuple(g.get("members", ()))
        if number > (self.joined_at or 0):           # started since this daemon joined: it is in it
            return None
        cause = self.coord.ended(number)
        if cause is None and self.coord.node in members:
            incident = Incident(kind=Kind.NODE_LOST, first_step=0, last_step=0,
                                detail=f"node {self.coord.node}'s daemon restarted during generation {number}",
                                evidence={"nodes": [self.coord.node]})
            cause = self.coord.end_generation(number, _cause(watch.Failed(incident)))
        if not self.is_leader or cause is None or self.coord.decision(number) is not None:
            return None
        outcome = _outcome(cause)
        if not isinstance(outcome, watch.Failed):
            return None
        self._set_generation(ledger, number, members)
        return outcome.incident

    # Between generations ------------------------------------------------------------------------
    def recover(self, incident: Incident, *, ledger: Ledger, files: RunFiles, cfg: Config, base_cfg: Config,
                stopping: Callable[[], bool]) -> recovery.Decision | None:
        """Node 0 decides (as on one machine) and publishes; the others apply what it published.
        None: a stop came while waiting for the decision."""
        number = ledger.state.generation
        if self.is_leader:
            decision = recovery.decide_and_record(incident, ledger=ledger, files=files, cfg=cfg, base_cfg=base_cfg)
            published = {"record": decision.record.to_dict(), "config_changes": ledger.state.config_changes,
                         "recovery": ledger.state.recovery.to_dict() if ledger.state.recovery else None,
                         "resume_step": decision.resume_step}
            if not self._retrying(lambda: self.coord.publish_decision(number, published), ledger, stopping):
                return None
            self.coord.forget_before(number)
            return decision
        published = self._wait_for(lambda: self.coord.decision(number), ledger, stopping, "waiting_for_decision",
                                   lambda: {"generation": number}, need_leader=True)
        if published is None:
            return None
        return recovery.apply_published(published, ledger=ledger, files=files, cfg=cfg, base_cfg=base_cfg)


def _cause(outcome: watch.Outcome) -> dict:
    if isinstance(outcome, watch.Failed):
        return {"outcome": "failed", "incident": outcome.incident.to_dict()}
    if isinstance(outcome, watch.WorkerFailed):
        return {"outcome": "worker_failed", "code": outcome.code, "rank": outcome.rank, "detail": outcome.detail}
    if isinstance(outcome, watch.Regroup):
        return {"outcome": "regroup", "step": outcome.step, "nodes": list(outcome.nodes)}
    return {"outcome": type(outcome).__name__.lower(), "step": getattr(outcome, "step", None)}


def _outcome(cause: dict) -> watch.Outcome:
    kind = cause.get("outcome")
    if kind == "failed":
        return watch.Failed(Incident.from_dict(cause["incident"]))
    if kind == "worker_failed":
        return watch.WorkerFailed(int(cause["code"]), cause.get("rank"), cause.get("detail", ""))
    if kind == "stopped":
        return watch.Stopped(cause.get("step"))
    if kind == "released":
        return watch.Released(cause.get("step"))
    if kind == "regroup":
        return watch.Regroup(cause.get("step"), tuple(cause.get("nodes") or ()))
    return watch.Finished(cause.get("step"))
