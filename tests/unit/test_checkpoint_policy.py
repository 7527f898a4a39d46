import pytest

from checkpointing import layout
from checkpointing.partition import assign
from checkpointing.retention import select_for_deletion


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_partition_is_disjoint_complete_balanced_and_deterministic(world):
    sizes = {f"t{i}": (i * 7919) % 1000 + 1 for i in range(50)}
    plan = assign(sizes, world)
    assert set(plan) == set(sizes) and set(plan.values()) <= set(range(world))
    loads = [sum(s for n, s in sizes.items() if plan[n] == r) for r in range(world)]
    assert max(loads) - min(loads) <= max(sizes.values())      # greedy LPT bound
    assert assign(dict(reversed(list(sizes.items()))), world) == plan


@pytest.mark.parametrize("steps,keep_last,keep_every,protected,deleted", [
    ([10, 20, 30, 40], 2, 0, (), [10, 20]),
    ([10, 20, 30, 40], 1, 20, (), [10, 30]),
    ([10, 20, 30, 40], 1, 0, (10,), [20, 30]),          # the newest healthy one survives
    ([10, 20, 30], 5, 0, (), []),
    ([], 3, 0, (), []),
])
def test_retention(steps, keep_last, keep_every, protected, deleted):
    assert select_for_deletion(steps, keep_last=keep_last, keep_every=keep_every, protected=protected) == deleted


@pytest.mark.parametrize("name,step", [("step-00000120", 120), ("step-123456789", 123456789),
                                       ("step-00000120.tmp", None), ("step-00000120.corrupt", None),
                                       ("LATEST", None), ("step-12", None)])
def test_only_committed_directory_names_are_steps(name, step):
    assert layout.parse_step(name) == step


@pytest.mark.parametrize("current,expected", [(55, set()), (69, {10}), (71, {20}), (100, {40}), (200, {100})])
def test_retention_keeps_the_newest_checkpoint_no_later_detection_can_spoil(current, expected):
    from checkpointing.retention import newest_settled

    # guard 50: an incident found from now on starts at most 50 steps back (detection + margin)
    assert newest_settled([10, 20, 40, 100], current_step=current, guard_steps=50) == expected
