"""A rank stuck inside a step is named in seconds (daemon.judging.stall), fed phase-board records and literal
times: which rank, in what phase, who waits for it; nothing while the others wait for a save, an evaluation or a
pause, nor before the generation has a step time."""
import pytest

from contracts.phase_board import Slot
from daemon.judging import stall

pytestmark = pytest.mark.unit
LIMIT = 10.0          # max(health.stall_floor_s = 10, 10 x p99 of a 0.05 s step)


def slots(*records):
    return {r: Slot(r, phase, step, entered) for r, phase, step, entered in records}


# (records: rank, phase, step, entered at; now) -> (culprits, phase, waiting) or None
CASES = {
    "rank 1 SIGSTOPped in its compute; 0, 2, 3 wait in the sum":
        (slots((0, "sum", 41, 100.0), (1, "compute", 41, 99.9), (2, "sum", 41, 100.1), (3, "sum", 41, 100.0)), 110.5,
         ((1,), "compute", (0, 2, 3))),
    "the same, 9 s on: not yet":
        (slots((0, "sum", 41, 100.0), (1, "compute", 41, 99.9)), 108.9, None),
    "stuck waiting for its data while the other waits in the sum":
        (slots((0, "sum", 41, 100.0), (1, "data", 41, 99.0)), 112.0, ((1,), "data", (0,))),
    "stopped between two steps":
        (slots((0, "sum", 42, 100.0), (1, "between", 41, 99.5)), 112.0, ((1,), "between", (0,))),
    "two culprits: the one stuck longer first":
        (slots((0, "compute", 41, 99.0), (1, "compute", 41, 98.0), (2, "sum", 41, 100.0)), 112.0,
         ((1, 0), "compute", (2,))),
    "rank 0 evaluates; rank 1 waits for it in the sum: not stuck":
        (slots((0, "eval", 40, 90.0), (1, "sum", 41, 90.1)), 200.0, None),
    "rank 0 saves; rank 1 waits: not stuck":
        (slots((0, "save", 40, 90.0), (1, "sum", 41, 90.1)), 200.0, None),
    "paused: not stuck":
        (slots((0, "paused", 40, 90.0), (1, "paused", 40, 90.0)), 900.0, None),
    "a healthy step: everyone moves":
        (slots((0, "compute", 41, 100.0), (1, "update", 41, 100.02)), 100.05, None),
    "all wait in the sum for a rank on another machine: only after twice the limit":
        (slots((0, "sum", 41, 100.0), (1, "sum", 41, 100.0)), 115.0, None),
    "all wait in the sum, twice the limit on: said, no culprit here":
        (slots((0, "sum", 41, 100.0), (1, "sum", 41, 100.2)), 120.5, ((), "sum", (0, 1))),
}


@pytest.mark.parametrize("case", CASES)
def test_a_stuck_rank_is_named_with_its_phase_and_its_waiters(case):
    records, now, expected = CASES[case]
    found = stall.judge(records, now, limit=LIMIT)
    if expected is None:
        assert found is None
        return
    culprits, phase, waiting = expected
    assert (found.culprits, found.phase, found.waiting) == (culprits, phase, waiting)
    assert found.stuck_s > LIMIT and found.limit_s == LIMIT


def test_a_rank_stopped_while_saving_is_stuck_all_the_same():
    """The kernel says rank 1's process is stopped (SIGSTOP) in its RAM-tier save: not a slow save, a dead rank."""
    records = slots((0, "sum", 41, 100.0), (1, "save", 40, 99.9))
    assert stall.judge(records, 112.0, limit=LIMIT) is None                     # a slow save: its own timeout
    found = stall.judge(records, 112.0, limit=LIMIT, stopped={1})
    assert (found.culprits, found.phase, found.waiting) == ((1,), "save", (0,))
    # stopped inside the gradient sum itself (after handing in its share): the culprit, not one more waiter
    found = stall.judge(slots((0, "sum", 41, 100.0), (1, "sum", 41, 99.9)), 112.0, limit=LIMIT, stopped={1})
    assert (found.culprits, found.phase, found.waiting) == ((1,), "sum", (0,))


def test_nothing_is_judged_before_the_generation_has_a_step_time():
    assert stall.limit_s(None, floor_s=10.0, multiplier=10.0) is None
    assert stall.judge(slots((0, "sum", 1, 0.0), (1, "compute", 1, 0.0)), 1e6, limit=None) is None
    assert stall.limit_s(0.05, floor_s=10.0, multiplier=10.0) == 10.0      # the floor, seconds where hang waits 60
    assert stall.limit_s(3.0, floor_s=10.0, multiplier=10.0) == 30.0      # a slow step's p99 x 10


def test_the_incident_text_names_the_rank_the_phase_and_who_waits():
    found = stall.judge(slots((0, "sum", 41, 100.0), (1, "compute", 41, 99.9)), 110.5, limit=LIMIT)
    assert found.describe() == ("rank 1 stuck 10.6 s in compute of step 41 (limit 10.0 s); rank(s) [0] wait for it "
                                "in the gradient sum")
