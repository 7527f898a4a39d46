"""When a generation is a local group (no MindSpore cluster; daemon/processes/mindspore_env.py), and what its ranks are told."""
import os

import pytest

from contracts.config import load_config
from contracts.protocol import ENV_GENERATION, ENV_LOCAL_GROUP, ENV_LOCAL_RANK, ENV_LOCAL_WORLD
from daemon.processes import mindspore_env
from daemon.processes.generation import worker_env
from engine.rank import runtime
from engine.training import gradient_sum
from engine.training.gradient_sum import LocalGroup, local_group

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("sets, local", [
    (["parallel.dp=2", "train.micro_batch=4", "parallel.local_reduce=true"], True),
    (["parallel.dp=2", "train.micro_batch=4", "parallel.local_reduce=false"], False),   # MindSpore's AllReduce
    (["parallel.local_reduce=true"], False),                                           # one rank: no group
    (["parallel.dp=2", "train.micro_batch=4", "parallel.local_reduce=true", "run.nodes=2",
      "run.coordinator=\"etcd://127.0.0.1:2379\"", "run.master_port=29500"], True),    # across machines: a hub
    (["parallel.dp=2", "train.micro_batch=4", "parallel.local_reduce=false", "run.nodes=2",
      "run.coordinator=\"etcd://127.0.0.1:2379\"", "run.master_port=29500"], False),
])
def test_a_local_group_is_data_parallel_cpu_ranks_summing_without_mindsporess_cluster(sets, local):
    cfg = load_config(None, sets)
    assert mindspore_env.is_local_group(cfg) is local
    assert mindspore_env.has_hub(cfg) is (local and cfg.run.nodes > 1)
    # what the scheduler's machine starts: MindSpore's scheduler, or across machines the group's hub
    assert mindspore_env.needs_scheduler(cfg) is (not local or cfg.run.nodes > 1)


def test_across_machines_a_rank_gets_the_hub_of_its_generation_and_no_cluster_variables():
    from contracts.protocol import ENV_GROUP_HUB

    cfg = load_config(None, ["parallel.dp=4", "train.micro_batch=2", "run.nodes=2", "run.master_port=29500",
                             "run.coordinator=\"etcd://127.0.0.1:2379\"", 'run.master_addr="10.0.0.7"'])
    base = {"PATH": "/bin", "MS_ROLE": "MS_WORKER", "MS_SCHED_PORT": "1", "MS_WORKER_NUM": "4"}
    env = worker_env(base, cfg, rank=3, port=4711, generation=5)
    assert not {"MS_ROLE", "MS_SCHED_PORT", "MS_WORKER_NUM"} & set(env)
    assert (env[ENV_LOCAL_RANK], env[ENV_LOCAL_WORLD], env[ENV_GROUP_HUB]) == ("3", "4", "10.0.0.7:4711")
    assert local_group(env) == LocalGroup(rank=3, world=4, prefix=env[ENV_LOCAL_GROUP], hub="10.0.0.7:4711")
    assert gradient_sum.choose(cfg, world=4, local_world=2, env=env) == gradient_sum.GradientSum(
        via=gradient_sum.HUB, prefix=env[ENV_LOCAL_GROUP], hub="10.0.0.7:4711")
    hub = mindspore_env.hub_env({**base, "PATH": "/bin"}, host="10.0.0.7", port=4711, world=4, generation=5)
    assert hub[ENV_GROUP_HUB] == "10.0.0.7:4711" and hub[ENV_LOCAL_WORLD] == "4" and "MS_ROLE" not in hub
    # hub and ranks name the same group, one another generation's rank does not (the hub refuses it)
    assert hub[ENV_LOCAL_GROUP] == env[ENV_LOCAL_GROUP]
    assert worker_env(base, cfg, rank=3, port=4711, generation=6)[ENV_LOCAL_GROUP] != hub[ENV_LOCAL_GROUP]


