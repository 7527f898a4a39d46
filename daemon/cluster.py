"""The environment of MindSpore's dynamic cluster, as msrun sets it, for the scheduler and each rank.

Owns: which variables a scheduler or worker process gets (MS_ROLE,
MS_SCHED_HOST, MS_SCHED_PORT, MS_WORKER_NUM, MS_LOCAL_WORKER_NUM, MS_NODE_ID)
and a free-port helper. Stdlib only; no processes are started here.
"""
from __future__ import annotations

import socket
from typing import Mapping

from daemon.protocol import ENV_GENERATION

SCHEDULER = "MS_SCHED"
WORKER = "MS_WORKER"

# How long a rank waits before it retries reaching the scheduler: MindSpore's default is a random
# 3-5 s, and a rank that starts before its scheduler listens (they start together) waits that long
# on every restart. Whole seconds only; 1 s measured 2-4 s off cluster formation.
RETRY_INTERVAL_S = {"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1"}


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (each generation takes a fresh one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_env(base: Mapping[str, str], *, role: str, sched_host: str, sched_port: int, worker_num: int,
                local_worker_num: int, node_id: int | None = None, generation: int = 0) -> dict[str, str]:
    """The environment for one cluster process: `base` plus the dynamic-cluster variables.

    node_id is the global rank of a worker (MindSpore assigns ranks in node-id order);
    the scheduler takes none.
    """
    if role not in (SCHEDULER, WORKER):
        raise ValueError(f"role must be {SCHEDULER!r} or {WORKER!r}, not {role!r}")
    env = dict(base)
    env.update({
        "MS_ROLE": role,
        "MS_SCHED_HOST": sched_host,
        "MS_SCHED_PORT": str(sched_port),
        "MS_WORKER_NUM": str(worker_num),
        "MS_LOCAL_WORKER_NUM": str(local_worker_num),
        ENV_GENERATION: str(generation),
    })
    for name, seconds in RETRY_INTERVAL_S.items():     # an operator's own setting wins
        env.setdefault(name, seconds)
    env.pop("MS_NODE_ID", None)
    if role == WORKER and node_id is not None:
        env["MS_NODE_ID"] = str(node_id)
    return env
