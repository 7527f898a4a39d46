"""The environment of MindSpore's dynamic cluster, as msrun sets it, for the scheduler and each rank;
or of a local group, which has no MindSpore cluster.

Owns: which variables a scheduler or worker process gets (MS_ROLE,
MS_SCHED_HOST, MS_SCHED_PORT, MS_WORKER_NUM, MS_LOCAL_WORKER_NUM, MS_NODE_ID),
when a generation is a local group and the names of its shared-memory files,
and a free-port helper. No processes are started here.

A local group: with `parallel.local_reduce` on one CPU machine, the ranks sum
their gradients through shared memory (engine/training/local_reduce.py) and need
nothing of MindSpore's cluster, whose formation was most of a cold start (a
fixed sleep inside MindSpore's CPU collectives among it; README, Performance). Such a
generation starts no scheduler; each rank gets its rank, the world and the
group's file prefix, new for every generation, which the daemon removes when
the generation ends. On several CPU machines the group sums through a TCP hub
(engine/training/hub_reduce.py) that the decider's machine starts where
MindSpore's scheduler would be, at the generation's scheduler address; the
ranks get its address and the group's name instead of a file prefix.
"""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Mapping

from contracts.config import Config
from contracts.protocol import ENV_GENERATION, ENV_GROUP_HUB, ENV_LOCAL_GROUP, ENV_LOCAL_RANK, ENV_LOCAL_WORLD

SHM_DIR = Path("/dev/shm")
_GROUP_FILES = "llm-pretrain-reduce-{uid}-{pid}-"     # then the port and generation; the engine adds suffixes

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


def is_local_group(cfg: Config) -> bool:
    """Whether the ranks form a local group (see the module's docstring) rather than a MindSpore
    cluster: on one machine through shared memory, on several through a hub."""
    return (cfg.parallel.local_reduce and cfg.train.device == "cpu" and cfg.parallel.world_size > 1
            and cfg.parallel.tp == 1 and cfg.parallel.pp == 1
            and not cfg.script.command)         # a user's script sums through MindSpore's own collectives


def has_hub(cfg: Config) -> bool:
    """A local group across machines: it sums through a hub the scheduler's machine starts."""
    return is_local_group(cfg) and cfg.run.nodes > 1


def sums_through_shared_memory(cfg: Config) -> bool:
    """A local group on one machine: its sum lives in `/dev/shm` files the daemon removes after it."""
    return is_local_group(cfg) and not has_hub(cfg)


def needs_scheduler(cfg: Config) -> bool:
    """Whether the scheduler's machine starts a process for the generation: MindSpore's scheduler, or a
    local group's hub across machines."""
    return not is_local_group(cfg) or has_hub(cfg)


def group_name(*, host: str, port: int, generation: int) -> str:
    """A group across machines: what its hub and ranks call it (a rank of another generation is refused)."""
    return f"g{generation}@{host}:{port}"


def hub_env(base: Mapping[str, str], *, host: str, port: int, world: int, generation: int) -> dict[str, str]:
    """The hub's environment (run as the scheduler: engine/rank/scheduler.py)."""
    env = {k: v for k, v in base.items() if not k.startswith("MS_")}
    env.update({ENV_GROUP_HUB: f"{host}:{port}", ENV_LOCAL_WORLD: str(world), ENV_GENERATION: str(generation),
                ENV_LOCAL_GROUP: group_name(host=host, port=port, generation=generation)})
    return env


def local_group_prefix(*, port: int, generation: int, pid: int | None = None) -> Path:
    """The path prefix of one generation's shared-memory files: this daemon's, this generation's
    (the port, fresh for each generation and each standby, tells a standby's from a cold start's)."""
    pid = os.getpid() if pid is None else pid
    return SHM_DIR / (_GROUP_FILES.format(uid=os.getuid(), pid=pid) + f"{port}-g{generation}")


def local_group_env(base: Mapping[str, str], *, rank: int, world: int, port: int, generation: int,
                    hub_host: str | None = None) -> dict[str, str]:
    """A local group's rank: `base` less any MindSpore cluster variables, plus the group's (with
    `hub_host`, across machines: the hub's address and the group's name)."""
    env = {k: v for k, v in base.items() if k not in ("MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT",
                                                        "MS_WORKER_NUM", "MS_LOCAL_WORKER_NUM", "MS_NODE_ID",
                                                        ENV_GROUP_HUB)}
    name = (str(local_group_prefix(port=port, generation=generation)) if hub_host is None
            else group_name(host=hub_host, port=port, generation=generation))
    env.update({ENV_LOCAL_GROUP: name, ENV_LOCAL_RANK: str(rank), ENV_LOCAL_WORLD: str(world),
                ENV_GENERATION: str(generation)})
    if hub_host is not None:
        env[ENV_GROUP_HUB] = f"{hub_host}:{port}"
    return env


def remove_group_files(prefix: Path) -> None:
    """What a group left in shared memory (rank 0 unlinks it after the first sum; a group that
    ended before then leaves it)."""
    for path in prefix.parent.glob(prefix.name + ".*"):
        path.unlink(missing_ok=True)


def remove_dead_daemons_group_files(directory: Path = SHM_DIR) -> list[Path]:
    """Group files of daemons (of this user) no longer running: a daemon killed before its
    generation's first sum leaves them."""
    pattern = re.compile(re.escape(_GROUP_FILES.format(uid=os.getuid(), pid="@")).replace("@", r"(\d+)"))
    removed = []
    for path in directory.glob(_GROUP_FILES.format(uid=os.getuid(), pid="*") + "*"):
        match = pattern.match(path.name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
