"""A node of a multi-node run: the other nodes' daemons through etcd, as the supervisor's Peers.

Composes the parts of being one of several machines: membership (daemon.machines.membership: joining,
live nodes, the shared run directory, etcd's silence, the run's end), the generation handshake
(daemon.machines.generation_handshake: open a generation, hear that it ends elsewhere, say why it ended
here), the decision exchange (daemon.machines.decision_exchange: the decider's recovery decisions,
operator requests, the ranks' commands) and the RAM tier among the machines (daemon.machines.ram_sharing: what
each holds, the step agreed, a step taken from a peer). The etcd keys themselves are daemon.machines.etcd_keys'.
"""
from __future__ import annotations

import time
from typing import Callable

from contracts.config import Config
from daemon.acting import decisions
from daemon.acting.peers import Opened
from daemon.judging import watch
from daemon.judging.incidents import Incident
from daemon.judging.requests import Request
from daemon.machines.decision_exchange import DecisionExchange
from daemon.machines.generation_handshake import GenerationHandshake
from daemon.machines.membership import Membership
from daemon.machines.ram_sharing import RamSharing
from daemon.processes.run_files import RunFiles
from daemon.records.ledger import Ledger


class Nodes:
    """A node of a multi-node run (implements daemon.acting.peers.Peers)."""

    def __init__(self, cfg: Config, *, clock: Callable[[], float] = time.monotonic):
        self.membership = Membership(cfg, clock=clock)
        self.ram = RamSharing(self.membership)
        self.generations = GenerationHandshake(self.membership, self.ram)
        self.decisions = DecisionExchange(self.membership)

    @property
    def is_leader(self) -> bool:
        return self.membership.is_leader

    # membership
    def start(self, ledger: Ledger, files: RunFiles) -> None:
        self.membership.start(ledger, files)
        self.ram.start(files)

    def close(self) -> None:
        self.ram.close()
        self.membership.close()

    def cut_off(self, now: float) -> bool:
        return self.membership.cut_off(now)

    def finish(self, code: int, status: str, reason: str) -> None:
        self.membership.finish(code, status, reason)

    def ended_run(self) -> watch.Outcome | None:
        return self.membership.ended_run()

    # the generation handshake
    def open(self, ledger: Ledger, files: RunFiles, base: Config,
             stopping: Callable[[], bool]) -> Opened | watch.Failed | None:
        files.fence_generation = 0
        self.ram.say_held(ledger, files)          # this node's ranks are gone: what its RAM tier holds
        opened = self.generations.open(ledger, files, base, stopping)
        if isinstance(opened, Opened):
            files.fence_generation = opened.number       # its commands are for its ranks only
            # with a RAM tier on every machine, every rank resumes from the step the decider agreed; what this
            # machine's RAM holds after it is another history's (trained before a rollback, or while the run went
            # on without this machine) and would be taken for this one's: it goes
            files.agreed_step = opened.resume_step if files.memory_tier else None
            if files.memory_tier:
                files.retire_memory_after(opened.resume_step)
                self.ram.start_copies(files, opened)     # buddy placement: copies of buddies' parts
        return opened

    def hear(self, number: int, now: float, *, idle_s: float = 0.0) -> watch.Outcome | None:
        return self.generations.hear(number, now, idle_s=idle_s)

    def conclude(self, number: int, outcome: watch.Outcome, *, requested: bool = False) -> watch.Outcome:
        return self.generations.conclude(number, outcome, requested=requested)

    def unfinished(self, ledger: Ledger) -> Incident | None:
        return self.generations.unfinished(ledger)

    # the decision exchange
    def recover(self, incident: Incident, *, ledger: Ledger, files: RunFiles, cfg: Config, base_cfg: Config,
                stopping: Callable[[], bool]) -> decisions.Decision | None:
        self.ram.say_held(ledger, files)          # this node's ranks are gone: what its RAM tier holds
        return self.decisions.recover(incident, ledger=ledger, files=files, cfg=cfg, base_cfg=base_cfg,
                                      stopping=stopping,
                                      agreed=lambda: self.ram.agreed(ledger, files, stopping))

    def requests(self) -> list[Request]:
        return self.decisions.requests()

    def forward(self, request: Request) -> bool:
        return self.decisions.forward(request)

    def send(self, name: str, args: dict, ledger: Ledger, append: Callable[[str, dict], int]) -> None:
        g = self.generations
        self.decisions.send(name, args, ledger, append, leads=bool(g.led) and g.led == ledger.state.generation)

    def confirm(self) -> bool:
        return self.decisions.confirm()
