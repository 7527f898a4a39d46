"""Bringing up MindSpore in a worker: execution mode, device, threads, and the dynamic cluster.

MindSpore is imported inside `setup` only, so the CLI can run the checks here first.

Owns: the translation of the config and of msrun's environment variables
(MS_ROLE, MS_WORKER_NUM, MS_NODE_ID, MS_SCHED_HOST, MS_SCHED_PORT, …) into
MindSpore context calls, and the check that the cluster MindSpore formed is
the one the config describes. A local group (the supervisor's data-parallel
ranks on one CPU machine, daemon/processes/mindspore_env.py) forms no MindSpore cluster: its
ranks sum through shared memory and take rank and world from the environment.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Mapping

from contracts.config import Config
from contracts.errors import ConfigError
from contracts.protocol import ENV_LOCAL_WORLD
from engine.layout import parallel
from engine.training.gradient_sum import GradientSum, choose, local_group


@dataclasses.dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_world_size: int   # ranks sharing this machine's cores
    parallelism: parallel.Parallelism   # the generation's layout, decided here once and handed down
    gradient_sum: GradientSum = GradientSum()   # how a data-parallel step sums its gradients, likewise


def is_cluster_member(env: Mapping[str, str] = os.environ) -> bool:
    """True when started as one of several ranks: of MindSpore's dynamic cluster (by our supervisor or
    msrun), of the supervisor's local group, or one simulated rank of a dry run (MS_SIMULATION_LEVEL
    with RANK_SIZE and RANK_ID: `plan --dry-run`)."""
    return (env.get("MS_ROLE") == "MS_WORKER" or local_group(env) is not None
            or bool(env.get("MS_SIMULATION_LEVEL") and env.get("RANK_SIZE")))


def compute_threads(cfg: Config, local_world_size: int) -> int:
    """Intra-op threads for this rank: the config's, else an equal share of the cores this process may
    use (its CPU affinity: a cpuset or systemd's CPUAffinity= can give it fewer than the machine's), at
    least 1; the same share parallel.bind_cores binds it to."""
    if cfg.train.compute_threads:
        return cfg.train.compute_threads
    return max(1, len(os.sched_getaffinity(0)) // local_world_size)


def core_share(rank: int, world: int, cores) -> list[int] | None:
    """The cores local rank `rank` of `world` is bound to: its contiguous, equal share of `cores` (the
    CPUs this process may use, sorted), or None where there are fewer cores than ranks."""
    cores = sorted(cores)
    per = len(cores) // world
    return cores[rank * per:(rank + 1) * per] if per >= 1 else None


def bind_to_cores(cores: list[int]) -> bool:
    """Every thread of this process, and every thread it starts later, runs on `cores` only; returns
    whether every thread, read back, does. Why (measured, small-20m): MindSpore's runtime runs one
    rank's independent kernels side by side on its actor threads, so even with train.compute_threads
    = 1 a rank keeps ~1.8 cores busy; two such ranks on 2 cores trained slower than one (0.90x),
    bound to a core each 1.11x."""
    bound = True
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
            bound = bound and os.sched_getaffinity(int(tid)) == set(cores)
        except ProcessLookupError:                        # a thread that just ended
            pass
        except PermissionError:                           # one this process may not move
            bound = False
    return bound


def check_process_count(cfg: Config, env: Mapping[str, str] = os.environ) -> None:
    """A lone process runs one rank: refuse a multi-rank layout before MindSpore is even loaded."""
    if not is_cluster_member(env) and cfg.parallel.world_size != 1:
        raise ConfigError(f"parallel.dp x tp x pp = {cfg.parallel.world_size} needs that many ranks; "
                          "a single process runs only 1 (start ranks with `llm-pretrain run`)")


# The CPU memory pool's block (MindSpore's default is 1 GiB blocks on the CPU). Measured on small-20m,
# micro-batch 16: with 1 GiB blocks the second step touches fresh pages of a third block (peak RSS
# 4.27 -> 5.06 GB, and that step runs 2 s slower); with 0.25-0.5 GB blocks the peak stays at the first
# step's 4.27 GB. A tensor larger than a block still gets a block of its own size.
CPU_POOL_BLOCK = "0.25GB"

_formed: tuple[tuple, RankInfo] | None = None     # what setup did in this process, and for which settings


def _setup_key(cfg: Config, env: Mapping[str, str]) -> tuple:
    return (cfg.train.device, cfg.train.seed, cfg.train.compute_threads, cfg.parallel, local_group(env),
            tuple(sorted((k, v) for k, v in env.items() if k.startswith("MS_"))))


def setup(cfg: Config, env: Mapping[str, str] = os.environ) -> RankInfo:
    """Initialises MindSpore for this process; raises ConfigError if the cluster does not match the config.

    Once per process: a warm standby rank (engine/rank/standby.py) forms its cluster before it is activated,
    and the activated worker's call returns that cluster, if nothing it depends on changed."""
    global _formed
    key = _setup_key(cfg, env)
    if _formed is not None:
        if _formed[0] != key:
            raise ConfigError("the device, seed, threads, parallel layout or MindSpore environment changed "
                              "after this process formed its cluster")
        return _formed[1]
    _formed = (key, _setup(cfg, env))
    return _formed[1]


