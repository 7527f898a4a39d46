"""The automatic checkpoint interval: Young/Daly's sqrt(2 C MTBF) from the measured cost of a save and
the failures seen, in steps, bounded, moved only by more than a tenth."""
import math

import pytest

from contracts.config import load_config
from daemon.judging.cadence import Cadence, interval_args
from tests.unit.steps import step_event


def cadence(*sets, saved=None):
    return Cadence(load_config(None, ["checkpoint.interval_steps=auto", *sets]).checkpoint, saved)


def trained(c, steps, step_s=0.1, first=1):
    for s in range(first, first + steps):
        c.step(step_event(step=s, loss=2.0, step_s=step_s), compiled=s == first)


def test_the_interval_is_the_square_root_of_twice_the_save_cost_times_the_mtbf():
    c = cadence("checkpoint.auto_mtbf_prior_s=3600")
    trained(c, 51)                                       # 50 steps of 0.1 s after the compiling first
    c.staged("disk", 50, 2.0)
    c.committed("disk", 50)
    change = c.retune(failures=0)
    mtbf = 3600 + 5.0
    assert change["mtbf_s"] == pytest.approx(mtbf)
    assert change["changed"] == {"interval_steps": round(math.sqrt(2 * 2.0 * mtbf) / 0.1)}
    # failures shorten it: four of them divide the MTBF by five
    assert c.retune(failures=4)["changed"]["interval_steps"] == round(math.sqrt(2 * 2.0 * mtbf / 5) / 0.1)


def test_the_steps_a_save_slows_count_in_its_cost():
    c = cadence("checkpoint.auto_mtbf_prior_s=3600")
    trained(c, 51)
    c.staged("disk", 50, 1.0)
    for s in range(52, 56):                              # the writer competes: 4 steps 0.05 s slower
        c.step(step_event(step=s, loss=2.0, step_s=0.15), compiled=False)
    c.committed("disk", 50)
    assert c.retune(failures=0)["tiers"]["disk"]["cost_s"] == pytest.approx(1.2)


def test_bounds_hysteresis_and_a_tier_left_fixed():
    c = cadence("checkpoint.auto_mtbf_prior_s=1", "checkpoint.auto_min_interval_steps=25")
    trained(c, 11)
    c.staged("disk", 10, 0.001)
    c.committed("disk", 10)
    assert c.retune(failures=0)["changed"] == {"interval_steps": 25}      # the floor
    assert c.retune(failures=0) is None                                     # nothing moved
    c.staged("memory", 11, 0.001)
    c.committed("memory", 11)
    assert c.retune(failures=0) is None                                     # the RAM tier is not "auto"
    assert interval_args(c.ck, c.to_dict()) == {"interval_steps": 25}
    assert interval_args(c.ck, {}) == {}                                    # none decided yet


def test_its_state_survives_a_daemon_restart():
    c = cadence("checkpoint.memory_interval_steps=auto")
    trained(c, 21)
    c.staged("memory", 20, 0.01)
    c.committed("memory", 20)
    c.retune(failures=0)
    again = cadence("checkpoint.memory_interval_steps=auto", saved=c.to_dict())
    assert again.to_dict() == c.to_dict() and again.interval == c.interval
