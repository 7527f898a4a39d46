"""How a multi-node run opens and ends each generation, through etcd.

Owns: the decider publishing a generation (its gathered nodes, the config shaped for them — the
same global batch on fewer machines, contracts.elastic — its own address for MindSpore's scheduler,
the port and the step it resumes from, as a fenced compare-and-swap) and the other nodes waiting
for one with them in it (campaigning when no one decides); hearing during a generation that it
ends elsewhere (a peer's incident, a node lost, a lost node back) or that this node is cut off
(its ranks stop at once); saying why it ended here (the first node to say it sets the cause for
all); and, at a daemon's start, ending the generation it was in when its previous daemon died.
Builds on daemon.machines.membership.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from contracts.config import EMBEDDED, Config, failure_domains, run_endpoints, with_changes
from contracts.elastic import shape_on
from contracts.protocol import ExitCode
from daemon.acting.peers import Opened, PeersUnavailableError
from daemon.judging import quarantine, watch
from daemon.judging.incidents import Incident, Kind
from daemon.machines import leadership
from daemon.machines.etcd_client import EtcdError
from daemon.machines.etcd_keys import NotLeaderError
from daemon.machines.membership import POLL_S, BecameLeader, Membership
from daemon.machines.ram_sharing import RamSharing
from daemon.processes.run_files import RunFiles
from daemon.records.ledger import Ledger


class GenerationHandshake:
    """Opening and ending generations with the other nodes."""

    def __init__(self, membership: Membership, ram: RamSharing):
        self.m, self.cfg, self.clock = membership, membership.cfg, membership.clock
        self.ram = ram
        self.coord = membership.coord
        self.members: tuple[int, ...] = ()
        self.led = 0                  # the last generation this daemon published as the decider
        self._lemons: dict = {}       # the run state's lemon list (daemon.judging.quarantine), as of the last open

    @property
    def is_leader(self) -> bool:
        return self.m.is_leader

    def open(self, ledger: Ledger, files: RunFiles, base: Config,
             stopping: Callable[[], bool]) -> Opened | watch.Failed | None:
        """The decider: its nodes gathered, then the shared files and the generation published. The
        others: the next generation the decider publishes with them in it; a follower elected while it
        waits leads instead. A Failed outcome: an incident that ended the last generation was never
        decided (its decider was lost): this daemon, deciding now, decides it first. None: a stop or
        the run's end came first. Raises PeersUnavailableError when the run cannot go on (too few
        nodes, etcd gone too long)."""
        self._lemons = ledger.state.lemons
        while True:
            if self.is_leader:
                if (undecided := self._undecided(ledger)) is not None:
                    return watch.Failed(undecided)
                opened = self._lead(ledger, files, base, stopping)
            else:
                opened = self._follow(ledger, base, stopping)
            if not isinstance(opened, BecameLeader):
                return opened

    def _lead(self, ledger: Ledger, files: RunFiles, base: Config, stopping) -> Opened | BecameLeader | None:
        members = self.m.wait_for(self.m.gathered, ledger, stopping, "waiting_for_nodes", self.m.missing)
        if members is None:
            return None
        held = quarantine.excluded_nodes(ledger.state.lemons, time.time())
        sit_out = leadership.without_quarantined(members, held, self.coord.me(), self.coord.rules)
        if sit_out.resign:                       # the decider's own machine: another decides, this one waits
            if self._resign(ledger):
                return BecameLeader()
            sit_out = dataclasses.replace(       # its resignation failed: it decides this one, quarantined
                leadership.without_quarantined(members, held - {self.coord.node}, self.coord.me(), self.coord.rules),
                deferred=True)
        if sit_out.deferred:
            ledger.emit("quarantine_deferred", level="warning", node=self.coord.node,
                        detail="this decider's own machine is quarantined and no other machine can decide: it "
                               "stays in the run")
        if sit_out.give_up is not None:
            raise PeersUnavailableError(sit_out.give_up.reason, ExitCode(sit_out.give_up.code))
        members, held = sit_out.members, set(sit_out.left_out)
        cfg = self._shaped(base, ledger.state.config_changes, members, self.coord.addr)
        if not self._confirmed(ledger):          # the shared files are the decider's to write
            return BecameLeader()
        common = self.ram.agreed(ledger, files, stopping, members)     # the RAM steps they all hold
        resume = files.prepare_generation(cfg, ledger.state.recovery, ledger.state.rerun, ledger.state.cadence,
                                          common)
        stored = self.coord.generation()
        number = max(ledger.state.generation, stored["number"] if stored else 0) + 1
        written = self.m.retrying(lambda: self.coord.publish_generation(
            number, members=list(members), addr=self.coord.addr, port=cfg.run.master_port, resume_step=resume,
            config_changes=ledger.state.config_changes), ledger, stopping)
        if written is None:
            return None
        if not written:          # deposed meanwhile, or another generation stored: follow whoever decides
            return BecameLeader()
        before = self.members
        self._set_generation(ledger, number, members)
        self.led = number
        if held:                                       # said as the new generation's
            ledger.emit("nodes_quarantined", level="warning", members=list(members), left_out=sorted(held),
                        detail=f"nodes {sorted(held)} are quarantined: left out of this generation")
        if len(members) < self.cfg.run.nodes:
            ledger.emit("nodes_shrunk", level="warning", members=list(members),
                        lost=sorted(set(range(self.cfg.run.nodes)) - set(members)), dp=cfg.parallel.dp,
                        micro_batch=cfg.train.micro_batch, grad_accum_steps=cfg.train.grad_accum_steps,
                        detail=f"going on with {len(members)} of {self.cfg.run.nodes} nodes, the same global batch")
        elif before and len(before) < self.cfg.run.nodes:
            ledger.emit("nodes_rejoined", members=list(members), dp=cfg.parallel.dp)
        return Opened(number, cfg.run.master_port, resume, cfg, self._ranks(members), members, scheduler=True,
                      homes=quarantine.homes(cfg, (), members))

    def _resign(self, ledger: Ledger) -> bool:
        try:
            resigned = self.coord.resign()
        except EtcdError:
            return False
        if resigned:
            ledger.emit("resigned", level="warning", node=self.coord.node,
                        detail=f"node {self.coord.node} is quarantined: it stops deciding and waits out its probation")
        return resigned

    def _confirmed(self, ledger: Ledger) -> bool:
        try:
            self.coord.confirm_leadership()
            return True
        except NotLeaderError as e:
            ledger.emit("deposed", level="warning", node=self.coord.node, detail=str(e))
            return False
        except EtcdError:
            ledger.tick()
            time.sleep(POLL_S)                  # etcd away: asked again, not at once
            return False

    def _follow(self, ledger: Ledger, base: Config, stopping) -> Opened | BecameLeader | None:
        def published():
            g = self.coord.generation()
            after = max(ledger.state.generation, self.m.joined_at or 0)
            return g if g and g["number"] > after and self.coord.node in g.get("members", ()) else None

        g = self.m.wait_for(published, ledger, stopping, "waiting_for_generation",
                            lambda: {"after": max(ledger.state.generation, self.m.joined_at or 0)}, follower=True)
        if g is None or isinstance(g, BecameLeader):
            return g
        ledger.note_config_changes(g.get("config_changes") or {})
        members = tuple(g["members"])
        self._set_generation(ledger, g["number"], members)
        cfg = self._shaped(base, ledger.state.config_changes, members, g.get("addr") or self.cfg.run.master_addr)
        return Opened(g["number"], int(g["port"]), int(g["resume_step"]), cfg, self._ranks(members), members,
                      homes=quarantine.homes(cfg, (), members),
                      scheduler=False)

    def _shaped(self, base: Config, changes: dict, members: tuple[int, ...], scheduler_addr: str) -> Config:
        return generation_config(base, changes, members, self.coord.node, scheduler_addr)

    def _ranks(self, members: tuple[int, ...]) -> tuple[int, ...]:
        per_node = self.cfg.parallel.world_size // self.cfg.run.nodes
        slot = members.index(self.coord.node)
        return tuple(range(slot * per_node, (slot + 1) * per_node))

    def _set_generation(self, ledger: Ledger, number: int, members: tuple[int, ...]) -> None:
        ledger.next_generation(number)
        self.members = members

    def hear(self, number: int, now: float, *, idle_s: float = 0.0) -> watch.Outcome | None:
        """The generation ends elsewhere: a peer said why, or a member node's daemon is gone; or, on
        the decider of a smaller generation, a lost node is back (regroup: the ranks save and the next
        generation takes it back); or this node is cut off from the run (see `_cut_off`). `idle_s`:
        how long this node's ranks have made no step."""
        if (why := self._cut_off(number, now, idle_s)) is not None:          # before a cause said elsewhere:
            return watch.Failed(Incident(kind=Kind.NODE_LOST, first_step=0, last_step=0, rank=None, detail=why,
                                         evidence={"nodes": [self.coord.node], "cut_off": True}))  # no grace
        cause = self.coord.ended(number)
        if cause is not None:
            return _outcome(cause)
        live = self.m.live()
        held = quarantine.excluded_nodes(self._lemons, time.time())      # still on probation: not back yet
        if self.is_leader and (back := sorted(set(live) - set(self.members) - held)):
            return watch.Regroup(None, tuple(back))
        lost = sorted(set(self.members) - set(live))
        if lost and self.coord.unreachable_s(now) < self.coord.ttl_s:     # etcd's silence is not a node's loss
            return watch.Failed(Incident(kind=Kind.NODE_LOST, first_step=0, last_step=0, rank=None,
                                         detail=f"node {lost[0]}'s daemon is gone (its etcd lease expired)",
                                         evidence={"nodes": lost}))
        return None

    def _cut_off(self, number: int, now: float, idle_s: float) -> str | None:
        """Why this node's ranks must stop at once, if they must. It led this generation and learned it
        no longer decides (its leader key is gone: another may decide now), or its lease lapsed
        (unrenewed past the TTL) and the generation ended elsewhere meanwhile; or, led or not, its
        lease lapsed while its ranks made no step as long (partitioned: the others may have moved on
        without it; ranks that still step prove they have not, as when etcd is away for everyone)."""
        me, ttl = self.coord.node, self.coord.ttl_s
        unrenewed = self.coord.unrenewed_s(now)
        if self.led == number and not self.coord.token:
            return f"node {me}'s daemon no longer decides for the run (its leader key is gone): its ranks stop at once"
        if self.led == number and unrenewed > ttl and self.coord.ended(number) is not None:
            return (f"node {me}'s daemon no longer decides for the run (its lease unrenewed for {unrenewed:.0f} s, "
                    "the generation ended elsewhere): its ranks stop at once")
        if unrenewed > ttl and idle_s > ttl:
            return (f"node {me}'s daemon has not renewed its etcd lease for {unrenewed:.0f} s and its ranks made no "
                    f"step for {idle_s:.0f} s: cut off from the run, its ranks stop at once")
        return None

    def conclude(self, number: int, outcome: watch.Outcome, *, requested: bool = False) -> watch.Outcome:
        """Says why the generation ended here; the cause every node goes by (the first one said).
        Ranks that stopped with no stop asked for here (`requested`) ended for a reason elsewhere:
        a stop node 0 asked for, or a node whose daemon died (its ranks, told by their parent-death
        signal, saved and stopped every rank): that cause is awaited, not declared."""
        if isinstance(outcome, watch.Stopped) and not requested:
            outcome = self._unasked_stop(number)
        try:
            stands = _outcome(self.coord.end_generation(number, _cause(outcome)))
        except EtcdError:
            return outcome
        cut_off = isinstance(outcome, watch.Failed) and outcome.incident.evidence.get("cut_off")
        # a cut-off node's ranks stop at once (no grace) for a failure decided elsewhere
        return outcome if cut_off and isinstance(stands, watch.Failed) else stands

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
        without it: it ends (a node lost) so the run restarts with this node. What ended undecided
        is decided by whichever daemon decides (`open` returns it to the decider)."""
        g = self.coord.generation()
        if not g:
            return None
        number, members = g["number"], tuple(g.get("members", ()))
        if number > (self.m.joined_at or 0):           # started since this daemon joined: it is in it
            return None
        if self.coord.ended(number) is None and self.coord.node in members:
            incident = Incident(kind=Kind.NODE_LOST, first_step=0, last_step=0,
                                detail=f"node {self.coord.node}'s daemon restarted during generation {number}",
                                evidence={"nodes": [self.coord.node]})
            try:
                self.coord.end_generation(number, _cause(watch.Failed(incident)))
            except EtcdError:
                pass
        return None

    def _undecided(self, ledger: Ledger) -> Incident | None:
        """The stored generation ended with an incident no decider decided (it was lost first, or
        the whole run was): the decider decides it as that generation's, before the next one."""
        g = self.coord.generation()
        if not g or self.coord.decision(g["number"]) is not None:
            return None
        cause = self.coord.ended(g["number"])
        outcome = _outcome(cause) if cause is not None else None
        if not isinstance(outcome, watch.Failed):
            return None
        self._set_generation(ledger, g["number"], tuple(g.get("members", ())))
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


