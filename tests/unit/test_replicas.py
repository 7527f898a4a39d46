"""Replica fingerprints: the digest sees any one flipped bit, and the comparison names the odd replica
(or, of two, says it cannot)."""
import numpy as np
import pytest

from contracts.protocol import FingerprintEvent
from daemon.judging.incidents import Kind
from daemon.judging.replicas import ReplicaCheck
from engine.rank import fingerprint


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("bit", [0, 10, 22, 30, 31])
def test_one_flipped_bit_anywhere_changes_its_groups_value_and_no_other(dtype, bit):
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(shape).astype(dtype) for shape in [(7, 5), (3,), (4, 4), (9,), (2, 2, 2)]]
    bit = min(bit, 8 * np.dtype(dtype).itemsize - 1)
    clean = fingerprint.fingerprint(params, groups=3)
    for i in range(len(params)):
        for index in (0, params[i].size - 1):
            flipped = [fingerprint.flip_bit(p, index, bit) if j == i else p for j, p in enumerate(params)]
            after = fingerprint.fingerprint(flipped, groups=3)
            changed = [g for g, (a, b) in enumerate(zip(clean, after)) if a != b]
            group = next(g for g, (a, b) in enumerate(fingerprint.group_bounds(len(params), 3)) if a <= i < b)
            assert changed == [group]
    assert fingerprint.fingerprint(params, groups=3) == clean           # flip_bit copies


def test_groups_cover_every_parameter_once():
    for count in (1, 2, 7, 8, 9, 100):
        bounds = fingerprint.group_bounds(count)
        assert bounds[0][0] == 0 and bounds[-1][1] == count and all(a < b for a, b in bounds)
        assert all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))


def _fp(rank, step, groups):
    return FingerprintEvent(rank=rank, generation=1, step=step, groups=groups, names=["embed", "layers.0", "head"])


def test_the_odd_replica_of_three_is_named_with_its_group_and_where_they_last_agreed():
    check = ReplicaCheck([0, 1, 2])
    check.started_at(20)
    assert all(check.observe(_fp(r, 30, [1, 2, 3])) is None for r in (0, 1, 2))
    assert check.agreed_step == 30
    assert check.observe(_fp(0, 40, [5, 6, 7])) is None and check.observe(_fp(2, 40, [5, 6, 7])) is None
    incident = check.observe(_fp(1, 40, [5, 6 + 1024, 7]))
    assert incident.kind is Kind.REPLICA_MISMATCH and incident.rank == 1
    assert (incident.first_step, incident.last_step) == (31, 40)
    assert incident.evidence["groups"] == [1] and incident.evidence["group_names"] == ["layers.0"]
    assert not incident.evidence["tie"] and "rank 1" in incident.detail


def test_two_replicas_that_differ_are_both_named_and_a_lone_rank_is_never_compared():
    check = ReplicaCheck([0, 1])
    check.started_at(10)
    check.observe(_fp(0, 20, [1, 2, 3]))
    incident = check.observe(_fp(1, 20, [1, 2, 4]))
    assert incident.rank is None and incident.evidence["odd_ranks"] == [0, 1] and incident.evidence["tie"]
    assert incident.first_step == 11 and "cannot be told" in incident.detail
    assert ReplicaCheck([0]).observe(_fp(0, 20, [1])) is None


def test_the_ranks_an_incident_points_at():
    from daemon.judging.triage import suspects

    nan, inf = float("nan"), float("inf")
    assert suspects([([2.0, 2.1], [1.0, inf])]) == [1]                   # a non-finite own gradient
    assert suspects([([2.0, nan], [1.0, 1.0]), ([2.0, 2.0], [1.0, 1.0])]) == [1]
    assert suspects([([2.0, 2.0, 2.0], [1.0, 1.1, 30.0])]) == [2]          # 10x the others' median
    assert suspects([([2.0, 2.0, 2.0], [1.0, 1.1, 5.0])]) == []            # nothing stands out
    assert suspects([(None, None), ([], [])]) == []                        # no per-rank values (one rank, tp/pp)
