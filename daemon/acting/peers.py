"""This daemon's peers, as the supervisor's loop sees them: none on one machine (`Alone`, here), or
the other nodes' daemons through etcd (daemon.machines.nodes.Nodes). `Peers` is the seam, a typing.Protocol
the supervisor is typed against; both kinds implement it (a unit test compares their signatures).

The calls: open a generation (what it runs with, this node's ranks), hear during a generation that
it ends elsewhere, say why it ended here, and, between generations, the recovery decision; plus
operator requests that reach the decider and the end of the run. `Opened` and `PeersUnavailableError`
are what both kinds return and raise.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Mapping, Protocol

from contracts.config import Config
from contracts.protocol import ExitCode
from daemon.acting import decisions
from daemon.judging import quarantine, watch
from daemon.judging.incidents import Incident
from daemon.judging.requests import Request
from daemon.processes import mindspore_env
from daemon.processes.run_files import RunFiles
from daemon.records.ledger import Ledger


@dataclasses.dataclass(frozen=True)
class Opened:
    number: int
    port: int
    resume_step: int
    cfg: Config                   # what this generation's ranks run with (the shape of its nodes)
    ranks: tuple[int, ...]        # this node's ranks in it
    members: tuple[int, ...] = ()
    scheduler: bool = True        # MindSpore's scheduler runs here (the decider's machine)
    homes: dict = dataclasses.field(default_factory=dict)   # rank -> [node, device] (daemon.judging.quarantine.homes)


class PeersUnavailableError(RuntimeError):
    """The coordinator could not be reached, or the nodes do not form a run; `code` ends the daemon."""

    def __init__(self, message: str, code: ExitCode):
        super().__init__(message)
        self.code = code


class Peers(Protocol):
    """What the supervisor's loop asks of the other machines of its run (none, or several)."""

    @property
    def is_leader(self) -> bool:
        """This daemon decides for the run (multi-node: elected, and its leader key stands)."""

    def start(self, ledger: Ledger, files: RunFiles) -> None:
        """Join the run (multi-node: register, check the run's identity); raises PeersUnavailableError."""

    def close(self) -> None:
        """Leave (release leases, stop watches)."""

    def open(self, ledger: Ledger, files: RunFiles, base: Config,
             stopping: Callable[[], bool]) -> Opened | watch.Failed | None:
        """The next generation as this node runs it; None when stopping while waiting for it; an
        incident to decide first (multi-node: the last generation's, left undecided by a lost decider)."""

    def cut_off(self, now: float) -> bool:
        """This node has lost the run (multi-node: its lease, or the coordinator, for too long)."""

    def hear(self, number: int, now: float, *, idle_s: float = 0.0) -> watch.Outcome | None:
        """Generation `number` ended elsewhere, or this node is cut off from it: how. `idle_s`: how long
        this node's ranks have made no step while they should (daemon.judging.watch.Watch.stalled_s)."""

    def requests(self) -> list[Request]:
        """Operator requests made on other nodes that this one acts on."""

    def forward(self, request: Request) -> bool:
        """Hand a request to the node that acts on it; False when that is this one."""

    def send(self, name: str, args: dict, ledger: Ledger, append: Callable[[str, dict], int]) -> None:
        """A command to every rank of the run."""

    def confirm(self) -> bool:
        """This daemon still decides, checked now (multi-node: its fencing token against etcd): before
        a write outside etcd that only the decider makes (retiring checkpoints)."""

    def conclude(self, number: int, outcome: watch.Outcome, *, requested: bool = False) -> watch.Outcome:
        """Say how generation `number` ended here; the outcome the run acts on."""

    def unfinished(self, ledger: Ledger) -> Incident | None:
        """An incident that ended a generation but was not decided (its decider died): decided first."""

    def recover(self, incident: Incident, *, ledger: Ledger, files: RunFiles, cfg: Config, base_cfg: Config,
                stopping: Callable[[], bool]) -> decisions.Decision | None:
        """The recovery decision for an incident: made here by the leader, awaited by the others."""

    def finish(self, code: int, status: str, reason: str) -> None:
        """The run ended here with this exit code, status and reason (the others end the same way)."""

    def ended_run(self) -> watch.Outcome | None:
        """The run ended elsewhere: how (None while it goes on)."""


