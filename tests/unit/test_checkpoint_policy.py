import pytest

from checkpointing import layout
from checkpointing.partition import assign
from checkpointing.retention import retire_old, select_for_deletion


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


@pytest.mark.parametrize("committed,keep_last,keep_every,protected,deleted", [
    ([5, 10, 15, 20], 2, 0, (), [5, 10]),
    ([5, 10, 15, 20], 1, 10, (), [5, 15]),
    ([5, 10, 15, 20], 1, 0, (5,), [10, 15]),           # the supervisor's incidents need step 5
    ([5, 10], 3, 0, (), []),
    ([], 1, 0, (), []),
])
def test_retire_old_removes_exactly_the_selected_checkpoints(tmp_path, committed, keep_last, keep_every,
                                                            protected, deleted):
    for step in committed:
        layout.step_dir(tmp_path, step).mkdir()
        (layout.step_dir(tmp_path, step) / layout.MANIFEST).write_text("{}")
    (tmp_path / "step-00000001.tmp").mkdir()             # not committed: never retention's business
    assert retire_old(tmp_path, keep_last=keep_last, keep_every=keep_every, protected=protected) == deleted
    assert layout.committed_steps(tmp_path) == [s for s in committed if s not in deleted]
    assert sorted(p.name for p in tmp_path.iterdir() if layout.parse_step(p.name) is None) == ["step-00000001.tmp"]
