"""The coordinator: this daemon's lease, its mirror of the run's keys (daemon.machines.etcd_keys) and its
fenced writes, through etcd: the thin driver of the leadership core (daemon.machines.leadership).

Who decides: any daemon of the run. When there is no leader key, the lowest-ranked live node
campaigns at once and the others once every lower-ranked node has been absent a while (two lease
TTLs for one never seen, as while a run starts; PREFER_LOWER_S from its key's deletion for one this
daemon's mirror ever held, whichever joined first), so a fresh run
is decided by node 0 and a lost decider is replaced a moment after its lease expires. A decider is deposed when it learns it is: its
lease expired, another leader key is seen, a fenced write is refused, or its lease has gone
unrenewed past the TTL (etcd may have expired it already).

A background thread keeps the lease alive and a mirror of every key under the prefix, fed by an
etcd watch, so the supervisor's loop reads only memory and never waits on the network; writes
are synchronous and raise EtcdUnavailableError. `unreachable_s(now)` says how long etcd has been
silent: running ranks go on meanwhile, decisions wait. Never imports MindSpore.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

from contracts.config import Config
from daemon.machines import leadership
from daemon.machines.etcd_client import (
    Etcd,
    EtcdError,
    EtcdUnavailableError,
    KeyValue,
    compare_created,
    compare_exists,
    compare_modified,
    op_delete,
    op_put,
)
from daemon.machines.etcd_keys import NotLeaderError, decode, node_of

# how long a node lets a lower-ranked one it saw leave come back and campaign first: a lease that expired is
# a machine gone, and every moment here is a moment of the whole run's recovery (1 s was a sixth of a lost
# decider's, lease 3 s); what it is for is a key deleted and put again as a daemon restarts
PREFER_LOWER_S = 0.25


def rules_of(cfg: Config) -> leadership.Rules:
    run = cfg.run
    return leadership.Rules(nodes=run.nodes, ttl_s=run.node_lease_ttl_s, quorum=run.quorum,
                            coordinator_timeout_s=run.coordinator_timeout_s, join_timeout_s=run.node_join_timeout_s,
                            rejoin_timeout_s=run.node_rejoin_timeout_s, prefer_lower_s=PREFER_LOWER_S)


class Coordinator:
    def __init__(self, cfg: Config, client: Etcd, *, clock: Callable[[], float] = time.monotonic):
        self.node, self.nodes = cfg.run.node_rank, cfg.run.nodes
        self.ttl_s = cfg.run.node_lease_ttl_s
        self.rules = rules_of(cfg)
        self.prefix = cfg.run.key_prefix
        self.client, self.clock = client, clock
        self.daemon = uuid.uuid4().hex            # this daemon, among every daemon that ever ran the run
        self.addr = cfg.run.node_addr or local_addr(client)
        self.lease = 0
        self.token = 0                            # the leader key's create_revision while this daemon decides
        self._mirror: dict[str, KeyValue] = {}    # key (after the prefix) → its last write
        self._revision = 0
        self._contact = clock()                   # the last time etcd answered
        self._renewed = clock()                   # the last time this daemon's lease was renewed (sent at)
        self._absent_since: dict[int, float] = {}  # nodes not live, since when (this daemon's view: its mirror)
        self._seen: set[int] = set()              # nodes this daemon has seen live (in its mirror)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    # Life ---------------------------------------------------------------------------------------
    def join(self) -> None:
        """Registers this node (its lease) and starts the keep-alive and mirror threads; raises
        EtcdUnavailableError if etcd cannot be reached at all."""
        self._register()
        self._refresh()
        for target in (self._keep_alive, self._watch):
            t = threading.Thread(target=target, name=f"coordinator-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)

    def leave(self) -> None:
        self._stopping.set()
        try:
            if self.lease:
                self.client.revoke(self.lease)      # the leader key goes with it: the others elect at once
        except EtcdError:
            pass                                    # the lease expires by itself

    def record(self) -> dict:
        return {"node": self.node, "addr": self.addr, "host": socket.gethostname(), "pid": os.getpid(),
                "daemon": self.daemon}

    def _register(self) -> None:
        sent = self.clock()
        lease = self.client.grant(self.ttl_s)
        self.client.put(self._key(f"nodes/{self.node}"), json.dumps(self.record()), lease=lease)
        with self._lock:
            self.lease, self.token = lease, 0      # a new lease: whatever was bound to the old one is gone
            self._renewed = sent
        self._touch()

    def _keep_alive(self) -> None:
        while not self._stopping.wait(max(0.3, self.ttl_s / 4)):
            sent = self.clock()
            try:
                if self.client.keep_alive(self.lease) <= 0:      # expired while etcd was away: join again
                    self._register()
                else:
                    with self._lock:
                        self._renewed = sent
                    self._touch()
            except EtcdError:
                continue

    def _watch(self) -> None:
        while not self._stopping.is_set():
            try:
                for batch in self.client.watch_prefix(self.prefix, start_revision=self._revision + 1,
                                                      idle_timeout_s=1.0):
                    self._apply(batch)
                    if self._stopping.is_set():
                        return
                self._touch()          # idle: etcd still holds the stream open
            except EtcdUnavailableError:
                self._stopping.wait(0.5)
                self._refresh_quietly()
            except EtcdError:          # compacted past our revision: read everything afresh
                self._refresh_quietly()

    def _refresh_quietly(self) -> None:
        try:
            self._refresh()
        except EtcdError:
            pass

    def _refresh(self) -> None:
        kvs, revision = self.client.get_prefix(self.prefix)
        with self._lock:
            self._mirror = {kv.key.decode()[len(self.prefix):]: kv for kv in kvs}
            self._revision = revision
            live = {n for n in map(node_of, self._mirror) if n is not None}
            for n in live:
                self._live_seen(n)
            for n in self._seen - live:
                self._absent_since.setdefault(n, self.clock())
            for n in set(range(self.node)) - live:     # a lower-ranked node never seen: absent from the first look
                self._absent_since.setdefault(n, self.clock())
        self._touch()

    def _apply(self, batch) -> None:
        with self._lock:
            for event in batch:
                key = event.kv.key.decode()[len(self.prefix):]
                node = node_of(key)
                if event.type == "DELETE":
                    self._mirror.pop(key, None)
                    if node is not None:                # seen leaving: from now on, absent
                        self._absent_since[node] = self.clock()
                else:
                    self._mirror[key] = event.kv
                    if node is not None:
                        self._live_seen(node)
                self._revision = max(self._revision, event.kv.mod_revision)
        self._touch()

    def _live_seen(self, node: int) -> None:
        """Node `node` is live in the mirror (under the lock)."""
        self._seen.add(node)
        self._absent_since.pop(node, None)

    def _touch(self) -> None:
        with self._lock:
            self._contact = self.clock()

    def unreachable_s(self, now: float) -> float:
        with self._lock:
            return max(0.0, now - self._contact)

    def unrenewed_s(self, now: float) -> float:
        """How long since this daemon's lease was last renewed (etcd expires it after the TTL)."""
        with self._lock:
            return max(0.0, now - self._renewed)

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _get(self, name: str) -> Any:
        with self._lock:
            entry = self._mirror.get(name)
        return None if entry is None else decode(entry.value)

    # What the mirror says -----------------------------------------------------------------------
    def live_nodes(self) -> list[int]:
        with self._lock:
            return sorted(int(k.split("/", 1)[1]) for k in self._mirror
                          if k.startswith("nodes/") and k.split("/", 1)[1].isdigit())

    def leader(self) -> dict | None:
        """The decider's record ({node, addr, daemon}), None while there is none."""
        value = self._get("leader")
        return value if isinstance(value, dict) else None

    def generation(self) -> dict | None:
        return self._get("generation")

    def ended(self, number: int) -> dict | None:
        return self._get(f"end/{number}")

    def decision(self, number: int) -> dict | None:
        return self._get(f"decision/{number}")

    def run_end_kv(self) -> KeyValue | None:
        """How the run ended, as last written (its mod_revision tells an old end from a new one)."""
        with self._lock:
            return self._mirror.get("run")

    def held(self) -> dict[int, Any]:
        """What each machine said its RAM tier holds (daemon.machines.memory_agreement), by node."""
        with self._lock:
            named = {k.split("/", 1)[1]: kv for k, kv in self._mirror.items() if k.startswith("held/")}
        return {int(n): decode(kv.value) for n, kv in named.items() if n.isdigit()}

    def pending_requests(self) -> list[tuple[str, dict]]:
        """Operator requests not taken yet (the decider takes them), oldest first: (key, request)."""
        with self._lock:
            fresh = sorted(((kv.mod_revision, k, decode(kv.value)) for k, kv in self._mirror.items()
                            if k.startswith("requests/")), key=lambda item: item[0])
        return [(k, v) for _, k, v in fresh if isinstance(v, dict)]

    # Deciding -----------------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return self.holds_leadership(self.clock())

    def view(self) -> leadership.View:
        """The mirror as the leadership core reads it."""
        with self._lock:
            return self._view()

    def _view(self) -> leadership.View:
        """(under the lock)"""
        live = frozenset(n for n in map(node_of, self._mirror) if n is not None)
        kv = self._mirror.get("leader")
        value = decode(kv.value) if kv is not None else None
        value = value if isinstance(value, dict) else {}
        key = None if kv is None else leadership.LeaderKey(node=value.get("node", -1), daemon=value.get("daemon", ""),
                                                           create_revision=kv.create_revision, lease=kv.lease)
        return leadership.View(live=live, leader=key, seen=frozenset(self._seen), absent_since=dict(self._absent_since),
                               contact_at=self._contact, renewed_at=self._renewed)

    def me(self) -> leadership.Me:
        return leadership.Me(node=self.node, daemon=self.daemon, lease=self.lease, token=self.token)

    def holds_leadership(self, now: float) -> bool:
        """This daemon decides: it won the election with its current lease, renewed within the TTL,
        and no other leader key is seen (daemon.machines.leadership.holds)."""
        with self._lock:
            decides, self.token = leadership.holds(self._view(), self.me(), now, self.rules)
        return decides

    def campaign(self, now: float, passed_over: frozenset[int] = frozenset()) -> bool:
        """Where no leader key stands and it is this node's turn (leadership.turn_to_campaign: lower-ranked
        live nodes first), tries to become the decider (a create-if-absent bound to its lease). True
        if this daemon decides now. `passed_over`: nodes that do not decide (quarantined machines): they
        neither campaign nor are waited for."""
        if self.holds_leadership(now):
            return True
        with self._lock:
            turn = leadership.turn_to_campaign(self._view(), self.me(), now, self.rules, passed_over)
        if not turn:
            return False
        value = {"node": self.node, "addr": self.addr, "daemon": self.daemon}
        won, revision = self.client.txn([compare_created(self._key("leader"), 0)],
                                        [op_put(self._key("leader"), json.dumps(value), lease=self.lease)])
        if won:
            with self._lock:
                self.token = revision
                self._mirror["leader"] = KeyValue(self._key("leader").encode(), json.dumps(value).encode(),
                                                  revision, revision, self.lease)
        return won

    def resign(self) -> bool:
        """This daemon stops deciding (its machine is quarantined): its leader key deleted, fenced by its
        token; the others elect at once. False when it did not decide."""
        try:
            done = self._fenced([op_delete(self._key("leader"))])
        except NotLeaderError:
            return False
        with self._lock:
            self.token = 0
            self._mirror.pop("leader", None)
        return done

    def _fenced(self, ops: list[dict], *compares: dict) -> bool:
        """Writes `ops` only while this daemon's leader key stands (the fencing token) and `compares`
        hold. Raises NotLeaderError when the token does not; False when only `compares` failed."""
        token = self.token
        if not token:
            raise NotLeaderError("this daemon does not decide for the run")
        fence = compare_created(self._key("leader"), token)
        if self.client.txn([fence, *compares], ops)[0]:
            return True
        if compares and self.client.txn([fence], [])[0]:
            return False
        with self._lock:
            self.token = 0
        raise NotLeaderError("another daemon decides for the run now (this one's leader key is gone)")

    def confirm_leadership(self) -> None:
        """Before a write outside etcd that only the decider may make (the ranks' commands, retiring
        checkpoints): raises NotLeaderError if this daemon's leader key no longer stands."""
        self._fenced([])

    # Writes ---------------------------------------------------------------------------------------
    def publish_generation(self, number: int, *, members: list[int], addr: str, port: int, resume_step: int,
                           config_changes: dict | None = None) -> bool:
        """The decider starts generation `number` unless the stored one moved on meanwhile (a CAS,
        fenced)."""
        current = self.client.get(self._key("generation"))
        stored = decode(current.value) if current is not None else None
        if isinstance(stored, dict) and stored.get("number") == number and stored.get("daemon") == self.daemon:
            return True                 # this daemon's own write, whose answer was lost: written
        if isinstance(stored, dict) and stored.get("number", -1) >= number:
            return False
        value = {"number": number, "members": members, "addr": addr, "port": port, "resume_step": resume_step,
                 "config_changes": config_changes or {}, "leader": self.node, "daemon": self.daemon}
        return self._fenced([op_put(self._key("generation"), json.dumps(value))],
                            compare_modified(self._key("generation"), 0 if current is None else current.mod_revision))

    def end_generation(self, number: int, cause: dict) -> dict:
        """Says why generation `number` ends, unless another node said it first; returns the cause
        that stands (everyone tears down for the same one)."""
        key = self._key(f"end/{number}")
        if not self.client.put_if(key, json.dumps({**cause, "node": self.node}), mod_revision=0):
            stored = self.client.get(key)
            if stored is not None:
                return decode(stored.value)
        return {**cause, "node": self.node}

    def publish_decision(self, number: int, decision: dict) -> None:
        """The decider's decision for generation `number`, fenced; in this daemon's mirror at once (as its own
        leader key after a campaign): its next `open` must not find the generation undecided and decide it
        again before the watch has brought the key back (seen: twice, 4 ms apart, on 8 busy machines)."""
        value = json.dumps(decision)
        self._fenced([op_put(self._key(f"decision/{number}"), value)])
        self._mirror_own(f"decision/{number}", value)

    def publish_held(self, value: dict) -> None:
        """What this machine's RAM tier holds (memory_agreement.record), bound to its lease: a lost machine's
        record goes with it. In the mirror at once."""
        encoded = json.dumps(value)
        self.client.put(self._key(f"held/{self.node}"), encoded, lease=self.lease)
        self._mirror_own(f"held/{self.node}", encoded, lease=self.lease)

    def _mirror_own(self, name: str, value: str, lease: int = 0) -> None:
        """This daemon's own write, in its mirror before the watch brings it back (unless it has already)."""
        with self._lock:
            known = self._mirror.get(name)
            if known is None or known.value != value.encode():
                self._mirror[name] = KeyValue(self._key(name).encode(), value.encode(), self._revision, self._revision,
                                              lease)

    def ask_take(self, node: int, request: dict) -> None:
        """The decider asks node `node` to take a RAM step from a peer (daemon.machines.membership.serve_take)."""
        self.client.put(self._key(f"take/{node}"), json.dumps(request))

    def asked_to_take(self) -> dict | None:
        """What the decider last asked this node to take (ask_take), if anything."""
        value = self._get(f"take/{self.node}")
        return value if isinstance(value, dict) else None

    def finish_run(self, value: dict) -> None:
        self._fenced([op_put(self._key("run"), json.dumps(value))])

    def send_request(self, name: str, body: dict) -> None:
        self.client.put(self._key(f"requests/{uuid.uuid4().hex}"),
                        json.dumps({"name": name, "body": body, "node": self.node}))

    def take_request(self, key: str) -> bool:
        """The decider takes a request (deletes it, fenced): True if it was still there to take."""
        return self._fenced([op_delete(self._key(key))], compare_exists(self._key(key)))

    def forget_before(self, number: int) -> None:
        """The decider drops the end and decision keys of generations before `number` - 1 (bounded growth)."""
        with self._lock:
            names = list(self._mirror)
        stale = []
        for name in names:
            kind, _, g = name.partition("/")
            if kind in ("end", "decision") and g.isdigit() and int(g) < number - 1:
                stale.append(op_delete(self._key(name)))
        if stale:
            self._fenced(stale)


def local_addr(client: Etcd) -> str:
    """This machine's address on the interface that reaches etcd (a UDP socket connected, no packet
    sent), so that the decider's MindSpore scheduler is published where the others reach it."""
    host, port = client.endpoints[0]
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
