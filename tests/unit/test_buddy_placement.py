"""State only one machine holds (issue 50, item 3), the pure parts: which machine keeps a copy of which machine's
RAM-tier part (another failure domain where run.failure_domains names them), parts merged into a whole step, and
the decider's agreement over parts: a step the survivors' parts and buddy copies make whole is resumed from, each
taking what it lacks; one whose lost machine's part nobody copied is not (the disk's, or an older step)."""
import pytest

from checkpointing import parts
from contracts.config import load_config
from contracts.errors import ConfigError
from daemon.machines import buddies
from daemon.machines.memory_agreement import agree, record


def test_each_machines_part_goes_to_another_failure_domain_where_one_is_named():
    assert buddies.holders([0, 1, 2]) == {0: 1, 1: 2, 2: 0}
    # machines 0 and 1 share a rack, 2 and 3 another: every copy leaves its rack
    got = buddies.holders([0, 1, 2, 3], ["a", "a", "b", "b"])
    assert got == {0: 2, 1: 2, 2: 0, 3: 0}
    assert all(["a", "a", "b", "b"][n] != ["a", "a", "b", "b"][h] for n, h in got.items())
    assert buddies.holders([0, 1], ["a", "a"]) == {0: 1, 1: 0}      # one domain: the next machine all the same
    assert buddies.holders([3]) == {} and buddies.kept_by(2, [0, 1, 2, 3], ["a", "a", "b", "b"]) == [0, 1]
    assert buddies.holders([0, 2, 3], ["a", "a", "b", "b"]) == {0: 2, 2: 0, 3: 0}   # a generation without node 1


def _part(step, slot, of=2, per=2):
    ranks = range(slot * per, (slot + 1) * per)
    shards = [{"file": f"shard-{r:05d}-of-{of * per:05d}.safetensors", "crc32c": f"{r}", "size_bytes": 8}
              for r in ranks]
    return {"format": "llm-pretrain-checkpoint", "step": step, "world_size": of * per, "shards": shards,
            "tensors": {f"w{r}": {"shard": s["file"], "shape": [2], "dtype": "float32"} for r, s in zip(ranks, shards)},
            "run_state": {"step": step}, "part": {"slots": [slot], "of": of, "ranks_per_slot": per}}


def test_parts_of_every_slot_merge_into_a_whole_step_and_fewer_stay_a_part():
    whole = parts.merge([_part(7, 1), _part(7, 0)])
    assert "part" not in whole and parts.is_whole(whole)
    assert sorted(whole["tensors"]) == ["w0", "w1", "w2", "w3"] and len(whole["shards"]) == 4
    three = parts.merge([_part(7, 0, of=3), _part(7, 2, of=3)])
    assert parts.slots(three) == (frozenset({0, 2}), 3) and not parts.is_whole(three)
    shards, tensors = parts.of_slot(three, 2)
    assert [s["file"] for s in shards] == ["shard-00004-of-00006.safetensors", "shard-00005-of-00006.safetensors"]
    assert sorted(tensors) == ["w4", "w5"]
    with pytest.raises(ValueError, match="different checkpoints"):
        parts.merge([_part(7, 0), _part(8, 1)])
    other = _part(7, 1)
    other["shards"][0]["crc32c"] = "not the same"
    with pytest.raises(ValueError, match="differs"):
        parts.merge([_part(7, 1), other])


def _agree(held, members, last, own_parts, own_steps=()):
    return agree(members, held, last_generation=5, last_members=last, own=0, own_steps=own_steps,
                 own_parts=own_parts, disk_step=10)


def test_a_lost_machines_part_comes_from_its_buddys_copy_and_the_survivors_take_the_parts_they_lack():
    # three machines; node 1 lost. Node 0 holds its part of 19..21 and node 2's copy at 19; node 2 its part of
    # 19..21 and node 1's copy at 19: only step 19 is whole among the survivors
    own = {19: ({0, 2}, 3), 20: ({0}, 3), 21: ({0}, 3)}
    held = {2: record(5, [], url="http://n2", parts={19: ({1, 2}, 3), 20: ({2}, 3), 21: ({2}, 3)}),
            1: record(5, [], url="http://n1", parts={21: ({1, 0}, 3)})}
    got = _agree(held, members=(0, 2), last=(0, 1, 2), own_parts=own)
    assert got.heard and got.steps == () and got.take == 19 and got.lacking == (0, 2)
    assert got.sources == ("http://n2",)
    # no machine lost (a rank crashed): every part of the newest step is with its own machine
    held[1] = record(5, [], url="http://n1", parts={20: ({1}, 3), 21: ({1, 0}, 3)})
    assert _agree(held, members=(0, 1, 2), last=(0, 1, 2), own_parts=own).take == 21
    # once taken, each holds it whole: the agreement is made
    done = {2: record(5, [19], url="http://n2", parts={20: ({2}, 3)})}
    assert _agree(done, members=(0, 2), last=(0, 1, 2), own_parts={20: ({0}, 3)}, own_steps=[19]).steps == (19,)


