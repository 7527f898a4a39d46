"""The goodput ledger (daemon.judging.goodput), fed literal times: each cause counted, steps trained again after
a rollback, paused time, claims never more than the wall time, a daemon's death, and the ledger rebuilt from
the event log equal to the live one."""
import pytest

from daemon.judging.goodput import CAUSES, Goodput
from daemon.records.state_rebuild import state_from_events

pytestmark = pytest.mark.unit

T0 = 1_000_000.0


def _generation(g: Goodput, at: float, first: int, last: int, *, step_s=1.0, data_wait_s=0.0, start=2.0,
                restore=1.0, compile_s=5.0) -> float:
    """A generation opened at `at`: start, restore, compile (its first step), then steps first+1..last one
    `step_s` apart. Returns the time of its last step."""
    g.open_generation(at)
    g.phase("restore", at + start)
    g.phase("compile", at + start + restore)
    t = at + start + restore + compile_s
    g.step(t, step=first, step_s=compile_s, data_wait_s=0.0)
    for s in range(first + 1, last + 1):
        t += step_s
        g.step(t, step=s, step_s=step_s, data_wait_s=data_wait_s)
    return t


def _sums_to_wall(g: Goodput, wall: float) -> None:
    assert g.wall_s == pytest.approx(wall)
    assert g.productive_s + sum(g.badput_s.values()) + g.slack_s == pytest.approx(wall)


def test_a_clean_generation_is_start_restore_compile_then_productive_steps():
    g = Goodput()
    g.resume(T0, ended=False)
    end = _generation(g, T0, 1, 11)
    assert g.badput_s["start"] == pytest.approx(2.0) and g.badput_s["restore"] == pytest.approx(1.0)
    assert g.badput_s["compile"] == pytest.approx(5.0)
    assert g.productive_s == pytest.approx(10.0) and g.steps == 11 and g.retrained_steps == 0
    assert g.ratio == pytest.approx(10.0 / 18.0)
    _sums_to_wall(g, end - T0)


def test_the_loop_work_between_steps_goes_with_the_step_and_the_ram_tier_saves_are_checkpoint_time():
    """A rank's step takes 0.8 s in the step and 0.1 s in the loop around it (its events, the commands), and
    the RAM tier's save after each step blocks 0.1 s: nothing is `other`, a retrained step's loop work is
    retrained time, and the RAM saves are the checkpoint's."""
    g = Goodput()
    g.resume(T0, ended=False)
    t = _generation(g, T0, 1, 1)
    for s in range(2, 7):
        t += 1.0
        g.step(t, step=s, step_s=0.8, data_wait_s=0.0, loop_s=0.1, memory_save_s=0.1)
    for s in (5, 6):                              # a rollback: trained again
        t += 1.0
        g.step(t, step=s, step_s=0.8, data_wait_s=0.0, loop_s=0.1, memory_save_s=0.1)
    g.generation_over(t)
    assert g.productive_s == pytest.approx(5 * 0.9)
    assert g.badput_s["retrained"] == pytest.approx(2 * 0.9)
    assert g.badput_s["checkpoint"] == pytest.approx(7 * 0.1)
    assert g.badput_s["other"] == pytest.approx(0.0, abs=1e-9)
    _sums_to_wall(g, t - T0)


def test_data_waits_checkpoint_stalls_validation_and_the_gaps_between_steps():
    g = Goodput()
    g.resume(T0, ended=False)
    t = _generation(g, T0, 1, 5, step_s=1.0, data_wait_s=0.25)
    g.claim("checkpoint", 2.0, t + 2.0)          # a save staged after step 5
    g.claim("validation", 3.0, t + 5.5)          # then a validation; 0.5 s no rank said anything about
    g.step(t + 6.5, step=6, step_s=1.0, data_wait_s=0.0)
    assert g.slack_s == pytest.approx(0.5) and g.badput_s["other"] == 0      # held a while for late claims
    g.generation_over(t + 6.5)
    assert g.badput_s["data_wait"] == pytest.approx(4 * 0.25)
    assert g.productive_s == pytest.approx(4 * 0.75 + 1.0)
    assert g.badput_s["checkpoint"] == pytest.approx(2.0) and g.badput_s["validation"] == pytest.approx(3.0)
    assert g.badput_s["other"] == pytest.approx(0.5)
    _sums_to_wall(g, t + 6.5 - T0)


def test_steps_at_or_below_the_highest_trained_are_retrained_after_a_rollback():
    g = Goodput()
    g.resume(T0, ended=False)
    t = _generation(g, T0, 1, 30)
    g.generation_over(t + 4.0)                  # a crash seen 4 s after step 30 (its detection and teardown)
    g.open_generation(t + 6.0)                  # the decision and the backoff: teardown too
    t2 = _generation(g, t + 6.0, 21, 40)        # back to checkpoint 20: steps 21-30 again, 31-40 new
    assert g.badput_s["teardown"] == pytest.approx(6.0)
    assert g.retrained_steps == 10 and g.steps == 40
    assert g.badput_s["retrained"] == pytest.approx(9.0)          # 22-30 (21 compiled)
    assert g.productive_s == pytest.approx(29.0 + 10.0)
    assert g.restart_s() == pytest.approx(6.0 + 2 * (2.0 + 1.0 + 5.0))
    _sums_to_wall(g, t2 - T0)