class Alone:
    """One machine, no coordinator: a generation on this machine's devices less the quarantined ones."""

    is_leader = True

    def __init__(self, env: Mapping[str, str] | None = None):
        self.env = dict(os.environ if env is None else env)
        self.left_out: set[int] = set()        # this generation's quarantined devices (their probation: `hear`)
        self.lemons: Mapping = {}              # the run state's lemon list
        self.back: set[int] = set()            # devices whose probation ended during the last generation

    def start(self, ledger: Ledger, files: RunFiles) -> None:
        pass

    def close(self) -> None:
        pass

    def open(self, ledger: Ledger, files: RunFiles, base: Config,
             stopping: Callable[[], bool]) -> Opened | watch.Failed | None:
        devices = quarantine.machine_devices(base, self.env)
        left_out = quarantine.excluded_devices(ledger.state.lemons, files.node, time.time())
        shaped = quarantine.without_devices(base, ledger.state.config_changes, devices, left_out)
        if isinstance(shaped, str):
            raise PeersUnavailableError(shaped, ExitCode.CONFIG_ERROR)
        cfg, left = shaped
        self.left_out, self.lemons = left_out & set(devices), ledger.state.lemons
        if self.back:
            ledger.emit("devices_back", devices=list(left), back=sorted(self.back), dp=cfg.parallel.dp,
                        detail=f"devices {sorted(self.back)} are back from quarantine, on probation")
            self.back = set()
        if self.left_out:
            ledger.emit("devices_quarantined", level="warning", devices=list(left), left_out=sorted(left_out),
                        dp=cfg.parallel.dp, micro_batch=cfg.train.micro_batch, grad_accum_steps=cfg.train.grad_accum_steps,
                        detail=f"training on devices {list(left)} of {list(devices)}: {sorted(left_out)} quarantined, "
                               "the same global batch")
        n = ledger.next_generation()
        resume = files.prepare_generation(cfg, ledger.state.recovery, ledger.state.rerun,
                                         ledger.state.cadence)
        return Opened(n, cfg.run.master_port or mindspore_env.free_port(cfg.run.master_addr), resume, cfg,
                      tuple(range(cfg.parallel.world_size)), homes=quarantine.homes(cfg, left, ()))

    def cut_off(self, now: float) -> bool:
        return False

    def hear(self, number: int, now: float, *, idle_s: float = 0.0) -> watch.Outcome | None:
        """A quarantined device's probation is over: regroup (the ranks save, the next generation takes it back)."""
        if self.left_out and (back := self.left_out - quarantine.excluded_devices(self.lemons, 0, time.time())):
            self.left_out -= back
            self.back = back
            return watch.Regroup(None, tuple(sorted(back)))
        return None

    def requests(self) -> list[Request]:
        return []

    def forward(self, request: Request) -> bool:
        return False

    def send(self, name: str, args: dict, ledger: Ledger, append: Callable[[str, dict], int]) -> None:
        ledger.command_sent(name, args, append)

    def confirm(self) -> bool:
        return True

    def conclude(self, number: int, outcome: watch.Outcome, *, requested: bool = False) -> watch.Outcome:
        return outcome

    def unfinished(self, ledger: Ledger) -> Incident | None:
        """An incident a killed daemon held but did not decide: decided first."""
        held = ledger.state.undecided
        return Incident.from_dict(held) if held else None

    def recover(self, incident: Incident, *, ledger: Ledger, files: RunFiles, cfg: Config, base_cfg: Config,
                stopping: Callable[[], bool]) -> decisions.Decision | None:
        return decisions.decide_and_record(incident, ledger=ledger, files=files, cfg=cfg, base_cfg=base_cfg)

    def finish(self, code: int, status: str, reason: str) -> None:
        pass

    def ended_run(self) -> watch.Outcome | None:
        return None