def test_a_local_groups_rank_gets_its_rank_world_and_the_generations_files_and_no_cluster_variables():
    cfg = load_config(None, ["parallel.dp=2", "train.micro_batch=4", "parallel.local_reduce=true"])
    base = {"PATH": "/bin", "MS_ROLE": "MS_WORKER", "MS_SCHED_PORT": "1", "MS_WORKER_NUM": "4", "GLOG_v": "2"}
    env = worker_env(base, cfg, rank=1, port=4711, generation=3)
    assert not {"MS_ROLE", "MS_SCHED_PORT", "MS_WORKER_NUM"} & set(env)       # else MindSpore forms a cluster
    assert env["PATH"] == "/bin" and env["GLOG_v"] == "2" and env[ENV_GENERATION] == "3"
    assert (env[ENV_LOCAL_RANK], env[ENV_LOCAL_WORLD]) == ("1", "2")
    assert env[ENV_LOCAL_GROUP] == str(mindspore_env.local_group_prefix(port=4711, generation=3))
    assert local_group(env) == LocalGroup(rank=1, world=2, prefix=env[ENV_LOCAL_GROUP])
    assert gradient_sum.choose(cfg, world=2, local_world=2, env=env) == gradient_sum.GradientSum(
        via=gradient_sum.SHARED_MEMORY, prefix=env[ENV_LOCAL_GROUP])
    assert runtime.is_cluster_member(env)
    # the next generation, or a standby on another port, never meets this one's files
    assert len({mindspore_env.local_group_prefix(port=p, generation=g) for p, g in [(4711, 3), (4711, 4), (4712, 3)]}) == 3
    assert f"-{os.getpid()}-" in env[ENV_LOCAL_GROUP]       # the daemon's: its successor removes what a dead one left


@pytest.mark.parametrize("sets, env, via", [
    (["parallel.dp=2", "train.micro_batch=4"], {"MS_ROLE": "MS_WORKER", "MS_SCHED_PORT": "8118"}, "shared_memory"),
    (["parallel.dp=2", "train.micro_batch=4", "parallel.local_reduce=false"],
     {"MS_ROLE": "MS_WORKER", "MS_SCHED_PORT": "8118"}, "collective"),
    (["parallel.dp=2", "train.micro_batch=4"], {}, "collective"),                   # no cluster to name the files
    ([], {}, "collective"),                                                           # one rank
])
def test_under_msrun_ranks_sharing_a_machine_sum_through_shared_memory_between_cluster_barriers(sets, env, via):
    cfg = load_config(None, sets)
    chosen = gradient_sum.choose(cfg, world=cfg.parallel.world_size, local_world=cfg.parallel.world_size, env=env)
    assert chosen.via == via
    assert chosen.between_cluster_barriers is (via == "shared_memory")
    if via == "shared_memory":
        assert chosen.prefix.endswith("-8118")


def test_without_the_group_variables_a_rank_is_alone_or_msruns():
    assert local_group({}) is None
    assert local_group({"MS_ROLE": "MS_WORKER"}) is None and runtime.is_cluster_member({"MS_ROLE": "MS_WORKER"})


@pytest.mark.parametrize("rank, world, cores, share", [
    (0, 2, {0, 1}, [0]), (1, 2, {1, 0}, [1]),
    (1, 2, {7, 3, 1, 5}, [5, 7]),                  # the cores this process may use, whichever they are
    (2, 3, set(range(8)), [4, 5]),                 # equal shares; the leftover cores stay unused
    (1, 2, {0}, None),                             # fewer cores than ranks: not bound
])
def test_each_local_rank_gets_its_own_equal_share_of_the_cores(rank, world, cores, share):
    assert runtime.core_share(rank, world, cores) == share
    if share is not None:
        others = [runtime.core_share(r, world, cores) for r in range(world) if r != rank]
        assert all(not set(share) & set(o) for o in others)