def test_a_part_nobody_copied_leaves_the_step_to_the_disk():
    own = {20: ({0}, 2)}
    got = _agree({}, members=(0,), last=(0, 1), own_parts=own)
    assert got.heard and got.take is None and got.newest == 0          # the disk's step
    # a machine that was not in the last generation: its parts are another history's
    stale = {1: record(5, [], url="http://n1", parts={20: ({1}, 2)})}
    assert _agree(stale, members=(0, 1), last=(0,), own_parts=own).take is None


def test_the_config_says_buddy_placement_and_failure_domains_in_one_line():
    base = ["run.nodes=2", "parallel.dp=2", "train.micro_batch=4", 'run.coordinator="etcd://127.0.0.1:2379"',
            "run.master_port=29500", "checkpoint.memory_interval_steps=1"]
    cfg = load_config(None, base + ['checkpoint.memory_placement="buddy"', 'run.failure_domains="r1, r2"'])
    assert cfg.checkpoint.memory_placement == "buddy"
    with pytest.raises(ConfigError, match=r"memory_placement = 'both' is not allowed; use one of 'replica', 'buddy'"):
        load_config(None, base + ['checkpoint.memory_placement="both"'])
    with pytest.raises(ConfigError, match="names 3 machine"):
        load_config(None, base + ['run.failure_domains="a,b,c"'])
    with pytest.raises(ConfigError, match="empty name"):
        load_config(None, base + ['run.failure_domains="a,"'])
    # on Ascend, tp splits the state across machines: a whole replica per machine is refused, parts are not
    ascend = base + ["parallel.tp=2", 'train.device="ascend"']
    with pytest.raises(ConfigError, match='set checkpoint.memory_placement = "buddy"'):
        load_config(None, ascend)
    assert load_config(None, ascend + ['checkpoint.memory_placement="buddy"']).parallel.tp == 2


def test_a_generation_without_a_lost_machine_names_the_failure_domains_of_those_left():
    from daemon.machines.generation_handshake import generation_config

    base = load_config(None, ["run.nodes=3", "parallel.dp=3", "train.global_batch=12", "train.micro_batch=4",
                              'run.coordinator="etcd://127.0.0.1:2379"', "run.master_port=29500", "run.min_nodes=2",
                              "checkpoint.memory_interval_steps=1", 'checkpoint.memory_placement="buddy"',
                              'run.failure_domains="a,a,b"'])
    shrunk = generation_config(base, {}, (0, 2), 2, "10.0.0.1")      # before: "names 3 machines; run.nodes = 2"
    assert (shrunk.run.nodes, shrunk.run.node_rank, shrunk.run.failure_domains) == (2, 1, "a,b")


def test_parts_newer_than_the_steps_all_hold_whole_are_taken_not_passed_over():
    # the step the last recovery resumed from (190) is whole everywhere; the generation since wrote parts to 230
    held = {1: record(5, [190], url="http://n1", parts={230: ({1}, 2)})}
    got = agree((0, 1), held, last_generation=5, last_members=(0, 1), own=0, own_steps=[190],
                own_parts={230: ({0}, 2)}, disk_step=100)
    assert got.take == 230 and got.lacking == (0, 1)
    # replica placement (no parts) as before: the newest step all hold
    assert agree((0, 1), {1: record(5, [190])}, last_generation=5, last_members=(0, 1), own=0,
                 own_steps=[190, 191], disk_step=100).steps == (190,)


def test_a_step_whole_on_one_machine_by_its_copy_is_taken_by_the_other_rather_than_an_older_one():
    """Two machines, a rank crashed mid-save on node 1: node 0 holds 24 whole (its copy of node 1's part came in)
    and its part of 25; node 1 its parts of 23 and 24, its copy of node 0's part still at 20. Before: 24 made whole
    nowhere by parts alone, and the run went back to 20, the newest both held whole (6 steps lost in a bench)."""
    held = {1: record(5, [20], url="http://n1", parts={23: ({1}, 2), 24: ({1}, 2)})}
    got = agree((0, 1), held, last_generation=5, last_members=(0, 1), own=0, own_steps=[20, 24],
                own_parts={25: ({0}, 2)}, disk_step=0)
    assert got.take == 24 and got.lacking == (1,) and got.steps == (20,)