def _bind(cfg: Config, local_rank: int, local_world: int) -> None:
    """parallel.bind_cores: this rank on its share of the cores, when several CPU ranks share the machine
    as a local group. Not the ranks of a MindSpore cluster (msrun, or parallel.local_reduce = false):
    msrun binds its own workers (--bind_core), and on the CI's machine every msrun-formed pair of CPU
    ranks this bound died of SIGSEGV in 4 of 5 runs (never seen here in 9, loaded or not)."""
    if cfg.train.device != "cpu" or not cfg.parallel.bind_cores or local_world < 2:
        return
    cores = core_share(local_rank, local_world, os.sched_getaffinity(0))
    if cores is None:
        return
    every = bind_to_cores(cores)
    print(f"llm-pretrain: local rank {local_rank} of {local_world} runs on cores "
          f"{','.join(map(str, cores))} (every thread: {every})", file=sys.stderr, flush=True)


def _setup(cfg: Config, env: Mapping[str, str]) -> RankInfo:
    import mindspore as ms

    check_process_count(cfg, env)
    member, group = is_cluster_member(env), local_group(env)
    if group is not None:        # across machines, this machine's share of the group
        local_world = group.world if group.hub is None else cfg.parallel.world_size // cfg.run.nodes
    else:
        local_world = int(env.get("MS_LOCAL_WORKER_NUM", env.get("MS_WORKER_NUM", "1"))) if member else 1
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU" if cfg.train.device == "cpu" else "Ascend")
    if cfg.train.device == "cpu":
        from engine.model import fused_cpu

        threads = compute_threads(cfg, local_world)
        ms.device_context.cpu.op_tuning.threads_num(threads)
        fused_cpu.set_threads(threads)
        ms.runtime.set_memory(init_size=CPU_POOL_BLOCK, increase_size=CPU_POOL_BLOCK)
    ms.set_seed(cfg.train.seed)
    decided = parallel.decide(cfg)
    if not member:
        return RankInfo(rank=0, world_size=1, local_world_size=1, parallelism=decided,
                        gradient_sum=choose(cfg, world=1, local_world=1, env=env))
    if group is not None:       # no MindSpore cluster to form: the step sums through shared memory
        if group.world != cfg.parallel.world_size:
            raise ConfigError(f"parallel.dp x tp x pp = {cfg.parallel.world_size} but the local group has "
                              f"{group.world} ranks ({ENV_LOCAL_WORLD}); they must match")
        _bind(cfg, group.rank % local_world, local_world)
        return RankInfo(rank=group.rank, world_size=group.world, local_world_size=local_world, parallelism=decided,
                        gradient_sum=choose(cfg, world=group.world, local_world=local_world, env=env))
    from mindspore import communication

    communication.init()
    rank, world = communication.get_rank(), communication.get_group_size()
    if world != cfg.parallel.world_size:
        raise ConfigError(f"parallel.dp x tp x pp = {cfg.parallel.world_size} but the cluster has {world} ranks "
                          "(MS_WORKER_NUM); they must match")
    if not decided.semi_auto:
        ms.set_auto_parallel_context(**decided.context)
    # semi-auto parallel is configured on the compiled step's AutoParallel wrapper (engine/training/sharded_step.py)
    return RankInfo(rank=rank, world_size=world, local_world_size=local_world, parallelism=decided,
                    gradient_sum=choose(cfg, world=world, local_world=local_world, env=env))
