import json
import math

import pytest

from daemon.protocol import FINAL_EXIT_CODES, ExitCode, ExitEvent, StepEvent, decode_event


def test_exit_codes_match_the_design_registry():
    assert {c.name: int(c) for c in ExitCode} == {
        "OK": 0, "SOAK_FAILED": 1, "USAGE": 2, "GAVE_UP_CRASH_LOOP": 3, "GAVE_UP_NUMERICS": 4, "LOCKED": 5,
        "DATA_ERROR": 65, "NO_DAEMON": 69, "CANT_CREATE": 73, "INTERNAL_ERROR": 70, "CONFIG_ERROR": 78}
    assert ExitCode.INTERNAL_ERROR not in FINAL_EXIT_CODES
    # the daemon's final codes (the unit's RestartPreventExitStatus=); 1 and 69 are only the CLI's
    assert set(FINAL_EXIT_CODES) == set(ExitCode) - {ExitCode.INTERNAL_ERROR, ExitCode.SOAK_FAILED, ExitCode.NO_DAEMON,
                                                     ExitCode.CANT_CREATE}


def _step(**kw):
    base = dict(rank=1, generation=2, step=3, loss=2.5, grad_norm=0.7, loss_scale=1.0, lr=1e-3,
                lr_multiplier=1.0, skipped=False, sample_start=16, sample_end=24, tokens=512, step_s=0.1,
                data_wait_s=0.001, tokens_per_s=5120.0)
    base.update(kw)
    return StepEvent(**base)


@pytest.mark.parametrize("loss", [2.5, float("nan"), float("inf"), float("-inf")])
def test_step_event_round_trips_as_strict_json(loss):
    event = _step(loss=loss, grad_norm=float("nan"), skipped=True)
    text = event.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    back = decode_event(text)
    assert isinstance(back, StepEvent)
    assert (math.isnan(back.loss) if math.isnan(loss) else back.loss == loss)
    assert back.skipped and math.isnan(back.grad_norm) and back.sample_end == 24


def test_exit_event_round_trips():
    e = ExitEvent(rank=0, generation=0, step=10, reason="finished", params_sha256="ab")
    assert decode_event(e.to_json()) == e


@pytest.mark.parametrize("line", ['{"kind": "gossip"}', "[1, 2]", '"step"', "not json"])
def test_unknown_lines_are_refused(line):
    with pytest.raises(ValueError):
        decode_event(line)
