"""What crosses between a multi-node run's daemons besides generations: node 0's recovery decision
for the incident that ended a generation (node 0 decides as on one machine and publishes; the
others apply exactly what it published), operator requests made on any node (they reach node 0),
and the ranks' commands (node 0 alone writes them, for all). Builds on daemon.membership.
"""
from __future__ import annotations

from typing import Callable

from contracts.config import Config
from daemon import decisions
from daemon.control import Request
from daemon.etcd_client import EtcdError
from daemon.incidents import Incident
from daemon.ledger import Ledger
from daemon.membership import Membership
from daemon.run_files import RunFiles


class DecisionExchange:
    """Node 0's decisions and the operators' requests, between the nodes."""

    def __init__(self, membership: Membership):
        self.m, self.coord = membership, membership.coord

    @property
    def is_leader(self) -> bool:
        return self.m.is_leader

    def recover(self, incident: Incident, *, ledger: Ledger, files: RunFiles, cfg: Config, base_cfg: Config,
                stopping: Callable[[], bool]) -> decisions.Decision | None:
        """Node 0 decides (as on one machine) and publishes; the others apply what it published.
        None: a stop came while waiting for the decision."""
        number = ledger.state.generation
        if self.is_leader:
            decision = decisions.decide_and_record(incident, ledger=ledger, files=files, cfg=cfg, base_cfg=base_cfg)
            published = {"record": decision.record.to_dict(), "config_changes": ledger.state.config_changes,
                         "recovery": ledger.state.recovery.to_dict() if ledger.state.recovery else None,
                         "resume_step": decision.resume_step}
            if not self.m.retrying(lambda: self.coord.publish_decision(number, published), ledger, stopping):
                return None
            self.coord.forget_before(number)
            return decision
        published = self.m.wait_for(lambda: self.coord.decision(number), ledger, stopping, "waiting_for_decision",
                                   lambda: {"generation": number}, need_leader=True)
        if published is None:
            return None
        return decisions.apply_published(published, ledger=ledger, files=files, cfg=cfg, base_cfg=base_cfg)

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
