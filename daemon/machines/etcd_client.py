"""A small etcd v3 client over etcd's own JSON gateway (HTTP, `/v3/...`), stdlib only.

Owns talking to etcd: keys and values (bytes, base64 on the wire), revisions, compare-and-swap
transactions, leases (grant, keep alive, revoke) and watches (a streamed HTTP response, one JSON
object per line). Every call tries the endpoints in turn and raises `EtcdUnavailableError` when
none answers in time; an answer etcd refuses is `EtcdError`.

Why the gateway and not a gRPC package: the maintained Python gRPC clients pull in grpcio and a
protobuf major version of their own (the `etcd3` package has been unmaintained since 2020 and
breaks with protobuf 4); the gateway is part of etcd itself (3.4 and later), needs nothing
installed on our side and speaks plain JSON, the same API `etcdctl` uses through gRPC.

Imports only contracts.config (the `run.coordinator` URL's parser).
"""
from __future__ import annotations

import base64
import dataclasses
import http.client
import json
import socket
import threading
from typing import Any, Iterator, Sequence

DEFAULT_TIMEOUT_S = 2.0


class EtcdError(RuntimeError):
    """etcd answered, and refused the request."""


class EtcdUnavailableError(EtcdError):
    """No endpoint answered in time."""


@dataclasses.dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int = 0

    def json(self) -> Any:
        return json.loads(self.value)


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    type: str               # "PUT" or "DELETE"
    kv: KeyValue


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _kv(raw: dict) -> KeyValue:
    return KeyValue(key=base64.b64decode(raw.get("key", "")), value=base64.b64decode(raw.get("value", "")),
                    mod_revision=int(raw.get("mod_revision", 0)), create_revision=int(raw.get("create_revision", 0)),
                    lease=int(raw.get("lease", 0)))


