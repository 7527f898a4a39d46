"""How a multi-node run opens and ends each generation, through etcd.

Owns: node 0 publishing a generation (its gathered nodes, the config shaped for them — the same
global batch on fewer machines, contracts.elastic — the port and the step it resumes from, as a
compare-and-swap only node 0 wins) and the other nodes waiting for one with them in it; hearing
during a generation that it ends elsewhere (a peer's incident, a node lost, a lost node back);
saying why it ended here (the first node to say it sets the cause for all); and, at a daemon's
start, ending the generation it was in when its previous daemon died. Builds on daemon.membership.
"""
from __future__ import annotations

import time
from typing import Callable

from contracts.config import Config, with_changes
from contracts.elastic import shape_on
from contracts.protocol import ExitCode
from daemon import watch
from daemon.etcd_client import EtcdError
from daemon.incidents import Incident, Kind
from daemon.ledger import Ledger
from daemon.membership import POLL_S, Membership
from daemon.peers import Opened, PeersUnavailableError
from daemon.run_files import RunFiles


class GenerationHandshake:
    """Opening and ending generations with the other nodes."""

    def __init__(self, membership: Membership):
        self.m, self.cfg, self.clock = membership, membership.cfg, membership.clock
        self.coord = membership.coord
        self.members: tuple[int, ...] = ()

    @property
    def is_leader(self) -> bool:
        return self.m.is_leader

    def open(self, ledger: Ledger, files: RunFiles, base: Config, stopping: Callable[[], bool]) -> Opened | None:
        """Node 0: its nodes gathered, then the shared files and the generation published. The others:
        the next generation node 0 publishes with them in it. None: a stop came first. Raises
        PeersUnavailableError when the run cannot go on (too few nodes, etcd or node 0 gone too long)."""
        return self._lead(ledger, files, base, stopping) if self.is_leader else self._follow(ledger, base, stopping)

    def _lead(self, ledger: Ledger, files: RunFiles, base: Config, stopping) -> Opened | None:
        members = self.m.wait_for(self.m.gathered, ledger, stopping, "waiting_for_nodes", self.m.missing)
        if members is None:
            return None
        cfg = self._shaped(base, ledger.state.config_changes, members)
        resume = files.prepare_generation(cfg, ledger.state.recovery)
        stored = self.coord.generation()
        number = max(ledger.state.generation, stored["number"] if stored else 0) + 1
        written = self.m.retrying(lambda: self.coord.publish_generation(
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
            after = max(ledger.state.generation, self.m.joined_at or 0)
            return g if g and g["number"] > after and self.coord.node in g.get("members", ()) else None

        g = self.m.wait_for(published, ledger, stopping, "waiting_for_generation",
                           lambda: {"after": max(ledger.state.generation, self.m.joined_at or 0)}, need_leader=True)
        if g is None:
            return None
        ledger.state.set_config_changes(g.get("config_changes") or {})
        members = tuple(g["members"])
        self._set_generation(ledger, g["number"], members)
        return Opened(g["number"], int(g["port"]), int(g["resume_step"]),
                      self._shaped(base, ledger.state.config_changes, members), self._ranks(members), members)

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

    def hear(self, number: int, now: float) -> watch.Outcome | None:
        """The generation ends elsewhere: a peer said why, or a member node's daemon is gone; or, on
        node 0 of a smaller generation, a lost node is back (regroup: the ranks save and the next
        generation takes it back)."""
        cause = self.coord.ended(number)
        if cause is not None:
            return _outcome(cause)
        live = self.m.live()
        if self.is_leader and (back := sorted(set(live) - set(self.members))):
            return watch.Regroup(None, tuple(back))
        lost = sorted(set(self.members) - set(live))
        if lost and self.coord.unreachable_s(now) < self.coord.ttl_s:     # etcd's silence is not a node's loss
            return watch.Failed(Incident(kind=Kind.NODE_LOST, first_step=0, last_step=0, rank=None,
                                         detail=f"node {lost[0]}'s daemon is gone (its etcd lease expired)",
                                         evidence={"nodes": lost}))
        return None

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
        if number > (self.m.joined_at or 0):           # started since this daemon joined: it is in it
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
