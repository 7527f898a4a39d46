"""Summing data-parallel gradients over TCP when CPU ranks span several machines: each rank sends its
flat buffer to the group's hub, which sums the buffers in rank order and sends the sum back.

MindSpore's CPU cluster costs a multi-node run seconds at every generation: its formation (a fixed
sleep inside its CPU collectives among it) and, for the first step, its AllReduce. This group forms
by connecting: a restarted rank, or a smaller generation after a lost machine, is summing within a
TCP round trip of its start. The hub is a process of its own on the decider's machine, started where
MindSpore's scheduler would be (`python -m engine.rank.scheduler` with ENV_GROUP_HUB: no MindSpore
import), so no rank is special and a rank that dies takes nobody's role with it. The sum runs in
rank order, the same float sum as the shared-memory group's (engine/training/local_reduce.py), so
every rank receives the same bits. A star, not a ring: the hub moves 2 x world buffers a step, fine
for the tens of CPU machines this path is for (Ascend sums with HCCL through MindSpore's cluster).

A peer that goes away (its process, its machine or the link) leaves the others blocked, as in a
collective: the supervisors' crash, lost-node and hang handling end the generation. A stranger
(another group's token, or another buffer size) is refused in one line.
"""
from __future__ import annotations

import socket
import struct
import sys
import time

import numpy as np

MAGIC = b"LPH1"
_HELLO = struct.Struct("!4sIIQH")          # magic, rank, world, size, token length; then the token
_REPLY = struct.Struct("!4sH")             # magic, error length; then the error (empty: accepted)
CONNECT_RETRY_S = 0.02


class GroupRefused(RuntimeError):
    """The hub would not take this rank (another group, world or buffer size)."""


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a group hub's address is host:port, not {text!r}")
    return host, int(port)


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fills `view`; False when the peer closed first."""
    while len(view):
        got = sock.recv_into(view)
        if not got:
            return False
        view = view[got:]
    return True


def _wait_forever() -> None:
    """A peer is gone: block like a collective whose peer vanished; the supervisor ends this process."""
    while True:
        time.sleep(3600)


class HubAllReduce:
    """One rank's side: the sum of a float32 vector of `size` over `world` ranks, through the hub at
    `hub` (host:port) of the group named `token`."""

    def __init__(self, *, rank: int, world: int, size: int, hub: str, token: str, connect_timeout_s: float = 600.0):
        if world < 2:
            raise ValueError(f"a hub all-reduce needs at least 2 ranks, not {world}")
        self.rank, self.world, self.size = rank, world, size
        self.result = np.empty(size, np.float32)
        self.sock = _connect(parse_address(hub), connect_timeout_s)
        tok = token.encode()
        self.sock.sendall(_HELLO.pack(MAGIC, rank, world, size, len(tok)) + tok)
        header = bytearray(_REPLY.size)
        if not _recv_exactly(self.sock, memoryview(header)):
            _wait_forever()
        _, n = _REPLY.unpack(header)
        if n:
            error = bytearray(n)
            _recv_exactly(self.sock, memoryview(error))
            raise GroupRefused(f"the gradient hub at {hub} refused rank {rank}: {error.decode()}")

    def all_reduce(self, local: np.ndarray) -> np.ndarray:
        """The sum of every rank's `local` (float32, `size`), as a buffer valid until the next call."""
        data = np.ascontiguousarray(local.reshape(-1), dtype=np.float32)
        if data.size != self.size:
            raise ValueError(f"expected {self.size} values, got {data.size}")
        try:
            self.sock.sendall(memoryview(data).cast("B"))
            if _recv_exactly(self.sock, memoryview(self.result).cast("B")):
                return self.result
        except (ConnectionError, OSError):
            pass
        _wait_forever()
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.sock.close()


def _connect(address: tuple[str, int], timeout_s: float) -> socket.socket:
    """Connects, retrying while the hub is not listening yet (it starts beside the ranks, elsewhere)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.connect(address)
            return sock
        except OSError as e:
            sock.close()
            if time.monotonic() > deadline:
                raise ConnectionError(f"no gradient hub listens at {address[0]}:{address[1]} after "
                                      f"{timeout_s:.0f} s: {e.strerror or e}") from None
            time.sleep(CONNECT_RETRY_S)


def serve(address: tuple[str, int], *, world: int, token: str, log=sys.stderr) -> None:
    """The hub: takes the `world` ranks of group `token`, then sums their buffers step after step until
    one goes away (then returns: its peers are left blocked, as in a collective)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(world + 8)
    ranks: dict[int, socket.socket] = {}
    size = None
    while len(ranks) < world:
        conn, peer = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        header = bytearray(_HELLO.size)
        if not _recv_exactly(conn, memoryview(header)):
            conn.close()
            continue
        magic, rank, their_world, their_size, n = _HELLO.unpack(header)
        tok = bytearray(n)
        _recv_exactly(conn, memoryview(tok))
        error = _refusal(magic, rank, their_world, their_size, tok.decode(errors="replace"), world=world,
                         token=token, size=size, taken=ranks)
        if error:
            print(f"llm-pretrain hub: refused {peer[0]}: {error}", file=log, flush=True)
            conn.sendall(_REPLY.pack(MAGIC, len(error.encode())) + error.encode())
            conn.close()
            continue
        size = their_size
        ranks[rank] = conn
    listener.close()
    for conn in ranks.values():
        conn.sendall(_REPLY.pack(MAGIC, 0))
    print(f"llm-pretrain hub: {world} ranks joined, {size} values a sum", file=log, flush=True)
    _sum_until_one_leaves([ranks[r] for r in range(world)], size)
    for conn in ranks.values():
        conn.close()


def _refusal(magic: bytes, rank: int, their_world: int, their_size: int, their_token: str, *, world: int,
             token: str, size: int | None, taken: dict) -> str:
    if magic != MAGIC:
        return "not a rank of this project's gradient group"
    if their_token != token:
        return f"another group's rank (group {their_token!r}; this hub's is {token!r})"
    if their_world != world:
        return f"a rank of a world of {their_world}; this group has {world} ranks"
    if not 0 <= rank < world or rank in taken:
        return f"rank {rank} is not a free rank of 0..{world - 1}"
    if size is not None and their_size != size:
        return f"a buffer of {their_size} values where the others sum {size}"
    return ""


def _sum_until_one_leaves(conns: list[socket.socket], size: int) -> None:
    slots = np.empty((len(conns), size), np.float32)
    total = np.empty(size, np.float32)
    out = memoryview(total).cast("B")
    try:
        while True:
            for r, conn in enumerate(conns):
                if not _recv_exactly(conn, memoryview(slots[r]).cast("B")):
                    return
            np.add(slots[0], slots[1], out=total)           # rank order: the shared-memory group's sum
            for r in range(2, len(conns)):
                np.add(total, slots[r], out=total)
            for conn in conns:
                conn.sendall(out)
    except (ConnectionError, OSError):
        return
