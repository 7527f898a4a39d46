"""How the daemons of a multi-node run act as one, through etcd (one run: keys under run.key_prefix).

Owns the run's keys and what each means:

    nodes/<n>         this node's daemon is alive: bound to its lease (TTL run.node_lease_ttl_s)
    generation        {number, members, port, resume_step, config_changes}: advanced by node 0 only, compare-and-swap
    end/<g>           why generation g ends: the first node to know writes it (create-only), every
                      node tears its ranks down when it appears
    decision/<g>      node 0's recovery decision for the incident that ended g: the others apply it
    requests/<id>     an operator request dropped on any node, for node 0 to act on for all
    marker            node 0's token in the shared run directory (the others check they see it)
    run               how node 0's daemon ended the run {code, status, marker}: the others follow

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
from daemon.etcd_client import Etcd, EtcdError, EtcdUnavailableError

LEADER = 0


class Coordinator:
    def __init__(self, cfg: Config, client: Etcd, *, clock: Callable[[], float] = time.monotonic):
        self.node, self.nodes = cfg.run.node_rank, cfg.run.nodes
        self.ttl_s = cfg.run.node_lease_ttl_s
        self.prefix = cfg.run.key_prefix
        self.client, self.clock = client, clock
        self.lease = 0
        self._mirror: dict[str, tuple[Any, int]] = {}     # key (after the prefix) → (value, mod_revision)
        self._revision = 0
        self._contact = clock()                             # the last time etcd answered
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._seen_requests: set[str] = set()

    @property
    def is_leader(self) -> bool:
        return self.node == LEADER

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
                self.client.revoke(self.lease)
        except EtcdError:
            pass                                    # the lease expires by itself

    def _register(self) -> None:
        self.lease = self.client.grant(self.ttl_s)
        self.client.put(self._key(f"nodes/{self.node}"), json.dumps(
            {"node": self.node, "host": socket.gethostname(), "pid": os.getpid()}), lease=self.lease)
        self._touch()

    def _keep_alive(self) -> None:
        while not self._stopping.wait(max(0.5, self.ttl_s / 3)):
            try:
                if self.client.keep_alive(self.lease) <= 0:      # expired while etcd was away: join again
                    self._register()
                else:
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
            self._mirror = {kv.key.decode()[len(self.prefix):]: (_decode(kv.value), kv.mod_revision) for kv in kvs}
            self._revision = revision
        self._touch()

    def _apply(self, batch) -> None:
        with self._lock:
            for event in batch:
                key = event.kv.key.decode()[len(self.prefix):]
                if event.type == "DELETE":
                    self._mirror.pop(key, None)
                else:
                    self._mirror[key] = (_decode(event.kv.value), event.kv.mod_revision)
                self._revision = max(self._revision, event.kv.mod_revision)
        self._touch()

    def _touch(self) -> None:
        with self._lock:
            self._contact = self.clock()

    def unreachable_s(self, now: float) -> float:
        with self._lock:
            return max(0.0, now - self._contact)

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _get(self, name: str) -> Any:
        with self._lock:
            entry = self._mirror.get(name)
        return None if entry is None else entry[0]

    # What the mirror says -----------------------------------------------------------------------
    def live_nodes(self) -> list[int]:
        with self._lock:
            return sorted(int(k.split("/", 1)[1]) for k in self._mirror if k.startswith("nodes/"))

    def generation(self) -> dict | None:
        return self._get("generation")

    def ended(self, number: int) -> dict | None:
        return self._get(f"end/{number}")

    def decision(self, number: int) -> dict | None:
        return self._get(f"decision/{number}")

    def new_requests(self) -> list[dict]:
        """Operator requests not taken yet (node 0 acts on them), oldest first."""
        with self._lock:
            fresh = [(rev, k, v) for k, (v, rev) in self._mirror.items()
                     if k.startswith("requests/") and k not in self._seen_requests]
        fresh.sort(key=lambda item: item[0])
        self._seen_requests.update(k for _, k, _ in fresh)
        return [v for _, _, v in fresh if isinstance(v, dict)]

    # Writes ---------------------------------------------------------------------------------------
    def publish_generation(self, number: int, *, members: list[int], port: int, resume_step: int,
                           config_changes: dict | None = None) -> bool:
        """Node 0 starts generation `number` unless the stored one moved on meanwhile (CAS)."""
        current = self.client.get(self._key("generation"))
        if current is not None and _decode(current.value).get("number", -1) >= number:
            return False
        value = {"number": number, "members": members, "port": port, "resume_step": resume_step,
                 "config_changes": config_changes or {}}
        return self.client.put_if(self._key("generation"), json.dumps(value),
                                  mod_revision=0 if current is None else current.mod_revision)

    def end_generation(self, number: int, cause: dict) -> dict:
        """Says why generation `number` ends, unless another node said it first; returns the cause
        that stands (everyone tears down for the same one)."""
        key = self._key(f"end/{number}")
        if not self.client.put_if(key, json.dumps({**cause, "node": self.node}), mod_revision=0):
            stored = self.client.get(key)
            if stored is not None:
                return _decode(stored.value)
        return {**cause, "node": self.node}

    def publish_decision(self, number: int, decision: dict) -> None:
        self.client.put(self._key(f"decision/{number}"), json.dumps(decision))

    def run_end(self) -> dict | None:
        return self._get("run")

    def finish_run(self, value: dict) -> None:
        self.client.put(self._key("run"), json.dumps(value))

    def send_request(self, name: str, body: dict) -> None:
        self.client.put(self._key(f"requests/{uuid.uuid4().hex}"),
                        json.dumps({"name": name, "body": body, "node": self.node}))

    def forget_before(self, number: int) -> None:
        """Node 0 drops the end and decision keys of generations before `number` (bounded growth)."""
        for name in list(self._snapshot()):
            kind, _, g = name.partition("/")
            if kind in ("end", "decision") and g.isdigit() and int(g) < number - 1:
                self.client.delete(self._key(name))

    def _snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {k: v for k, (v, _) in self._mirror.items()}


def _decode(value: bytes) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return None
