"""What crosses between a multi-node run's daemons besides generations: the decider's recovery
decision for the incident that ended a generation (it decides as on one machine and publishes,
fenced; the others apply exactly what it published, and elect another if it is lost first),
operator requests made on any node (the decider takes each once), and the ranks' commands (the
decider alone writes them, for all, after confirming it still decides). Builds on daemon.machines.membership.
"""
from __future__ import annotations

from typing import Callable, Sequence

from contracts.config import Config
from daemon.acting import decisions
from daemon.judging.incidents import Incident
from daemon.judging.requests import Request
from daemon.machines.etcd_client import EtcdError
from daemon.machines.etcd_keys import NotLeaderError
from daemon.machines.membership import BecameLeader, Membership
from daemon.processes.run_files import RunFiles
from daemon.records.ledger import Ledger


class DecisionExchange:
    """Node 0's decisions and the operators' requests, between the nodes."""

    def __init__(self, membership: Membership):
        self.m, self.coord = membership, membership.coord

    @property
    def is_leader(self) -> bool:
        return self.m.is_leader

    def recover(self, incident: Incident, *, ledger: Ledger, files: RunFiles, cfg: Config, base_cfg: Config,
                stopping: Callable[[], bool],
                agreed: Callable[[], Sequence[int] | None] = lambda: None) -> decisions.Decision | None:
        """The decider decides (as on one machine) and publishes; the others apply what it published,
        and one of them decides if the decider is lost meanwhile. None: a stop, or the run's end,
        came while waiting for the decision. `agreed()`: the RAM steps every machine left holds (the decider's)."""
        number = ledger.state.generation
        while True:
            if self.is_leader and self.confirm():      # still decides: its rollback renames are its to do
                decision = decisions.decide_and_record(incident, ledger=ledger, files=files, cfg=cfg,
                                                       base_cfg=base_cfg, common=agreed())
                published = {"record": decision.record.to_dict(), "config_changes": ledger.state.config_changes,
                             "recovery": ledger.state.recovery.to_dict() if ledger.state.recovery else None,
                             "resume_step": decision.resume_step, "progress_step": decision.progress_step}
                written = self.m.retrying(lambda: self.coord.publish_decision(number, published), ledger, stopping)
                if written is None:
                    return None
                if written:
                    self._forget_before(number)
                    return decision
                # deposed before it was published: the new decider's decision is the one that stands
            ledger.set_status("restarting")          # its generation ended; the decision is the decider's
            published = self.m.wait_for(lambda: self.coord.decision(number), ledger, stopping, "waiting_for_decision",
                                        lambda: {"generation": number, "incident": incident.kind.value},
                                        follower=True)
            if published is None:
                return None
            if not isinstance(published, BecameLeader):
                return decisions.apply_published(published, ledger=ledger, files=files, cfg=cfg, base_cfg=base_cfg)

    def _forget_before(self, number: int) -> None:
        try:
            self.coord.forget_before(number)
        except EtcdError:
            pass                                 # tried again after the next decision

    def requests(self) -> list[Request]:
        """The decider: operator requests dropped on any node, each taken once."""
        if not self.is_leader:
            return []
        taken = []
        for key, r in self.coord.pending_requests():
            try:
                if not self.coord.take_request(key):
                    continue
            except EtcdError:
                break
            if r.get("name"):
                taken.append(Request(r["name"], dict(r.get("body") or {}),
                                     f"node {r.get('node')}: {r.get('file', '')}".rstrip(": ")))
        return taken

    def forward(self, request: Request) -> bool:
        """A request on a node that does not decide: sent to the decider (True)."""
        if self.is_leader:
            return False
        try:
            self.coord.send_request(request.name, {**request.body, "file": request.file})
        except EtcdError:
            return False
        return True

    def confirm(self) -> bool:
        """This daemon still decides, checked against etcd now (the fencing token): before a write
        outside etcd only the decider makes (the ranks' commands, retiring checkpoints). False only
        when etcd refused the token; with etcd silent it goes by what it knew (its commands are
        stamped with their generation, which only that generation's ranks apply)."""
        try:
            self.coord.confirm_leadership()
        except NotLeaderError:
            return False
        except EtcdError:
            return bool(self.coord.token)
        return True

    def send(self, name: str, args: dict, ledger: Ledger, append: Callable[[str, dict], int], *,
             leads: bool) -> None:
        """A command for the ranks: the daemon that published the generation (`leads`) writes it for
        all unless etcd refused its token since; another node asks the decider for a stop (its own
        signal) and leaves the rest to it, which saw the same requests."""
        if leads:
            if self.confirm():
                ledger.command_sent(name, args, append)
            else:
                ledger.emit("command_withheld", level="warning", name=name, args=args,
                            detail="this daemon no longer decides for the run")
        elif name == "stop" and self.forward(Request("stop", {"reason": f"node {self.coord.node} stopping"}, "signal")):
            ledger.emit("stop_forwarded", node=self.coord.node, detail="asked the decider to stop the run")
