"""The RAM tier on every machine (issue 50, item 1): each machine keeps its own ranks' RAM checkpoints, says
which it holds once its ranks are gone, and the decider resumes the next generation from the newest step every
member holds, where it is newer than the disk's; the ranks are told that step and restore exactly it."""
import json

import pytest

from checkpointing import layout, reader
from checkpointing.writer import FORMAT, VERSION
from contracts.config import load_config
from contracts.errors import ConfigError
from contracts.protocol import ENV_RESUME_STEP
from daemon.machines.memory_agreement import agree, record
from daemon.processes.run_files import RunFiles

TWO = ["run.nodes=2", "parallel.dp=2", "train.micro_batch=4", 'run.coordinator="etcd://127.0.0.1:2379"',
       "run.master_port=29500", "checkpoint.memory_interval_steps=1"]


def _agree(held, members=(0, 1, 2), last=(0, 1, 2), own_steps=(18, 19, 20)):
    return agree(members, held, last_generation=5, last_members=last, own=0, own_steps=own_steps)


def test_the_run_resumes_from_the_newest_step_every_member_holds():
    got = _agree({1: record(5, [19, 20]), 2: record(5, [18, 19])})
    assert got.heard and got.steps == (19,) and got.newest == 19
    # the decider's own steps are its tmpfs's, never its etcd record's (stale, or retired by a rollback since)
    assert _agree({0: record(5, [21, 22]), 1: record(5, [20]), 2: record(5, [20])}).steps == (20,)


def test_a_member_is_heard_only_once_it_spoke_after_its_ranks_of_the_last_generation_were_gone():
    got = _agree({1: record(4, [19, 20]), 2: record(5, [20])})     # node 1's ranks may still be committing
    assert not got.heard and got.unheard == (1,) and got.steps == (20,)
    assert not _agree({2: record(5, [20])}).heard                   # node 1 said nothing at all
    # a machine that was not in the last generation (back, or new): whatever it last said stands
    assert _agree({1: record(2, [20]), 2: record(5, [20])}, last=(0, 2)).heard
    assert _agree({1: {"after": 5, "steps": "garbage"}, 2: record(5, [20])}).unheard == (1,)


def test_no_step_in_common_resumes_from_the_disk():
    got = _agree({1: record(5, []), 2: record(5, [20])})            # node 1 rebooted: its tmpfs is empty
    assert got.heard and got.steps == () and got.newest == 0


def _manifest(root, step):
    layout.step_dir(root, step).mkdir(parents=True)
    (layout.step_dir(root, step) / layout.MANIFEST).write_text(
        json.dumps({"format": FORMAT, "version": VERSION, "shards": []}))


def _files(tmp_path, node, *more):
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    return RunFiles(load_config(None, [f'run.dir="{run}"', f'checkpoint.memory_dir="{tmp_path / "shm"}"', *TWO,
                                       f"run.node_rank={node}", *more]), {})


def test_each_machine_has_its_own_ram_tier_and_resumes_from_the_agreed_step(tmp_path):
    zero, one = _files(tmp_path, 0), _files(tmp_path, 1)
    assert zero.memory_root() != one.memory_root() and zero.memory_root().parent == one.memory_root().parent
    assert one.memory_root().name.endswith("-node-1")                # one tmpfs shared by both (containers)
    for s in (20,):
        _manifest(zero.ckpt_root, s)
    for s in (23, 24, 25):
        _manifest(zero.memory_root(), s)
    assert zero.resume_point() == (20, "disk")                        # no agreement: the disk, as before
    assert zero.resume_point([23, 24]) == (24, "ram") and one.tier_of(24) == "ram" and one.tier_of(20) == "disk"
    assert zero.resume_point([12]) == (20, "disk")                    # older than the disk's
    assert zero.retire_memory_after(23) == [24, 25] and layout.committed_steps(zero.memory_root()) == [23]
    zero.agreed_step = 23                                            # the ranks are told it
    env = zero.rank_env({}, zero_cfg(tmp_path), rank=0, port=29500, generation=3, sock=tmp_path / "s")
    assert env[ENV_RESUME_STEP] == "23"


def zero_cfg(tmp_path):
    return load_config(None, [f'run.dir="{tmp_path / "run"}"', *TWO])


def test_the_ranks_look_at_nothing_newer_than_the_agreed_step(tmp_path):
    disk, memory = tmp_path / "disk", tmp_path / "memory"
    for root, steps in ((disk, [10, 20]), (memory, [21, 22, 23])):
        for s in steps:
            _manifest(root, s)
    newest = lambda at_most: reader.find_newest(disk, memory, at_most=at_most)[0].name   # noqa: E731
    assert newest(None) == "step-00000023" and newest(22) == "step-00000022" and newest(20) == "step-00000020"
    assert newest(15) == "step-00000010" and reader.find_newest(disk, memory, at_most=5) is None


def test_a_ram_tier_on_several_machines_is_a_data_parallel_runs_and_refused_where_the_state_is_split():
    load_config(None, TWO)                                           # refused before: one machine only
    with pytest.raises(ConfigError, match=r"checkpoint.memory_interval_steps with run.nodes > 1 .* parallel.tp"):
        load_config(None, [*TWO, 'train.device="ascend"', "parallel.tp=2", "parallel.dp=1"])


def test_a_machine_back_without_the_newest_step_is_asked_to_take_it_from_a_peer():
    # node 1 was in the last generation and came back rebooted (its tmpfs empty); node 2 holds what node 0 does
    got = _agree({0: record(5, [], url="http://a:1"), 1: record(5, []), 2: record(5, [19, 20], url="http://c:3")})
    assert got.heard and got.steps == () and got.take == 20 and got.lacking == (1,)
    assert got.sources == ("http://a:1", "http://c:3")
    # once it took it, the run resumes from it everywhere
    assert _agree({1: record(5, [20], taken=[20]), 2: record(5, [19, 20])}).steps == (20,)
    # it could not: not asked again; the newest all hold, or the disk's
    failed = _agree({1: record(5, [], failed=20), 2: record(5, [19, 20])})
    assert failed.heard and failed.take is None and failed.steps == ()
    # nobody serves it (no address), or nothing newer than the disk's anywhere: nothing to take
    assert _agree({1: record(5, []), 2: record(5, [19, 20])}, own_steps=[19, 20]).take is None
    assert agree((0, 1), {1: record(5, [])}, last_generation=5, last_members=(0, 1), own=0, own_steps=[20],
                 disk_step=20).take is None


def test_a_machine_that_missed_the_last_generation_counts_only_what_it_took():
    """Its steps of the same numbers may be another history's (before a rollback, or before the run went on)."""
    held = {1: record(2, [20], url="http://b:2"), 2: record(5, [19, 20], url="http://c:3")}
    got = _agree(held, last=(0, 2))
    assert got.heard and got.take == 20 and got.lacking == (1,) and got.sources == ("http://c:3",)
    assert _agree({**held, 1: record(2, [20], taken=[20])}, last=(0, 2)).steps == (20,)


def test_a_member_taking_a_step_from_a_peer_is_waited_for():
    got = _agree({1: record(5, [], fetching=20), 2: record(5, [20])})
    assert not got.heard and got.unheard == (1,) and got.fetching == (1,)
    assert _agree({1: record(5, [20]), 2: record(5, [20])}).steps == (20,)
