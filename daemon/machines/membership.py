"""A multi-node run's membership: this daemon's place among the run's machines, through etcd.

Owns joining and leaving: the run's identity checked before any key is written (a daemon of
another run directory or trajectory is refused, exit 78, while the run has live nodes), this node's
rank claimed (one daemon per rank: a live one elsewhere refuses the newcomer, exit 78), its lease
(daemon.machines.etcd_keys). Then which nodes are live, the election of the decider (any node; the lowest
ranks first), the decider's gathering of its nodes for a generation (all of them, or after
run.node_join_timeout_s at a fresh run's start, run.node_rejoin_timeout_s later, the live ones if there are enough), how long etcd has been silent
(`cut_off`), the waits and retried writes that go on only while etcd is there (a node that waits
for a decider that is gone campaigns itself), and how the run ended (the decider records it; the
others follow with the same code). The generation handshake (daemon.machines.generation_handshake) and
the decision exchange (daemon.machines.decision_exchange) build on it; daemon.machines.nodes composes the three.
"""
from __future__ import annotations

import datetime
import json
import time
from typing import Any, Callable, Mapping

from checkpointing import layout
from contracts.config import EMBEDDED, Config, config_hash
from contracts.protocol import ExitCode
from daemon.acting.peers import PeersUnavailableError
from daemon.judging import quarantine, watch
from daemon.machines import leadership
from daemon.machines.coordinator import Coordinator
from daemon.machines.embedded_etcd import EmbeddedMember
from daemon.machines.etcd_client import Etcd, EtcdError, compare_modified, compare_none_under, op_delete_prefix, op_put
from daemon.machines.etcd_keys import NotLeaderError, decode
from daemon.processes.run_files import RunFiles
from daemon.records.ledger import Ledger

POLL_S = 0.2


class BecameLeader:
    """What a follower's wait returns when it was elected meanwhile: it now leads instead."""


