"""How a data-parallel rank sums its gradients, decided once where the rank starts and handed down.

Owns the choice between MindSpore's own collective (its cluster's AllReduce, or the compiler's under
semi-auto parallel), the shared-memory sum of ranks that share this machine (engine.training.local_reduce)
and the TCP hub of a group across machines (engine.training.hub_reduce), and the supervisor's local group
as a rank reads it from its environment. engine.rank.runtime decides it with the rank's setup (RankInfo);
engine.training.step builds the reducer it names. Pure: no MindSpore, no files.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Mapping

from contracts.config import Config
from contracts.protocol import ENV_GROUP_HUB, ENV_LOCAL_GROUP, ENV_LOCAL_RANK, ENV_LOCAL_WORLD

SHM_DIR = Path("/dev/shm")

COLLECTIVE, SHARED_MEMORY, HUB = "collective", "shared_memory", "hub"


@dataclasses.dataclass(frozen=True)
class LocalGroup:
    """Ranks the supervisor started without MindSpore's cluster (daemon/processes/mindspore_env.py): each knows its
    rank and the world from the environment, and they sum gradients through shared memory under
    `prefix` (engine/training/local_reduce.py) or, on several machines, through the TCP hub at `hub`
    (engine/training/hub_reduce.py; `prefix` is then the group's name)."""
    rank: int
    world: int
    prefix: str
    hub: str | None = None


def local_group(env: Mapping[str, str] = os.environ) -> LocalGroup | None:
    if not env.get(ENV_LOCAL_GROUP):
        return None
    return LocalGroup(rank=int(env[ENV_LOCAL_RANK]), world=int(env[ENV_LOCAL_WORLD]), prefix=env[ENV_LOCAL_GROUP],
                      hub=env.get(ENV_GROUP_HUB) or None)


@dataclasses.dataclass(frozen=True)
class GradientSum:
    via: str = COLLECTIVE       # COLLECTIVE | SHARED_MEMORY | HUB
    prefix: str = ""            # the shared-memory group's files, or the hub group's name
    hub: str | None = None      # the hub's host:port (HUB)
    # under msrun, MindSpore's cluster: the group's files are made between two of its barriers (an earlier
    # cluster may have used the same scheduler port), not fresh for each generation as the supervisor's are
    between_cluster_barriers: bool = False


def choose(cfg: Config, *, world: int, local_world: int, env: Mapping[str, str] = os.environ) -> GradientSum:
    """The supervisor's group across machines sums through its hub, its group on one machine through
    shared memory; data-parallel CPU ranks of MindSpore's cluster that all share this machine (msrun) do
    too with `parallel.local_reduce`; everything else is MindSpore's collective."""
    group = local_group(env)
    if group is not None and group.hub:
        return GradientSum(via=HUB, prefix=group.prefix, hub=group.hub)
    if group is not None:
        return GradientSum(via=SHARED_MEMORY, prefix=group.prefix)
    if (cfg.parallel.local_reduce and cfg.train.device == "cpu" and cfg.run.nodes == 1 and world > 1
            and local_world == world and env.get("MS_SCHED_PORT")):
        prefix = SHM_DIR / f"llm-pretrain-reduce-{os.getuid()}-{env.get('MS_SCHED_HOST', '')}-{env['MS_SCHED_PORT']}"
        return GradientSum(via=SHARED_MEMORY, prefix=str(prefix), between_cluster_barriers=True)
    return GradientSum()
