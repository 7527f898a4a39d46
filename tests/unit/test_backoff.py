"""The wait before the next generation: none for a fault that does not repeat, growing for one that does."""
import pytest

from contracts.config import load_config
from daemon.acting.decisions import Backoff, Decision
from daemon.judging.incidents import Incident, IncidentRecord, Kind, Restart, Rollback

CFG = load_config(None, [])


def _decision(action) -> Decision:
    incident = Incident(kind=Kind.CRASH, first_step=10, last_step=10, rank=0)
    return Decision(action=action, record=IncidentRecord(incident=incident, generation=1, unix_s=0.0, action=action), cfg=CFG, resume_step=10)


RESTART = _decision(Restart("crash"))
ROLLBACK = _decision(Rollback("non-finite loss", checkpoint_step=10, skip=None, lr_overrides=()))


def test_the_first_restart_since_progress_and_every_rollback_start_at_once():
    backoff = Backoff(CFG.health)
    assert backoff.delay_s(RESTART, restarts_without_progress=0) == 0.0
    assert backoff.delay_s(RESTART, restarts_without_progress=1, first_restart=True) == 0.0   # lost before any save
    assert backoff.delay_s(ROLLBACK, restarts_without_progress=0) == 0.0
    assert backoff.delay_s(ROLLBACK, restarts_without_progress=3) == 0.0


@pytest.mark.parametrize("repeats,low", [(1, 1.0), (2, 2.0), (3, 4.0), (6, 32.0)])
def test_a_restart_that_repeats_without_progress_waits_exponentially_jittered(repeats, low):
    delay = Backoff(CFG.health).delay_s(RESTART, restarts_without_progress=repeats)
    assert low <= delay <= low + 1.0                       # initial 1 s doubling, up to 1 s of jitter


def test_the_wait_is_capped():
    assert Backoff(CFG.health).delay_s(RESTART, restarts_without_progress=20) == CFG.health.restart_backoff_max_s


def test_the_run_state_says_whether_a_restart_is_the_run_s_first():
    from daemon.records.state import RunState
    state = RunState()
    state.restarts_without_progress = 1
    assert Backoff(CFG.health).after(RESTART, state) == 0.0          # lost before the first checkpoint
    state.restarts = 1
    assert Backoff(CFG.health).after(RESTART, state) >= 1.0          # and again, without progress