def generation_config(base: Config, changes: dict, members: tuple[int, ...], node: int, scheduler_addr: str) -> Config:
    """The config of a generation of `members` on node `node`: the policy's changes, the data-parallel size of
    these nodes with the same global batch (contracts.elastic), the same on every node, and where
    the decider's MindSpore scheduler listens."""
    merged = dict(changes)
    micro = merged.get("train.micro_batch", base.train.micro_batch)
    per_node = base.parallel.world_size // base.run.nodes
    shape = shape_on(len(members), ranks_per_node=per_node, model_parallel=base.parallel.tp * base.parallel.pp,
                     global_batch=base.train.global_batch, micro_batch=micro)
    if shape is None:       # refused when the config was read (contracts.config._check_elastic)
        raise PeersUnavailableError(f"no shape keeps train.global_batch on {len(members)} nodes", ExitCode.CONFIG_ERROR)
    slot = members.index(node) if node in members else 0
    merged.update({"parallel.dp": shape.dp, "train.micro_batch": shape.micro_batch,
                   "train.grad_accum_steps": shape.grad_accum_steps, "run.nodes": len(members),
                   "run.node_rank": slot, "run.min_nodes": 0, "run.master_addr": scheduler_addr})
    if base.run.failure_domains:               # one name per machine of the generation, in its order
        names = failure_domains(base.run.failure_domains)
        merged["run.failure_domains"] = ",".join(names[n] for n in members)
    if base.run.coordinator == EMBEDDED:       # the same etcd, named as the generation's (fewer) nodes allow
        merged["run.coordinator"] = "etcd://" + ",".join(f"{h}:{p}" for h, p in run_endpoints(base.run))
    return with_changes(base, merged)
