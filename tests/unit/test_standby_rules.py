"""When a warm standby is kept, and when one is not used (daemon/processes/standby.py); no processes."""
import pytest

from contracts.config import load_config, with_changes
from contracts.protocol import activation_line, await_activation
from daemon.processes.standby import Standby, wanted

CFG = load_config(None, ['parallel.dp=2', 'train.micro_batch=4'])


@pytest.mark.parametrize("overrides,kept", [
    ([], True),
    (["run.standby=false"], False),
    (["run.master_port=29500"], False),                 # held by the generation that trains
    (["parallel.dp=1", "train.micro_batch=8", "run.master_port=29500"], True),    # one rank: no scheduler
])
def test_a_standby_is_kept_on_cpu_single_node_runs_with_an_automatic_port(overrides, kept):
    assert wanted(load_config(None, ['parallel.dp=2', 'train.micro_batch=4', *overrides])) == kept


SEVERAL = {"run.nodes": 2, "run.master_port": 29500, "run.coordinator": "etcd://127.0.0.1:2379"}


def test_no_standby_on_ascend_and_a_late_one_across_nodes():
    assert not wanted(with_changes(CFG, {"train.device": "ascend"}))
    assert wanted(with_changes(CFG, SEVERAL))                  # late: its cluster forms once activated
    assert not wanted(with_changes(CFG, {**SEVERAL, "train.device": "ascend"}))


def test_a_late_standby_takes_the_generations_scheduler_but_nothing_else_new():
    """Several machines: the scheduler's address and port and the ranks' ids are the generation's (the
    standby formed no cluster yet); anything else MindSpore reads must be what it started with; and one
    with a scheduler is not used where this node no longer runs it."""
    cfg = with_changes(CFG, SEVERAL)
    standby = Standby(cfg, 29500, (0, 1), _envs(MS_SCHED_HOST="10.0.0.1"), [], {}, late=True)
    now = standby.started_at + 1
    assert standby.unusable(cfg, [0, 1], _envs(port="29501", MS_SCHED_HOST="10.0.0.2"), now) is None
    assert "MindSpore environment" in standby.unusable(cfg, [0, 1], _envs(GLOG_v="1"), now)
    early = Standby(CFG, 5000, (0, 1), _envs(), [], {})
    assert "MindSpore environment" in early.unusable(CFG, [0, 1], _envs(port="5001"), early.started_at + 1)
    from daemon.processes.standby import SCHEDULER

    standby.pipes[SCHEDULER] = -1
    assert "no longer runs the scheduler" in standby.unusable(cfg, [0, 1], _envs(), now)
    assert standby.unusable(cfg, [0, 1], {**_envs(), SCHEDULER: {}}, now) is None


def _envs(port="5000", ranks=(0, 1), **more):
    return {r: {"MS_SCHED_PORT": port, "MS_NODE_ID": str(r), "LLM_PRETRAIN_GENERATION": "2", **more} for r in ranks}


def test_a_late_standby_fits_a_run_shrunk_or_regrown_around_its_machine_as_whichever_ranks_it_has_now():
    """A late standby read no config and no cluster variable yet (the rank reads the generation's config
    once activated, and MindSpore reads the compile cache's path at the first compile): another
    data-parallel size, accumulation, compile cache and rank ids fit; another number of ranks on this
    machine, another memory limit (the cgroup it runs in) or another MindSpore setting it did read do not."""
    cfg = with_changes(CFG, {**SEVERAL, "run.nodes": 3, "parallel.dp": 3, "train.global_batch": 24,
                             "train.grad_accum_steps": 2})
    standby = Standby(cfg, 29500, (2,), _envs(ranks=(2,), MS_COMPILER_CACHE_PATH="/cc/a"), [], {}, late=True)
    now = standby.started_at + 1
    shrunk = with_changes(cfg, {"run.nodes": 2, "parallel.dp": 2, "train.grad_accum_steps": 3})
    assert standby.unusable(shrunk, [1], _envs(ranks=(1,), MS_COMPILER_CACHE_PATH="/cc/b"), now) is None
    assert "ranks are now [1, 2]" in standby.unusable(shrunk, [1, 2], _envs(ranks=(1, 2)), now)
    limited = with_changes(shrunk, {"run.worker_memory_limit_bytes": 2_000_000_000})
    assert "memory limit changed" in standby.unusable(limited, [1], _envs(ranks=(1,)), now)
    assert "MindSpore environment" in standby.unusable(shrunk, [1], _envs(ranks=(1,), MS_COMPILER_CACHE_PATH="/cc/b",
                                                                       GLOG_v="1"), now)
    # an early standby (one machine) formed its cluster with its config: another config does not fit
    early = Standby(CFG, 5000, (0, 1), _envs(), [], {})
    assert "config changed" in early.unusable(with_changes(CFG, {"train.micro_batch": 2, "train.grad_accum_steps": 2}),
                                              [0, 1], _envs(), early.started_at + 1)


