"""The straggler detector on literal step events: the rank the others wait for is named with its
score; balanced ranks with noise stay silent; it acts only when configured and after its time."""
import random

import pytest

from contracts.config import load_config
from contracts.protocol import StepEvent
from daemon.judging.incidents import Kind
from daemon.judging.straggler import StragglerDetector


def cfg(*sets):
    return load_config(None, ["health.straggler_window_steps=10", *sets]).health


def event(rank, step, *, host, sync, compute=0.1):
    return StepEvent(rank=rank, generation=1, step=step, loss=2.0, grad_norm=1.0, loss_scale=1.0, lr=1e-3,
                     lr_multiplier=1.0, skipped=False, sample_start=0, sample_end=8, tokens=512,
                     step_s=compute + sync, data_wait_s=0.0, tokens_per_s=1.0, host_s=host, sync_s=sync)


def run(detector, steps, slow_rank=None, delay=0.3, ranks=(0, 1, 2, 3), noise=0.0, seed=0):
    """Synchronous steps: every rank leaves the collective together, so a rank that spends `delay`
    more outside the step makes the others wait exactly that long inside it."""
    rnd = random.Random(seed)
    out = []
    for step in steps:
        hosts = {r: 0.01 + rnd.uniform(0, noise) + (delay if r == slow_rank else 0.0) for r in ranks}
        latest = max(hosts.values())
        for r in ranks:
            out += detector.observe(event(r, step, host=hosts[r], sync=0.02 + latest - hosts[r]))
    return out


def test_the_rank_the_others_wait_for_is_named_once_with_its_score():
    found = run(StragglerDetector(cfg(), [0, 1, 2, 3]), range(1, 40), slow_rank=2)
    (warning,) = found
    assert warning.kind is Kind.STRAGGLER and warning.rank == 2 and not warning.needs_action
    scores = warning.evidence["scores"]
    assert scores["2"] < 0.5 and all(scores[r] == 1.0 for r in ("0", "1", "3"))
    assert warning.evidence["lag_s"] == pytest.approx(0.3, abs=1e-6)
    assert warning.first_step == 11            # step 1 compiles; steps 2..11 fill the window of 10


@pytest.mark.parametrize("noise", [0.0, 0.02])
def test_balanced_ranks_stay_silent(noise):
    assert run(StragglerDetector(cfg(), [0, 1, 2, 3]), range(1, 200), noise=noise) == []


def test_a_short_burst_of_slowness_is_not_a_straggler():
    d = StragglerDetector(cfg(), [0, 1])
    run(d, range(1, 30), ranks=(0, 1))
    assert run(d, range(30, 34), slow_rank=1, ranks=(0, 1)) == []      # 4 of 10 steps: the median holds
    assert run(d, range(34, 60), ranks=(0, 1)) == []


def test_restart_only_when_configured_and_after_its_time():
    warn_only = run(StragglerDetector(cfg("health.straggler_restart_after_s=1"), [0, 1]), range(1, 60),
                    slow_rank=1, ranks=(0, 1))
    assert [i.needs_action for i in warn_only] == [False]
    d = StragglerDetector(cfg('health.straggler_action="restart"', "health.straggler_restart_after_s=2"), [0, 1])
    found = run(d, range(1, 60), slow_rank=1, ranks=(0, 1))
    assert [i.needs_action for i in found] == [False, True]
    acted = found[1]
    assert acted.rank == 1 and acted.evidence["slow_for_s"] >= 2 and acted.kind.is_process_fault
    # steps of 0.43 s (median over the ranks): slow from step 11 (window full); 2 s of it by step 15
    assert acted.first_step == 15


def test_one_rank_has_no_stragglers():
    assert run(StragglerDetector(cfg(), [0]), range(1, 50), slow_rank=0, ranks=(0,)) == []


def test_the_config_is_checked():
    from contracts.errors import ConfigError

    with pytest.raises(ConfigError, match="straggler_action"):
        cfg('health.straggler_action="drop"')