def test_a_ranks_default_threads_are_its_share_of_the_cores_it_may_use():
    """Of the CPUs this process may use (a cpuset, systemd's CPUAffinity=), not of the machine's."""
    cfg = load_config(None, ["parallel.dp=2", "train.micro_batch=4"])
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})          # as a cpuset of one core would
        assert runtime.compute_threads(cfg, 1) == 1 and runtime.compute_threads(cfg, 2) == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert runtime.compute_threads(cfg, 1) == len(allowed)
    assert runtime.compute_threads(cfg, 2) == max(1, len(allowed) // 2)
    assert runtime.compute_threads(load_config(None, ["train.compute_threads=3"]), 2) == 3


def test_a_local_group_shrunk_or_regrown_with_the_same_micro_batch_keeps_its_compile_cache(tmp_path):
    """Its graphs hold no collective and no world size: the data-parallel size and accumulation shape
    them only through their product (and whether each is above 1). MindSpore's cluster, another
    micro-batch or a step without accumulation get caches of their own."""
    from daemon.processes.run_files import RunFiles

    several = ["run.master_port=29500", 'run.coordinator="etcd://127.0.0.1:2379"', f'run.dir="{tmp_path}"']
    shape = lambda dp, micro, accum, *more: load_config(None, [
        *several, f"run.nodes={dp}", f"parallel.dp={dp}", f"train.micro_batch={micro}", f"train.grad_accum_steps={accum}",
        f"train.global_batch={dp * micro * accum}", *more])
    cache = lambda cfg: RunFiles(cfg, {}).compile_cache_dir(cfg)
    assert cache(shape(3, 4, 2)) == cache(shape(2, 4, 3))                 # a machine lost: the same graphs
    assert cache(shape(3, 4, 2)) != cache(shape(2, 3, 4))                 # another micro-batch
    assert cache(shape(2, 4, 1)) != cache(shape(1, 4, 2, "run.nodes=1"))  # no accumulation / no peers
    cluster = lambda dp, accum: shape(dp, 4, accum, "parallel.local_reduce=false")
    assert cache(cluster(3, 2)) != cache(cluster(2, 3))                   # its graphs hold the AllReduce


def test_an_ascend_generation_turns_hccls_own_fault_detection_on_unless_the_operator_set_it():
    from daemon.processes.generation import HCCL_DFS_CONFIG

    cfg = load_config(None, ['train.device="ascend"', "parallel.dp=8", "train.micro_batch=1", "train.global_batch=8"])
    env = worker_env({"PATH": "/bin"}, cfg, rank=3, port=4711, generation=2)
    assert env["HCCL_DFS_CONFIG"] == HCCL_DFS_CONFIG and "stuck_detection:on" in HCCL_DFS_CONFIG
    own = worker_env({"PATH": "/bin", "HCCL_DFS_CONFIG": "cluster_heartbeat:off"}, cfg, rank=3, port=4711, generation=2)
    assert own["HCCL_DFS_CONFIG"] == "cluster_heartbeat:off"
    cpu = load_config(None, ["parallel.dp=2", "train.micro_batch=4"])
    assert "HCCL_DFS_CONFIG" not in worker_env({"PATH": "/bin"}, cpu, rank=1, port=4711, generation=2)


def test_a_scripts_ranks_get_no_compile_cache_keyed_by_this_projects_model(tmp_path):
    """The cache directory is named from the engine's model and layout; a user's script compiles graphs of its
    own, which a cache of that name would hand back stale after the script changed."""
    from daemon.processes.run_files import RunFiles

    engine = load_config(None, [f'run.dir="{tmp_path}"'])
    script = load_config(None, [f'run.dir="{tmp_path}"', "script.command='train.py'"])
    sock = tmp_path / "s.sock"
    env_of = lambda cfg: RunFiles(cfg, {}).rank_env({}, cfg, rank=0, port=29500, generation=1, sock=sock)
    assert env_of(engine)["MS_COMPILER_CACHE_ENABLE"] == "1"
    assert "MS_COMPILER_CACHE_ENABLE" not in env_of(script) and "MS_COMPILER_CACHE_PATH" not in env_of(script)
