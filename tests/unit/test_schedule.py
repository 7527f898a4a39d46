import json
import math

import pytest

from engine.training.schedule import LrOverride, base_lr_at, lr_at

SCHED = dict(lr=1.0, min_lr=0.1, warmup_steps=10, cosine_steps=100)


@pytest.mark.parametrize("step,expected", [
    (1, 0.1), (5, 0.5), (10, 1.0),                     # linear warmup reaches the peak at its last step
    (60, 0.1 + 0.9 * 0.5),                             # half-way down the cosine
    (110, 0.1), (500, 0.1),                            # the floor, and it stays there
])
def test_warmup_then_cosine_to_floor(step, expected):
    assert base_lr_at(step, **SCHED) == pytest.approx(expected)


def test_no_warmup_starts_at_peak():
    assert base_lr_at(1, lr=1.0, min_lr=0.0, warmup_steps=0, cosine_steps=10) == pytest.approx(
        0.5 * (1 + math.cos(math.pi * 0.1)))


def test_step_numbers_start_at_one():
    with pytest.raises(ValueError):
        base_lr_at(0, **SCHED)


@pytest.mark.parametrize("step,multiplier", [
    (49, 1.0), (50, 0.5), (59, 0.5),                   # held for 10 steps from step 50
    (60, 0.5), (65, 0.75), (69, 0.95),                 # then ramped back over 10 steps
    (70, 1.0), (1000, 1.0),
])
def test_override_holds_then_ramps_back(step, multiplier):
    o = LrOverride(start_step=50, factor=0.5, hold_steps=10, ramp_steps=10)
    assert o.multiplier(step) == pytest.approx(multiplier)
    assert lr_at(step, **SCHED, overrides=[o]) == pytest.approx((base_lr_at(step, **SCHED) * multiplier, multiplier))


def test_overrides_compound():
    a = LrOverride(start_step=10, factor=0.5, hold_steps=100, ramp_steps=0)
    b = LrOverride(start_step=20, factor=0.5, hold_steps=100, ramp_steps=0)
    assert lr_at(15, **SCHED, overrides=[a, b])[1] == 0.5
    assert lr_at(25, **SCHED, overrides=[a, b])[1] == 0.25


@pytest.mark.parametrize("kwargs", [
    dict(start_step=1, factor=0.0, hold_steps=1, ramp_steps=1),
    dict(start_step=1, factor=1.5, hold_steps=1, ramp_steps=1),
    dict(start_step=0, factor=0.5, hold_steps=1, ramp_steps=1),
    dict(start_step=1, factor=0.5, hold_steps=-1, ramp_steps=1),
])
def test_invalid_overrides_are_refused(kwargs):
    with pytest.raises(ValueError):
        LrOverride(**kwargs)


def test_lr_is_the_same_directly_or_after_a_restart():
    """A restart carries only the overrides (as JSON) and the step: every later lr is identical."""
    overrides = [LrOverride(start_step=30, factor=0.5, hold_steps=20, ramp_steps=15),
                 LrOverride(start_step=45, factor=0.25, hold_steps=5, ramp_steps=5)]
    direct = [lr_at(s, **SCHED, overrides=overrides) for s in range(1, 200)]
    saved = json.dumps([o.to_dict() for o in overrides])
    restored = [LrOverride.from_dict(d) for d in json.loads(saved)]
    for restart_at in (1, 31, 47, 120):
        resumed = [lr_at(s, **SCHED, overrides=restored) for s in range(restart_at, 200)]
        assert resumed == direct[restart_at - 1:]