def prefix_end(prefix: bytes) -> bytes:
    """The `range_end` that makes a range cover every key starting with `prefix`."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class Etcd:
    """One client; safe to share between threads (each call opens its own connection)."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], *, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self._preferred = 0          # the endpoint that answered last
        self._lock = threading.Lock()

    @classmethod
    def for_run(cls, run, **kw) -> "Etcd":
        """The run's etcd (a contracts.config.RunConfig): run.coordinator's, or its embedded members'."""
        from contracts.config import run_endpoints

        return cls(run_endpoints(run), **kw)

    @classmethod
    def from_url(cls, url: str, **kw) -> "Etcd":
        """`etcd://HOST:PORT[,HOST:PORT…]`."""
        from contracts.config import coordinator_endpoints

        return cls(coordinator_endpoints(url), **kw)

    # Transport ---------------------------------------------------------------------------------
    def _connect(self, timeout_s: float) -> tuple[http.client.HTTPConnection, int]:
        errors = []
        n = len(self.endpoints)
        for i in range(n):
            index = (self._preferred + i) % n
            host, port = self.endpoints[index]
            conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
            try:
                conn.connect()
                return conn, index
            except OSError as e:
                conn.close()
                errors.append(f"{host}:{port}: {e.strerror or e}")
        raise EtcdUnavailableError("etcd unreachable (" + "; ".join(errors) + ")")

    def _post(self, path: str, body: dict, *, timeout_s: float | None = None) -> dict:
        conn, index = self._connect(timeout_s or self.timeout_s)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            with self._lock:          # a member that takes the connection but not the request (one cut off
                self._preferred = (index + 1) % len(self.endpoints)   # from its quorum): the next call asks another
            raise EtcdUnavailableError(f"etcd at {self.endpoints[index][0]}:{self.endpoints[index][1]}: {e}") from e
        finally:
            conn.close()
        with self._lock:
            self._preferred = index
        try:
            out = json.loads(data) if data else {}
        except ValueError as e:
            raise EtcdError(f"etcd {path}: not JSON: {data[:200]!r}") from e
        if resp.status != 200 or "error" in out:
            message = f"etcd {path}: {out.get('message') or out.get('error') or resp.status}"
            if resp.status >= 500 or any(w in message for w in ("no leader", "timed out", "leader changed")):
                with self._lock:      # this member cannot serve now (no quorum, an election): ask another
                    self._preferred = (index + 1) % len(self.endpoints)
                raise EtcdUnavailableError(message)
            raise EtcdError(message)
        return out.get("result", out)

    # Keys --------------------------------------------------------------------------------------
    def get(self, key: bytes | str) -> KeyValue | None:
        kvs = self._post("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: bytes | str) -> tuple[list[KeyValue], int]:
        """Every key under `prefix` (sorted by key) and the store's revision they were read at."""
        prefix = prefix.encode() if isinstance(prefix, str) else prefix
        out = self._post("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        return [_kv(kv) for kv in out.get("kvs", [])], int(out["header"]["revision"])

    def put(self, key: bytes | str, value: bytes | str, *, lease: int = 0) -> int:
        """Returns the revision of the write."""
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self._post("/v3/kv/put", body)["header"]["revision"])

    def delete(self, key: bytes | str) -> int:
        return int(self._post("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted", 0))

    def delete_prefix(self, prefix: bytes | str) -> int:
        prefix = prefix.encode() if isinstance(prefix, str) else prefix
        return int(self._post("/v3/kv/deleterange", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
                   .get("deleted", 0))

    def put_if(self, key: bytes | str, value: bytes | str, *, mod_revision: int, lease: int = 0) -> bool:
        """Compare-and-swap: writes only if the key's last write is `mod_revision` (0: the key does not
        exist). True if written."""
        compare = ({"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
                   if mod_revision == 0 else
                   {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)})
        put = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        out = self._post("/v3/kv/txn", {"compare": [compare], "success": [{"request_put": put}]})
        return bool(out.get("succeeded"))

    def txn(self, compare: Sequence[dict], success: Sequence[dict], failure: Sequence[dict] = ()) -> tuple[bool, int]:
        """One transaction (the `compare_*` and `op_*` helpers build its parts): whether the comparisons
        held, and the store's revision after it (the revision of its writes, when it wrote)."""
        out = self._post("/v3/kv/txn", {"compare": list(compare), "success": list(success), "failure": list(failure)})
        return bool(out.get("succeeded")), int(out.get("header", {}).get("revision", 0))

    # Leases ------------------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        return int(self._post("/v3/lease/grant", {"TTL": str(int(ttl_s))})["ID"])

    def keep_alive(self, lease: int) -> int:
        """Renews `lease` once; its remaining TTL (0: the lease has expired and is gone)."""
        return int(self._post("/v3/lease/keepalive", {"ID": str(lease)}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        try:
            self._post("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdUnavailableError:
            raise
        except EtcdError:         # already expired: nothing to revoke
            pass

    # Watches -----------------------------------------------------------------------------------
    def watch_prefix(self, prefix: bytes | str, *, start_revision: int, idle_timeout_s: float) -> Iterator[
            list[WatchEvent]]:
        """Batches of changes under `prefix` from `start_revision` on, as etcd streams them. Ends
        (returns) when nothing came for `idle_timeout_s`, so the caller can check its own state and
        watch again from the next revision; raises EtcdUnavailableError when the stream breaks."""
        prefix = prefix.encode() if isinstance(prefix, str) else prefix
        conn, index = self._connect(self.timeout_s)
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": str(start_revision)}}
        try:
            # hasleader: a member cut off from its cluster's leader ends the stream rather than go silent
            conn.request("POST", "/v3/watch", json.dumps(body), {"Content-Type": "application/json",
                                                                 "Grpc-Metadata-hasleader": "true"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise EtcdError(f"etcd /v3/watch: HTTP {resp.status}")
            conn.sock.settimeout(idle_timeout_s)
            while True:
                try:
                    line = resp.readline()
                except socket.timeout:
                    return
                if not line:
                    raise EtcdUnavailableError("etcd ended the watch stream")
                msg = json.loads(line)
                if "error" in msg:
                    raise EtcdError(f"etcd /v3/watch: {msg['error'].get('message', msg['error'])}")
                result = msg.get("result", {})
                if result.get("compact_revision") not in (None, "0"):
                    raise EtcdError(f"etcd /v3/watch: revision {start_revision} was compacted")
                events = [WatchEvent(type=e.get("type", "PUT"), kv=_kv(e["kv"])) for e in result.get("events", [])]
                if events:
                    yield events
        except (OSError, http.client.HTTPException, ValueError) as e:
            with self._lock:
                self._preferred = (index + 1) % len(self.endpoints)
            raise EtcdUnavailableError(f"etcd watch at {self.endpoints[index][0]}: {e}") from e
        finally:
            conn.close()


# Transaction parts ---------------------------------------------------------------------------------
def compare_created(key: bytes | str, revision: int) -> dict:
    """The key was created at `revision` (0: it does not exist): etcd's election fencing compare."""
    return {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": str(revision)}


def compare_exists(key: bytes | str) -> dict:
    return {"key": _b64(key), "target": "CREATE", "result": "GREATER", "create_revision": "0"}


def compare_none_under(prefix: bytes | str) -> dict:
    """No key starts with `prefix` (a range compare: every key in it created at revision 0)."""
    prefix = prefix.encode() if isinstance(prefix, str) else prefix
    return {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)), "target": "CREATE", "result": "EQUAL",
            "create_revision": "0"}


def compare_modified(key: bytes | str, revision: int) -> dict:
    """The key's last write was at `revision` (0: it does not exist)."""
    if revision == 0:
        return compare_created(key, 0)
    return {"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)}


def op_put(key: bytes | str, value: bytes | str, *, lease: int = 0) -> dict:
    put = {"key": _b64(key), "value": _b64(value)}
    if lease:
        put["lease"] = str(lease)
    return {"request_put": put}


def op_delete(key: bytes | str) -> dict:
    return {"request_delete_range": {"key": _b64(key)}}


def op_delete_prefix(prefix: bytes | str) -> dict:
    prefix = prefix.encode() if isinstance(prefix, str) else prefix
    return {"request_delete_range": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}}