class Membership:
    """This node among the run's nodes."""

    def __init__(self, cfg: Config, *, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.clock = cfg, clock
        self.coord = Coordinator(cfg, Etcd.for_run(cfg.run, timeout_s=2.0), clock=clock)
        self.member = None          # run.coordinator = "embedded": this node's etcd member (set at start)
        self.joined_at: int | None = None       # the generation number stored when this daemon joined
        self.joined_revision = 0                # etcd's revision then: older run ends are another daemon's
        self.run_id = ""                        # the run directory's identity (checkpointing.layout.run_id)
        self._leaderless_since: float | None = None
        self._waiting_since: float | None = None     # the decider began to wait for missing nodes
        self.role = leadership.Role.FOLLOWER         # as the leadership core last saw this daemon
        self.while_waiting: Callable[[Ledger], None] = lambda ledger: None   # a follower's chores as it waits

    @property
    def is_leader(self) -> bool:
        return self.coord.is_leader

    # Joining -------------------------------------------------------------------------------------
    def start(self, ledger: Ledger, files: RunFiles) -> None:
        """Checks the run's identity and claims this node's rank (before writing any key), joins,
        and campaigns if no one decides yet."""
        if self.cfg.run.coordinator == EMBEDDED:
            self.member = EmbeddedMember(self.cfg, files.node_dir, files.log_dir)
        try:
            files.run_dir.mkdir(parents=True, exist_ok=True)
            self.run_id = layout.run_id(files.run_dir)
        except OSError as e:
            raise PeersUnavailableError(f"run.dir {files.run_dir}: {e.strerror or e}", ExitCode.CANT_CREATE) from e
        if self.member is not None:
            if (said := self.member.start()) is not None:
                ledger.emit("etcd_member", node=self.coord.node, detail=said)
        try:
            kvs, revision = self._first_read(ledger)
            stored = {kv.key.decode()[len(self.coord.prefix):]: kv for kv in kvs}
            self._check_identity(stored, files)
            self._claim_rank(stored)
            generation = stored.get("generation")
            self.joined_at = json.loads(generation.value).get("number", 0) if generation else 0
            self.joined_revision = revision
            self.coord.join()
            elected = self.coord.campaign(self.clock(), _passed_over(ledger.state.lemons))
        except EtcdError as e:
            raise PeersUnavailableError(f"run.coordinator {self.cfg.run.coordinator}: {e}", ExitCode.TEMP_FAIL) from e
        ledger.emit("node_joined", node=self.coord.node, nodes=self.cfg.run.nodes, addr=self.coord.addr,
                    leader=self.coord.leader(), live=self.coord.live_nodes(), stored_generation=self.joined_at,
                    prefix=self.coord.prefix)
        if elected:
            ledger.emit("elected", node=self.coord.node, addr=self.coord.addr,
                        detail=f"node {self.coord.node} decides for the run")

    def _first_read(self, ledger: Ledger):
        """Every key of the run. An embedded etcd answers once a quorum of its members runs (they start
        with their daemons): waited for up to run.coordinator_timeout_s; an external one must answer."""
        deadline = self.clock() + (self.cfg.run.coordinator_timeout_s if self.member is not None else 0.0)
        while True:
            try:
                return self.coord.client.get_prefix(self.coord.prefix)
            except EtcdError:
                if self.clock() >= deadline:
                    raise
                ledger.tick()
                time.sleep(1.0)

    def _check_identity(self, stored: dict, files: RunFiles) -> None:
        """The run in etcd must be this one: the same run directory (its id) and trajectory. While
        the run has live nodes a daemon of another is refused; with none, this daemon's run takes the
        prefix (a new run directory: the old run's keys go)."""
        mine = {"run_id": self.run_id, "trajectory": config_hash(self.cfg)}
        kv = stored.get("identity")
        theirs = decode(kv.value) if kv else None
        if theirs == mine:
            return
        live = sorted(k for k in stored if k.startswith("nodes/"))
        if theirs is not None and live:
            raise PeersUnavailableError(
                f"this daemon is not of the run under {self.coord.prefix}: its run.dir {files.run_dir} has run id "
                f"{mine['run_id']} and config trajectory {mine['trajectory']}; the live run's are "
                f"{theirs.get('run_id')} and {theirs.get('trajectory')} (every node must share one run directory "
                "and config; another run needs its own run.coordinator_prefix)", ExitCode.CONFIG_ERROR)
        ops = [op_put(self.coord.prefix + "identity", json.dumps(mine))]
        compares = [compare_modified(self.coord.prefix + "identity", kv.mod_revision if kv else 0)]
        if theirs is not None and theirs.get("run_id") != self.run_id:        # another run's leftovers
            ops = [op_delete_prefix(self.coord.prefix), *ops]
            compares.append(compare_none_under(self.coord.prefix + "nodes/"))  # none of its daemons came back
        won, _ = self.coord.client.txn(compares, ops)
        if not won:            # another daemon wrote it first: it must be of this run too
            again = self.coord.client.get(self.coord.prefix + "identity")
            if again is None or decode(again.value) != mine:
                raise PeersUnavailableError(
                    f"another daemon took {self.coord.prefix} for a different run (run id "
                    f"{decode(again.value).get('run_id') if again else '?'}) while this one started with run id "
                    f"{self.run_id}: every node must share one run directory", ExitCode.CONFIG_ERROR)
        if kv is not None:
            stored.clear()                    # the previous run's keys are not this one's to read

    def _claim_rank(self, stored: dict) -> None:
        """One daemon per node rank. This machine's previous daemon (dead: this one holds its lock)
        is let go at once; another machine's is waited for up to a lease TTL, then refused."""
        key = f"nodes/{self.coord.node}"
        kv = stored.get(key)
        if kv is None:
            return
        held = decode(kv.value) or {}
        if held.get("addr") == self.coord.addr and held.get("host") == self.coord.record()["host"] \
                and not _alive(held.get("pid")):              # this machine's previous daemon, dead
            self.coord.client.revoke(kv.lease)
            return
        deadline = self.clock() + self.coord.ttl_s + 1.0
        while self.clock() < deadline:
            if self.coord.client.get(self.coord.prefix + key) is None:
                return
            time.sleep(POLL_S)
        raise PeersUnavailableError(
            f"run.node_rank = {self.coord.node} is held by a live daemon at {held.get('addr')} "
            f"(host {held.get('host')}, pid {held.get('pid')}): is a second machine configured with this node "
            "rank?", ExitCode.CONFIG_ERROR)

    def close(self) -> None:
        self.coord.leave()
        if self.member is not None:
            self.member.stop()

    # Who is there ------------------------------------------------------------------------------
    def live(self) -> list[int]:
        return [n for n in self.coord.live_nodes() if 0 <= n < self.cfg.run.nodes]

    def campaign(self, now: float, lemons: Mapping[str, Any] | None = None) -> bool:
        """Campaign to decide, passing over machines quarantined on the lemon list (daemon.judging.quarantine)."""
        try:
            return self.coord.campaign(now, _passed_over(lemons or {}))
        except EtcdError:
            return False

    def gathered(self) -> tuple[int, ...] | None:
        """The decider: every node; or, once it has waited with some missing — run.node_join_timeout_s
        for a fresh run's first generation (machines boot at different times), else
        run.node_rejoin_timeout_s (a lost node's return) — the live ones if they are at least
        run.min_nodes (else the run ends)."""
        got = leadership.gather(frozenset(self.live()), self.clock(), self.coord.rules,
                                waiting_since=self._waiting_since, first_generation=self.coord.generation() is None)
        self._waiting_since = got.waiting_since
        if got.give_up is not None:
            raise PeersUnavailableError(got.give_up.reason, ExitCode(got.give_up.code))
        return got.members

    def missing(self) -> dict:
        live = self.live()
        return {"live": live, "nodes": self.cfg.run.nodes,
                "missing": sorted(set(range(self.cfg.run.nodes)) - set(live))}

    # Waiting -----------------------------------------------------------------------------------
    def wait_for(self, ready, ledger: Ledger, stopping, note: str, fields: Callable[[], dict], *,
                 follower: bool = False):
        """Polls `ready()` until it returns something truthy (returned), or a stop (None); says once
        what it waits for, and again every minute. A `follower` waits on a decider: with none, it
        campaigns, and returns BecameLeader once elected. Raises PeersUnavailableError once etcd has
        been unreachable past run.coordinator_timeout_s."""
        said = None
        while not stopping():
            got = ready()
            if got:
                return got
            if said is None:                         # `status` says what this node waits for
                ledger.set_waiting(f"{note.replace('_', ' ')} ({', '.join(f'{k} {v}' for k, v in fields().items())})")
            if self.ended_run() is not None:
                return None
            now = self.clock()
            self.check_coordinator(now)
            if follower and self._follower_elected(ledger, now):
                return BecameLeader()
            if follower:
                self.while_waiting(ledger)      # (daemon.machines.ram_sharing: a step to take from a peer)
            if said is None or now - said > 60:
                ledger.emit(note, level="warning" if said else "info", **fields())
                said = now
            ledger.tick()
            time.sleep(POLL_S)
        return None

    def _follower_elected(self, ledger: Ledger, now: float) -> bool:
        """A follower's look while it waits (daemon.machines.leadership.step): it decides (elected since, or all
        along), or no one decides and it is its turn to campaign (won: it decides now)."""
        look = leadership.step(self.role, self.coord.view(), self.coord.me(), now, self.coord.rules,
                               _passed_over(ledger.state.lemons))
        self.role = look.role
        effect = look.effects[0]
        if isinstance(effect, (leadership.Lead, leadership.Resign)):    # a quarantined one resigns as it opens
            return True
        if self.coord.leader() is not None:
            self._leaderless_since = None
            return False
        self._leaderless(ledger, now)
        if isinstance(effect, leadership.Campaign) and self.campaign(now, ledger.state.lemons):
            self._leaderless_since = None
            self.role = leadership.Role.LEADER
            ledger.emit("elected", node=self.coord.node, addr=self.coord.addr,
                        detail=f"node {self.coord.node} decides for the run now")
            return True
        return False

    def _leaderless(self, ledger: Ledger, now: float) -> bool:
        """No decider stands: said once (status and event) until one does."""
        if self.coord.leader() is not None:
            self._leaderless_since = None
            return False
        if self._leaderless_since is None:
            self._leaderless_since = now
            since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            held = ledger.state.undecided or {}
            incident = f" (incident: {held.get('kind')}: {held.get('detail')})" if held else ""
            ledger.set_waiting(f"waiting for a decider since {since}{incident}")
            ledger.emit("waiting_for_decider", level="warning", node=self.coord.node, live=self.live(),
                        detail=f"no daemon decides for the run (its decider's lease expired) since {since}")
        return True

    def retrying(self, write: Callable[[], bool | None], ledger: Ledger, stopping) -> bool | None:
        """A write to etcd, retried while etcd is away (decisions wait for it to return), until
        run.coordinator_timeout_s (PeersUnavailableError). The write's answer (False: a lost
        compare-and-swap, or this daemon no longer decides; a plain put: True); None when a stop
        came first."""
        said = False
        while not stopping():
            try:
                result = write()
                return True if result is None else bool(result)
            except NotLeaderError as e:
                ledger.emit("deposed", level="warning", node=self.coord.node, detail=str(e))
                return False
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
        return leadership.is_cut_off(self.coord.view(), now, self.coord.rules)

    # The run's end -------------------------------------------------------------------------------
    def finish(self, code: int, status: str, reason: str) -> None:
        """The decider's daemon ends the run: every other daemon ends the same way."""
        if self.is_leader:
            try:
                self.coord.finish_run({"code": int(code), "status": status, "reason": reason, "run_id": self.run_id,
                                       "node": self.coord.node})
            except EtcdError:
                pass

    def ended_run(self) -> watch.Outcome | None:
        """How the decider ended the run since this daemon joined, as this node's outcome; None: it
        goes on."""
        kv = self.coord.run_end_kv()
        end = decode(kv.value) if kv is not None and kv.mod_revision > self.joined_revision else None
        if not isinstance(end, dict) or end.get("run_id") != self.run_id or end.get("node") == self.coord.node:
            return None
        detail = f"node {end.get('node')}'s daemon ended the run: {end.get('status')}"
        if end.get("status") in ("finished", "stopped") and end.get("code") == 0:
            return watch.Finished(None) if end["status"] == "finished" else watch.Stopped(None)
        return watch.Ended(int(end.get("code", 1)), end.get("status", "failed"), end.get("reason", "nodes"), detail)


def _alive(pid) -> bool:
    """A process of this machine (a pid reused since only makes the newcomer wait a lease TTL)."""
    import os

    try:
        number = int(pid)
        os.kill(number, 0)
    except (OSError, TypeError, ValueError):
        return False
    return True


def _passed_over(lemons: Mapping[str, Any]) -> frozenset[int]:
    """Machines that do not decide now: those the lemon list quarantines."""
    return frozenset(quarantine.excluded_nodes(lemons, time.time()))