def test_a_late_standby_activated_as_other_ranks_writes_to_their_logs(tmp_path):
    """Machine 0 left: machine 2's rank 2 is rank 1 now. Its process is told its new log, and the daemon
    reads that log for it (the rank's exit, its memory, its refusal)."""
    import json
    import os

    from contracts.protocol import ENV_LOG_PATH
    from daemon.processes.generation import Worker

    reads, pipes, workers = {}, {}, []
    for rank in (2, 3):
        reads[rank], pipes[rank] = os.pipe()
        workers.append(Worker(role="rank", rank=rank, popen=None, log_path=tmp_path / f"rank-{rank}.log"))
    standby = Standby(CFG, 29500, (2, 3), _envs(ranks=(2, 3)), workers, pipes, late=True)
    standby.activate(_envs(ranks=(1, 2)), ranks=(1, 2))
    told = {}
    for rank, fd in reads.items():
        with open(fd, "rb") as pipe:
            told[rank] = json.loads(pipe.readline())["env"]
    assert [w.rank for w in standby.workers] == [1, 2] and standby.ranks == (1, 2)
    assert [w.log_path.name for w in standby.workers] == ["rank-1.log", "rank-2.log"]
    assert told[2]["MS_NODE_ID"] == "1" and told[2][ENV_LOG_PATH] == str(tmp_path / "rank-1.log")
    assert told[3]["MS_NODE_ID"] == "2" and told[3][ENV_LOG_PATH] == str(tmp_path / "rank-2.log")
def test_a_standby_fits_only_the_config_ranks_and_mindspore_environment_it_started_with():
    standby = Standby(CFG, 5000, (0, 1), _envs(), [], {})
    now = standby.started_at + 1
    assert standby.unusable(CFG, [0, 1], _envs(LLM_PRETRAIN_RECOVERY="/run/recovery.json"), now) is None
    assert "config changed" in standby.unusable(with_changes(CFG, {"train.micro_batch": 2,
                                                                   "train.grad_accum_steps": 2}), [0, 1], _envs(), now)
    assert "ranks are now [0]" in standby.unusable(CFG, [0], _envs(), now)
    assert "MindSpore environment" in standby.unusable(CFG, [0, 1], _envs(MS_COMPILER_CACHE_PATH="/elsewhere"), now)
    assert "larger than a pipe" in standby.unusable(CFG, [0, 1], _envs(BIG="x" * 70_000), now)


def test_a_standby_whose_cluster_never_formed_is_not_used():
    standby = Standby(CFG, 5000, (0, 1), _envs(), [], {})
    late = standby.started_at + 61
    assert "has not formed in 60 s" in standby.unusable(CFG, [0, 1], _envs(), late)
    assert not standby.ready(0, late) and standby.ready(1, late)          # every rank reported: formed
    assert standby.unusable(CFG, [0, 1], _envs(), late) is None


def test_the_ram_tier_and_a_memory_limit_do_not_go_together():
    from contracts.errors import ConfigError

    with pytest.raises(ConfigError, match="tmpfs pages count against the ranks' memory limit"):
        load_config(None, ["checkpoint.memory_interval_steps=5", "run.worker_memory_limit_bytes=1000000000"])


def test_an_activation_carries_the_whole_environment_and_a_closed_pipe_retires(tmp_path):
    import os

    read, write = os.pipe()
    os.write(write, activation_line({"A": "1", "PATH": "/bin"}))
    os.close(write)
    assert await_activation(read) == {"A": "1", "PATH": "/bin"}
    read, write = os.pipe()
    os.close(write)
    assert await_activation(read) is None
    read, write = os.pipe()
    os.write(write, b'{"env": {"A": ')                 # a daemon that died mid-write: not an activation
    os.close(write)
    assert await_activation(read) is None