def test_paused_time_and_waiting_for_machines_are_their_own_causes():
    g = Goodput()
    g.resume(T0, ended=False)
    t = _generation(g, T0, 1, 5)
    g.status("paused", t + 1.0)
    g.status("running", t + 61.0)               # resumed a minute later
    g.step(t + 62.0, step=6, step_s=1.0, data_wait_s=0.0)
    assert g.badput_s["paused"] == pytest.approx(60.0)
    g.waiting(t + 63.0)
    g.status("running", t + 73.0)
    assert g.badput_s["waiting_for_machines"] == pytest.approx(10.0)
    assert g.mode == "training"
    _sums_to_wall(g, t + 73.0 - T0)


def test_unclaimed_training_time_is_held_for_late_claims_then_called_other():
    g = Goodput()
    g.resume(T0, ended=False)
    t = _generation(g, T0, 1, 1)
    g.settle(t + 0.5)                             # a tick: no step came in yet
    g.step(t + 0.6, step=2, step_s=0.55, data_wait_s=0.0)    # late: the time the tick held goes to the step
    assert g.productive_s == pytest.approx(0.55) and g.badput_s["other"] == 0
    g.settle(t + 10.6)                            # ten seconds without a claim: all but SLACK_S is other
    assert g.badput_s["other"] == pytest.approx(10.05 - 2.0) and g.slack_s == pytest.approx(2.0)
    _sums_to_wall(g, t + 10.6 - T0)


def test_claims_beyond_the_wall_time_wait_for_the_next_interval():
    g = Goodput()
    g.resume(T0, ended=False)
    t = _generation(g, T0, 1, 1)
    for s in range(2, 6):                        # four steps' events arriving in one tick
        g.step(t + 1.0, step=s, step_s=1.0, data_wait_s=0.0)
    _sums_to_wall(g, 1.0 + t - T0)
    assert g.productive_s == pytest.approx(1.0) and sum(g.pending.values()) == pytest.approx(3.0)
    g.step(t + 5.0, step=6, step_s=1.0, data_wait_s=0.0)
    assert g.productive_s == pytest.approx(5.0) and not g.pending
    _sums_to_wall(g, t + 5.0 - T0)


def test_a_dead_daemons_absence_is_daemon_down_and_a_stopped_runs_is_not_counted():
    g = Goodput()
    g.resume(T0, ended=False)
    t = _generation(g, T0, 1, 10)
    saved = Goodput.from_dict(g.to_dict())        # state.json as a daemon killed with -9 left it
    assert saved.resume(t + 30.0, ended=False) == pytest.approx(30.0)
    assert saved.badput_s["daemon_down"] == pytest.approx(30.0) and saved.productive_s == g.productive_s
    _sums_to_wall(saved, t + 30.0 - T0)
    stopped = Goodput.from_dict(g.to_dict())
    assert stopped.resume(t + 3600.0, ended=True) == 0.0      # stopped on purpose: an hour that is no run time
    _sums_to_wall(stopped, t - T0)


def test_every_cause_is_known_from_the_start_and_the_largest_losses_lead():
    g = Goodput()
    assert set(g.badput_s) == set(CAUSES) and g.ratio is None
    g.resume(T0, ended=False)
    _generation(g, T0, 1, 3, compile_s=9.0)
    assert [c for c, _ in g.largest_losses(2)] == ["compile", "start"]


def test_a_malformed_ledger_loads_as_what_can_be_read():
    g = Goodput.from_dict({"productive_s": "x", "badput_s": {"paused": -1, "compile": 2.5}, "high_step": True,
                           "mode": "dancing", "pending": {"nonsense": 1.0, "productive": 0.5}})
    assert g.productive_s == 0.0 and g.badput_s["compile"] == 2.5 and g.badput_s["paused"] == 0.0
    assert g.high_step == 0 and g.mode == "start" and g.pending == {"productive": 0.5}


def test_the_ledger_rebuilt_from_the_event_log_is_the_live_one():
    g = Goodput()
    g.resume(T0, ended=False)
    t = _generation(g, T0, 1, 20)
    events = [{"event": "generation_start", "generation": 1},
              {"event": "goodput", "generation": 1, "step": 20, **g.to_dict()}]
    state, _ = state_from_events(events)
    assert state.goodput == g.to_dict()
    rebuilt = Goodput.from_dict(state.goodput)
    rebuilt.resume(t + 5.0, ended=False)
    g.resume(t + 5.0, ended=False)
    assert rebuilt.to_dict() == g.to_dict()
