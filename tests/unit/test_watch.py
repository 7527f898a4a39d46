"""The watch over a generation, driven with literal times and events: no processes, no clock, no files."""
import math
import signal

import pytest

from contracts.config import load_config
from contracts.protocol import CheckpointEvent, ExitEvent, PhaseEvent
from daemon.judging import watch
from daemon.judging.health import HealthMonitor
from daemon.judging.incidents import Kind
from daemon.judging.requests import Request
from daemon.judging.watch import (
    Committed,
    DumpStacks,
    Failed,
    Finished,
    IllegalTransitionError,
    Note,
    Pause,
    Phase,
    Progress,
    Released,
    Send,
    Status,
    Stopped,
    Warned,
    Watch,
    WorkerFailed,
    idle_control,
)
from tests.unit.steps import step_event

# start 5 s, compile 20 s, training floor 3 s (or 10 x p99), checkpoint 30 s; stop timeout 8 s; release after 60 s
CFG = load_config(None, ["health.hang_start_timeout_s=5", "health.hang_compile_timeout_s=20",
                         "health.hang_floor_s=3", "health.hang_step_multiplier=10",
                         "health.hang_checkpoint_timeout_s=30", "run.stop_timeout_s=8",
                         "run.pause_release_after_s=60", "train.steps=100", "parallel.dp=2", "train.micro_batch=4"])


def make(cfg=CFG, ranks=(0, 1), now=0.0, **kw):
    return Watch(cfg, generation=1, ranks=ranks, now=now, log_paths={r: f"rank-{r}.log" for r in ranks},
                 monitor=HealthMonitor(cfg.health, precision=cfg.train.precision), **kw)


def phase(w, rank, name, now, step=0):
    w.on_event(PhaseEvent(rank=rank, generation=1, phase=name, step=step), now)


def steps(w, first, last, now, dt=0.1, ranks=(0, 1), loss=2.0, **kw):
    """Steps first..last on every rank, dt apart from `now`; returns the time after the last."""
    for i, s in enumerate(range(first, last + 1)):
        for r in ranks:
            w.on_event(step_event(step=s, loss=loss, rank=r, **kw), now + i * dt)
    return now + (last - first) * dt


def kinds(effects, cls):
    return [e for e in effects if isinstance(e, cls)]


def test_a_clean_generation_finishes_when_every_rank_exits_0():
    w = make()
    t = steps(w, 1, 100, 1.0)
    for r in (0, 1):
        w.on_event(ExitEvent(rank=r, generation=1, step=100, reason="finished"), t)
        assert w.tick(t) is None or r == 1
        w.on_exit(r, 0, t)
    assert w.tick(t) == Finished(100)


def test_a_crash_is_named_with_its_rank_step_and_cause():
    w = make()
    t = steps(w, 1, 12, 0.5)
    w.on_exit(1, 1, t)
    out = w.tick(t)
    assert isinstance(out, Failed) and out.incident.kind is Kind.CRASH
    assert (out.incident.rank, out.incident.first_step, out.incident.exit_code) == (1, 12, 1)
    (note,) = kinds(w.drain(), Note)
    assert note.event == "crash" and note.fields["cause"] == "exit code 1" and note.fields["log"] == "rank-1.log"


def test_death_by_signal_is_a_crash_and_a_final_code_is_passed_on():
    w = make()
    w.on_exit(0, -signal.SIGKILL, 1.0)
    assert w.tick(1.0).incident.detail == "rank 0: killed by signal 9"
    w = make()
    w.on_exit(1, 78, 1.0)
    out = w.tick(1.0)
    assert isinstance(out, WorkerFailed) and (out.code, out.rank) == (78, 1) and "rank-1.log" in out.detail


@pytest.mark.parametrize("oom_kills,code,line,kind", [
    (1, -signal.SIGKILL, None, Kind.OOM),            # the cgroup counted an OOM kill
    (1, 128 + signal.SIGKILL, None, Kind.OOM),
    (0, -signal.SIGKILL, None, Kind.CRASH),          # a SIGKILL from someone else: a crash
    (0, 1, "Device(id:0) memory isn't enough", Kind.OOM),    # the device allocator said so
    (0, 1, None, Kind.CRASH),
])
def test_out_of_memory_is_told_from_a_sigkill(oom_kills, code, line, kind):
    w = make()
    steps(w, 1, 7, 0.0)
    w.on_exit(0, code, 1.0, oom_kills=oom_kills, peak_bytes=123, device_oom_line=line)
    out = w.tick(1.0)
    assert out.incident.kind is kind and out.incident.first_step == 7
    if kind is Kind.OOM:
        note = kinds(w.drain(), Note)[0]
        assert note.event == "oom" and note.fields["signal"].startswith("cgroup" if oom_kills else "device")


@pytest.mark.parametrize("last_phase,silent_from,hung_at,limit", [
    ("starting", 0.0, 5.01, 5.0),       # nothing heard since the start
    ("restore", 1.0, 6.01, 5.0),
    ("compile", 1.0, 21.01, 20.0),
    ("checkpoint", 2.0, 32.01, 30.0),
])
def test_a_hang_in_each_phase_uses_that_phase_s_timeout(last_phase, silent_from, hung_at, limit):
    w = make()
    if last_phase != "starting":
        phase(w, 1, last_phase, silent_from)
        phase(w, 0, "train", hung_at)          # rank 0 keeps talking; rank 1 is the hung one
    else:
        phase(w, 0, "restore", hung_at)
    assert w.tick(hung_at - 0.02) is None
    out = w.tick(hung_at)
    assert out.incident.kind is Kind.HANG and out.incident.rank == 1
    assert out.incident.evidence["phase"] == last_phase and out.incident.evidence["timeout_s"] == limit
    effects = [e for e in w.drain() if not isinstance(e, Phase)]     # the restore phase's, for the goodput ledger
    assert effects[0] == DumpStacks((0, 1)) and kinds(effects, Note)[0].event == "hang"


def test_a_hang_while_training_is_judged_by_the_step_times_seen():
    w = make()
    t = steps(w, 1, 50, 0.0, dt=0.5, step_s=0.5)     # p99 0.5 s x 10 = 5 s > the 3 s floor
    assert w.tick(t + 4.9) is None
    out = w.tick(t + 5.01)
    assert out.incident.kind is Kind.HANG and out.incident.first_step == 50
    assert out.incident.evidence["timeout_s"] == 5.0


def test_paused_ranks_never_hang_and_exited_ranks_are_not_judged():
    w = make()
    steps(w, 1, 3, 0.0)
    w.on_control(Request("pause", {}, "pause"), 0.5)
    phase(w, 0, "paused", 1.0, 4)
    phase(w, 1, "paused", 1.0, 4)
    assert w.tick(50.0) is None


def test_pause_then_resume_at_an_agreed_step():
    w = make()
    steps(w, 1, 10, 0.0)
    w.on_control(Request("pause", {}, "pause"), 1.0)
    assert w.pause is Pause.PAUSING and w.drain()[-2:] == [Status("pausing"), Send("pause", {})]
    phase(w, 0, "paused", 1.5, 11)
    assert w.pause is Pause.PAUSING                          # rank 1 still on its way
    phase(w, 1, "paused", 1.6, 11)
    assert w.pause is Pause.PAUSED
    effects = w.drain()
    assert Status("paused", "paused at step 11") in effects
    assert kinds(effects, Note)[0].fields["rank_steps"] == {0: 11, 1: 11}
    w.on_control(Request("pause", {}, "pause.2"), 2.0)       # already paused: ignored, said so
    assert kinds(w.drain(), Note)[0].fields["detail"] == "already paused"
    w.on_control(Request("resume", {}, "resume"), 3.0)
    assert w.pause is Pause.RUNNING and w.drain() == [Status("running"), Send("resume", {})]
    w.on_control(Request("resume", {}, "resume.2"), 3.5)
    assert kinds(w.drain(), Note)[0].fields["detail"] == "not paused"


def test_ranks_paused_and_resumed_by_another_machines_decider_are_said_to_be_so():
    """A follower's daemon never sees the request (the decider writes the ranks' commands for all):
    its ranks holding is its pause, their next step its resume, each said once, with who did it."""
    w = make()
    steps(w, 1, 10, 0.0)
    phase(w, 0, "paused", 1.5, 11)
    assert w.pause is Pause.RUNNING                          # one rank holding is not yet a pause
    phase(w, 1, "paused", 1.6, 11)
    assert w.pause is Pause.PAUSED
    effects = w.drain()
    assert Status("paused", "paused at step 11") in effects
    (note,) = kinds(effects, Note)
    assert note.event == "paused" and note.fields["by"] == "the decider" and note.fields["rank_steps"] == {0: 11, 1: 11}
    assert w.tick(30.0) is None                              # held ranks never hang
    w.on_event(step_event(step=12, loss=2.0, rank=0), 40.0)
    assert w.pause is Pause.RUNNING
    effects = w.drain()
    assert Status("running", "resumed at step 12") in effects
    assert [(n.event, n.fields["by"]) for n in kinds(effects, Note)] == [("resumed", "the decider")]
    w.on_event(step_event(step=12, loss=2.0, rank=1), 40.1)
    assert not kinds(w.drain(), Note)                        # said once


def test_paused_too_long_the_ranks_are_released_and_a_resume_between_generations_restarts():
    w = make()
    w.on_control(Request("pause", {}, "pause"), 1.0)
    phase(w, 0, "paused", 2.0, 5)
    phase(w, 1, "paused", 2.0, 5)
    w.drain()
    assert w.tick(62.0) is None and w.pause is Pause.PAUSED
    assert w.tick(62.01) is None and w.pause is Pause.RELEASING and w.drain() == [Send("release")]
    for r in (0, 1):
        w.on_event(ExitEvent(rank=r, generation=1, step=5, reason="released"), 63.0)
        w.on_exit(r, 0, 63.0)
    assert w.tick(63.0) == Released(5)
    # no ranks now: a resume starts the next generation, a stop ends the daemon, the rest waits
    assert idle_control(Request("resume", {}, "resume"), paused=True).resume
    assert idle_control(Request("stop", {"reason": "upgrade"}, "stop"), paused=True).stop_reason == \
        "control file stop: upgrade"
    ignored = idle_control(Request("checkpoint", {}, "checkpoint"), paused=True)
    assert not ignored.resume and ignored.stop_reason is None and ignored.note.event == "control_ignored"
    assert idle_control(Request("resume", {}, "resume"), paused=False).note is not None   # during a backoff


def test_illegal_pause_transitions_raise():
    w = make()
    with pytest.raises(IllegalTransitionError):
        w._move(Pause.PAUSED)


def test_stop_checkpoints_then_ends_and_is_forced_after_its_timeout():
    w = make()
    steps(w, 1, 5, 0.0)
    w.on_control(Request("stop", {"reason": "maintenance"}, "stop"), 1.0)
    effects = w.drain()
    assert effects[-1] == Send("stop") and "maintenance" in kinds(effects, Note)[0].fields["detail"]
    w.request_stop("signal SIGTERM", 1.5)                    # asked again: sent once
    assert w.drain() == []
    phase(w, 0, "checkpoint", 1.2, 6)                         # the final save never ends
    phase(w, 1, "checkpoint", 1.2, 6)
    assert w.tick(9.0) is None
    out = w.tick(9.01)
    assert out == Stopped(None, forced=True) and kinds(w.drain(), Note)[0].event == "stop_forced"


def test_a_stop_that_completes_is_stopped_and_a_second_signal_forces_it():
    w = make(stop_reason="signal SIGTERM")                   # asked for before the generation started
    assert w.drain()[-1] == Send("stop")
    for r in (0, 1):
        w.on_event(ExitEvent(rank=r, generation=1, step=6, reason="stopped"), 2.0)
        w.on_exit(r, 0, 2.0)
    assert w.tick(2.0) == Stopped(6)
    w = make()
    w.request_stop("signal SIGTERM", 1.0)
    w.request_stop("signal SIGTERM", 1.2, force=True)
    assert w.tick(1.2) == Stopped(None, forced=True)


def test_a_loss_spike_ends_the_generation_with_a_numerical_incident():
    cfg = load_config(None, ["health.loss_spike_warmup_steps=10", "health.loss_spike_window_steps=10"])
    w = make(cfg, ranks=(0,))
    t = steps(w, 1, 29, 0.0, ranks=(0,), loss=3.0)
    assert w.tick(t) is None
    steps(w, 30, 32, t, ranks=(0,), loss=12.0)
    out = w.tick(t + 1)
    assert out.incident.kind is Kind.LOSS_SPIKE and out.incident.first_step == 30
    assert watch.teardown_grace_s(out, 10.0) == 0.0           # its state is thrown away: kill at once
    effects = w.drain()
    assert kinds(effects, Note)[-1].event == "incident_detected"
    assert [p.event.step for p in kinds(effects, Progress)] == list(range(1, 33))


def test_only_the_first_rank_feeds_the_detectors_and_warnings_are_not_outcomes():
    cfg = load_config(None, ["health.loss_spike_warmup_steps=10", "health.loss_spike_window_steps=10",
                             "health.throughput_window_steps=5", "parallel.dp=2", "train.micro_batch=4"])
    w = make(cfg)
    steps(w, 1, 20, 0.0, ranks=(1,), loss=50.0)               # rank 1's view is never judged
    steps(w, 1, 20, 0.0, ranks=(0,), tokens_per_s=10000.0)
    steps(w, 21, 30, 2.0, ranks=(0,), tokens_per_s=1000.0)    # a throughput drop: a warning only
    assert w.tick(3.0) is None
    warned = kinds(w.drain(), Warned)
    assert [x.incident.kind for x in warned] == [Kind.THROUGHPUT_REGRESSION]


def test_progress_is_logged_every_10_s_and_told_to_systemd_every_2_s():
    w = make(ranks=(0,))
    steps(w, 1, 100, 0.0, dt=0.5, ranks=(0,))                # 49.5 s of steps
    progress = kinds(w.drain(), Progress)
    assert [p.event.step for p in progress if p.log] == [1, 21, 41, 61, 81, 100]   # and the last step
    assert [p.event.step for p in progress if p.notify][:3] == [1, 5, 9]


def test_checkpoint_events_are_reported_and_a_commit_asks_for_retention():
    w = make()
    steps(w, 1, 12, 0.0)
    w.on_event(CheckpointEvent(rank=0, generation=1, step=10, stage="committed"), 2.0)
    w.on_event(CheckpointEvent(rank=1, generation=1, step=10, stage="written"), 2.0)
    w.on_event(CheckpointEvent(rank=0, generation=1, step=20, stage="failed", detail="ENOSPC"), 3.0)
    effects = [e for e in w.drain() if not isinstance(e, (Progress, watch.Saving))]
    assert effects[0] == Committed(10, current_step=12, rank=0)
    assert watch.CheckpointFailed(20, "ENOSPC") in effects          # training goes on: no outcome
    assert w.tick(3.0) is None
    assert [(n.event, n.level) for n in kinds(effects, Note)] == [("checkpoint_failed", "error")]   # a commit is one event


def test_events_of_another_generation_or_an_unknown_rank_are_ignored():
    w = make()
    w.on_event(step_event(step=5, loss=2.0, generation=2), 4.9)     # a late datagram of another generation
    w.on_event(step_event(step=5, loss=2.0, rank=7), 4.9)
    assert w.drain() == []
    assert w.tick(5.01).incident.kind is Kind.HANG                   # so nothing was heard from rank 0


@pytest.mark.parametrize("body,allowed,problem", [
    ({"fault": "nan", "rank": 1, "at_step": 40}, True, None),
    ({"fault": "nan"}, False, "allow_fault_injection"),
    ({"fault": "melt"}, True, "unknown fault 'melt'"),
    ({"fault": "hang", "rank": 2}, True, "rank 2 is not in [0, 2)"),
    ({"fault": "slow", "seconds": "soon"}, True, "seconds = 'soon'"),
    ({"fault": "spike", "steps": 0}, True, "steps = 0 must be an integer >= 1"),
])
def test_an_inject_request_is_validated_once_and_forwarded(body, allowed, problem):
    cfg = load_config(None, [f"health.allow_fault_injection={str(allowed).lower()}", "parallel.dp=2",
                             "train.micro_batch=4"])
    w = make(cfg)
    w.on_control(Request("inject", body, "inject"), 1.0)
    (effect,) = w.drain()
    if problem is None:
        assert effect == Send("inject", {"fault": "nan", "rank": 1, "at_step": 40})
    else:
        assert effect.event == "control_rejected" and problem in effect.fields["detail"]


def test_a_checkpoint_request_becomes_a_command():
    w = make()
    w.on_control(Request("checkpoint", {"reason": "before upgrade"}, "checkpoint"), 1.0)
    assert w.drain() == [Send("checkpoint", {})]


@pytest.mark.parametrize("kind,grace", [(Kind.CRASH, 2.0), (Kind.HANG, 2.0), (Kind.OOM, 2.0),
                                        (Kind.NON_FINITE, 0.0)])
def test_teardown_grace_depends_on_how_the_generation_ended(kind, grace):
    from daemon.judging.incidents import Incident

    failed = Failed(Incident(kind=kind, first_step=1, last_step=1))
    assert watch.teardown_grace_s(failed, 10.0, saving=True) == grace
    assert watch.teardown_grace_s(failed, 10.0, saving=False) == 0.0    # nothing to wait for: recover now
    assert watch.teardown_grace_s(Finished(5), 10.0, saving=False) == 10.0
    # the RAM tier's writers left after a crash or hang finish the rank's newest save; a numerical
    # incident's state is thrown away, a cut-off node's too (killed at once)
    assert watch.teardown_graces(failed, 10.0, saving=False) == (0.0, grace)
    assert watch.teardown_graces(failed, 1.0, saving=False) == (0.0, min(grace, 1.0))
    cut = Failed(Incident(kind=kind, first_step=1, last_step=1, evidence={"cut_off": True}))
    assert watch.teardown_graces(cut, 10.0, saving=True) == (0.0, 0.0)
    assert watch.teardown_graces(Finished(5), 10.0, saving=False) == (10.0, 10.0)


def test_a_checkpoint_is_in_flight_from_staged_until_committed_or_failed():
    from contracts.protocol import CheckpointEvent

    w = make()
    ckpt = lambda step, stage, rank=0: w.on_event(CheckpointEvent(rank=rank, generation=1, step=step, stage=stage), 1.0)
    assert not w.saving
    ckpt(10, "staged"), ckpt(10, "staged", rank=1)
    assert w.saving
    ckpt(10, "written")
    assert w.saving                       # rank 0's shard durable is not a checkpoint: it commits
    ckpt(10, "written", rank=1)
    assert w.saving
    ckpt(10, "committed")
    assert not w.saving
    ckpt(20, "staged")
    ckpt(20, "failed")
    assert not w.saving
    ckpt(30, "staged")
    ckpt(30, "exists")                    # already committed (a save of a step restored from)
    assert not w.saving


def test_a_follower_nodes_rank_is_done_saving_once_its_shard_is_written():
    """Rank 0 commits on another machine, so this node's watch never sees the commit: its ranks' part
    ends with their shards written, or every failure after the first save waited out a grace."""
    from contracts.protocol import CheckpointEvent

    w = make(ranks=(2, 3))
    ckpt = lambda step, stage, rank: w.on_event(CheckpointEvent(rank=rank, generation=1, step=step, stage=stage), 1.0)
    ckpt(10, "staged", 2), ckpt(10, "staged", 3)
    ckpt(10, "written", 2)
    assert w.saving                       # rank 3 still writes
    ckpt(10, "written", 3)
    assert not w.saving


def test_corrupt_data_reported_by_a_rank_is_an_incident_even_though_the_rank_exits_65():
    from contracts.protocol import DataFaultEvent

    w = make()
    t = steps(w, 1, 20, 1.0)
    bad = [{"file": "tokens-00003.bin", "block": 7, "offset": 7 << 20, "expected": 1, "actual": 2}]
    w.on_event(DataFaultEvent(rank=1, generation=1, step=21, corpus="/c", blocks=bad, corpus_blocks=400), t)
    w.on_exit(1, 65, t)                        # DataError: final on its own, but the event explains it
    out = w.tick(t)
    assert isinstance(out, Failed) and out.incident.kind is Kind.DATA_CORRUPT
    assert (out.incident.rank, out.incident.first_step) == (1, 21)
    assert "tokens-00003.bin block 7" in out.incident.detail
    assert out.incident.evidence["blocks"] == bad and out.incident.evidence["corpus_blocks"] == 400
    assert watch.teardown_grace_s(out, kill_grace_s=30) == 0.0    # nothing of the ranks' state is kept


def test_a_straggler_is_warned_about_and_ends_the_generation_only_when_set_to_restart():
    from contracts.protocol import StepEvent
    from daemon.judging.watch import Warned

    def slow_rank_1(w, last):
        for s in range(1, last + 1):
            for r, (host, sync) in {0: (0.01, 0.32), 1: (0.31, 0.02)}.items():   # rank 0 waits for rank 1
                w.on_event(StepEvent(rank=r, generation=1, step=s, loss=2.0, grad_norm=1.0, loss_scale=1.0, lr=1e-3,
                                     lr_multiplier=1.0, skipped=False, sample_start=0, sample_end=8, tokens=512,
                                     step_s=0.1 + sync, data_wait_s=0.0, tokens_per_s=1.0, host_s=host, sync_s=sync),
                           1.0 + s)

    w = make()
    slow_rank_1(w, 80)
    assert w.tick(81.0) is None
    (warned,) = kinds(w.drain(), Warned)
    assert warned.incident.kind is Kind.STRAGGLER and warned.incident.rank == 1
    w = make(load_config(None, ['health.straggler_action="restart"', "health.straggler_restart_after_s=5",
                                "parallel.dp=2", "train.micro_batch=4"]))
    slow_rank_1(w, 80)
    out = w.tick(81.0)
    assert isinstance(out, Failed) and out.incident.kind is Kind.STRAGGLER and out.incident.rank == 1


def test_an_incident_a_drill_explains_is_labelled_as_a_drill():
    drills = load_config(None, ["health.allow_fault_injection=true", "parallel.dp=2", "train.micro_batch=4"])
    w = make(drills)
    t = steps(w, 1, 10, 1.0)
    w.on_control(Request("inject", {"fault": "crash", "rank": 1, "at_step": 12}, "inject"), t)
    steps(w, 11, 11, t)
    w.on_exit(1, -signal.SIGKILL, t + 1)
    out = w.tick(t + 1)
    assert out.incident.kind is Kind.CRASH and out.incident.evidence["drill"]["fault"] == "crash"
    assert out.incident.detail.endswith("(a crash drill)")
    w = make(drills)                                     # a drill of another kind explains nothing
    w.on_control(Request("inject", {"fault": "nan", "rank": 1}, "inject"), 1.0)
    w.on_exit(1, 1, 2.0)
    assert "drill" not in w.tick(2.0).incident.evidence


def test_ranks_whose_exit_events_were_lost_ended_at_the_last_commit_seen():
    w = make(stop_reason="signal SIGTERM")
    steps(w, 1, 5, 0.0)
    w.on_event(CheckpointEvent(rank=0, generation=1, step=7, stage="committed"), 1.0)
    for r in (0, 1):
        w.on_exit(r, 0, 2.0)
    assert w.tick(2.0) == Stopped(7)


def test_ranks_count_as_stalled_only_while_they_should_be_stepping():
    w = make()
    assert w.stalled_s(50.0) == 0.0                          # compiling: no step yet
    t = steps(w, 1, 10, 1.0)
    assert w.stalled_s(t + 4.0) == pytest.approx(4.0 - 2 * w.step_times.p99())   # 4 s past a step, less 2 x p99
    w.request_stop("maintenance", t + 5.0)
    assert w.stalled_s(t + 9.0) == 0.0                      # stopping: saving, not stalled
    done = make()
    t = steps(done, 1, 100, 1.0)
    assert done.stalled_s(t + 30.0) == 0.0                  # the run's last step: nothing more to come


def test_an_evaluation_is_reported_and_neither_a_hang_nor_a_stall():
    """Rank 0 measures the validation loss after step 10 (seconds, its graph compiling the first time); rank 1
    goes on and waits for it in the next collective. Both said they evaluate: judged by the compile timeout."""
    from contracts.protocol import EvalEvent
    from daemon.judging.watch import Validated

    w = make()
    t = steps(w, 1, 10, 0.0)
    phase(w, 0, "eval", t, 10)
    phase(w, 1, "eval", t, 10)
    assert w.stalled_s(t + 10.0) == 0.0
    assert w.tick(t + 15.0) is None                          # past the training floor (3 s), within compile's 20 s
    done = EvalEvent(rank=0, generation=1, step=10, loss=2.5, perplexity=12.18, sequences=32, tokens=2048, seconds=15.0)
    w.on_event(done, t + 15.0)
    assert Validated(done) in w.drain()
    assert isinstance(w.tick(t + 15.0 + 21.0), Failed)       # an evaluation past the compile timeout is a hang


def _spiked_then_rerun(rerun_loss: float, rtol: float = 0.0):
    """A spike at 30-32 in one generation, its rerun (from step 25) in the next with `rerun_loss` at 30-32."""
    cfg = load_config(None, ["health.loss_spike_warmup_steps=10", "health.loss_spike_window_steps=10",
                             f"health.rerun_rtol={rtol}"])
    monitor = HealthMonitor(cfg.health, precision=cfg.train.precision)
    first = Watch(cfg, generation=1, ranks=(0,), now=0.0, monitor=monitor)
    t = steps(first, 1, 29, 0.0, ranks=(0,), loss=3.0)
    steps(first, 30, 32, t, ranks=(0,), loss=12.0)
    incident = first.tick(t + 1).incident
    rerun = {"kind": incident.kind.value, "first_step": 30, "last_step": 32, "checkpoint_step": 25,
             "observed": incident.evidence["observed"], "drills": []}
    monitor.rewind(25)
    again = Watch(cfg, generation=2, ranks=(0,), now=10.0, monitor=monitor, rerun=rerun)
    steps(again, 26, 29, 10.0, ranks=(0,), loss=3.0, generation=2)
    steps(again, 30, 32, 11.0, ranks=(0,), loss=rerun_loss, generation=2)
    return incident, again


def test_a_spike_carries_what_its_rerun_is_compared_with():
    incident, _ = _spiked_then_rerun(12.0)
    assert incident.evidence["observed"] == {"30": [12.0, 1.0, False], "31": [12.0, 1.0, False],
                                             "32": [12.0, 1.0, False]}


def test_a_rerun_that_repeats_the_spike_bit_for_bit_brings_it_back_as_deterministic():
    _, again = _spiked_then_rerun(12.0)
    out = again.tick(12.0)
    assert out.incident.kind is Kind.LOSS_SPIKE and out.incident.first_step == 30
    triage = out.incident.evidence["triage"]
    assert triage["verdict"] == "deterministic" and [c["step"] for c in triage["compared"]] == [30, 31, 32]
    assert [e.verdict for e in kinds(again.drain(), watch.Triaged)] == ["deterministic"]


def test_a_rerun_that_does_not_repeat_it_is_transient_and_the_generation_trains_on():
    _, again = _spiked_then_rerun(3.0)
    assert again.tick(12.0) is None
    [verdict] = kinds(again.drain(), watch.Triaged)
    assert verdict.verdict == "transient" and verdict.first_step == 30
    assert verdict.evidence["compared"] == [{"step": 30, "first_run": [12.0, 1.0, False], "rerun": [3.0, 1.0, False]}]


def test_a_rerun_differing_by_less_than_the_tolerance_is_a_repeat_and_by_one_ulp_without_one_is_not():
    out = _spiked_then_rerun(12.0 * (1 + 1e-4), rtol=1e-3)[1].tick(12.0)
    assert out.incident.evidence["triage"]["verdict"] == "deterministic"
    _, again = _spiked_then_rerun(math.nextafter(12.0, 13.0))
    # not the same step: transient, as far as the rerun can tell; but it spikes again all the same, and that
    # is an incident of its own (which the policy does not rerun again: a rerun passed that step)
    out = again.tick(12.0)
    assert kinds(again.drain(), watch.Triaged)[0].verdict == "transient"
    assert out.incident.kind is Kind.LOSS_SPIKE and "triage" not in out.incident.evidence


def test_an_incident_before_the_rerun_steps_is_not_held_for_their_verdict():
    cfg = load_config(None, ["health.loss_spike_warmup_steps=10", "health.loss_spike_window_steps=10"])
    monitor = HealthMonitor(cfg.health, precision=cfg.train.precision)
    rerun = {"kind": "loss_spike", "first_step": 40, "last_step": 42, "checkpoint_step": 25,
             "observed": {"40": [12.0, 1.0, False]}, "drills": []}
    w = Watch(cfg, generation=2, ranks=(0,), now=0.0, monitor=monitor, rerun=rerun)
    t = steps(w, 1, 29, 0.0, ranks=(0,), loss=3.0, generation=2)
    steps(w, 30, 30, t, ranks=(0,), loss=3.0, skipped=True, generation=2)       # a NaN at 30, before 40
    out = w.tick(t + 1)
    assert out.incident.kind is Kind.NON_FINITE and out.incident.first_step == 30
    assert not kinds(w.drain(), watch.Triaged)                                    # no verdict on 40-42 yet


def test_the_watched_ranks_saves_are_timed_for_an_auto_interval():
    w = make()
    steps(w, 1, 3, 0.0)
    for rank in (0, 1):
        w.on_event(CheckpointEvent(rank=rank, generation=1, step=3, stage="staged", seconds=0.25), 1.0)
        w.on_event(CheckpointEvent(rank=rank, generation=1, step=3, stage="staged_in_memory", seconds=0.01), 1.0)
        w.on_event(CheckpointEvent(rank=rank, generation=1, step=3, stage="in_memory", seconds=0.5), 1.0)
    saving = kinds(w.drain(), watch.Saving)
    assert saving == [watch.Saving("disk", "staged", 3, 0.25), watch.Saving("memory", "staged", 3, 0.01),
                      watch.Saving("memory", "committed", 3, 0.5)]
    assert w.saving and not kinds(w.drain(), watch.Saving)  # the disk save is unsettled; the RAM tier's never is


def test_ranks_waiting_in_the_gradient_sum_while_a_save_is_written_behind_them_are_stalled():
    """A partitioned machine's committer waits for ever on shards the others will not write: a save in
    flight must not hide that its ranks make no step (the cut-off rule goes by it); a rank staging a
    save (its board says `save`) is not stalled."""
    from contracts.phase_board import Slot

    w = make()
    t = steps(w, 1, 30, 1.0)
    for rank in (0, 1):
        w.on_event(CheckpointEvent(rank=rank, generation=1, step=30, stage="staged", seconds=0.05), t)
    w.tick(t, phases={0: Slot(0, "sum", 31, t), 1: Slot(1, "sum", 31, t)})
    assert w.saving and w.stalled_s(t + 10.0) == pytest.approx(10.0 - 2 * w.step_times.p99())
    w.tick(t, phases={0: Slot(0, "save", 30, t), 1: Slot(1, "sum", 31, t)})
    assert w.stalled_s(t + 10.0) == 0.0


def test_a_rank_stuck_in_its_step_is_named_from_the_phase_board_before_the_hang_timeout():
    """stall_floor_s 10 s, steps of 0.1 s: rank 1 stops in its compute at t=10 while rank 0 waits in the gradient
    sum: at 20.5 s the watch names rank 1 and its phase, asks for rank 1's stacks (and kernel state) first, and
    ends the generation — where the hang check alone (a floor of 60 s by default) would still wait."""
    from contracts.phase_board import Slot
    from daemon.judging.watch import DumpStacks

    cfg = load_config(None, ["health.stall_floor_s=10", "health.hang_floor_s=60", "parallel.dp=2",
                             "train.micro_batch=4", "train.steps=100"])
    w = make(cfg)
    t = steps(w, 1, 50, 5.0)                                  # compiled, stepping: 0.1 s steps known
    board = {0: Slot(0, "sum", 51, 10.0), 1: Slot(1, "compute", 51, 9.95)}
    assert w.tick(19.0, phases=board) is None                # 9 s: within the limit
    w.drain()
    out = w.tick(20.5, phases=board)
    assert isinstance(out, Failed) and out.incident.kind is Kind.HANG and out.incident.rank == 1
    assert out.incident.evidence["phase"] == "compute" and out.incident.evidence["waiting"] == [0]
    assert "rank 1 stuck 10.6 s in compute of step 51" in out.incident.detail
    (dump,) = kinds(w.drain(), DumpStacks)
    assert dump.ranks == (1, 0) and dump.native == (1,)


def test_a_rank_saving_or_a_paused_run_is_not_a_stall():
    from contracts.phase_board import Slot

    cfg = load_config(None, ["health.stall_floor_s=10", "parallel.dp=2", "train.micro_batch=4", "train.steps=100"])
    w = make(cfg)
    steps(w, 1, 50, 5.0)
    board = {0: Slot(0, "save", 50, 10.0), 1: Slot(1, "sum", 51, 10.0)}
    assert w.tick(25.0, phases=board) is None


def test_a_device_a_faulty_rank_drill_left_faulty_labels_later_generations_incidents_as_the_drills():
    """The drill's marker outlives its generation (the device stays faulty): the reruns and incidents of later
    generations whose suspects run on that device are labelled a drill's; a suspect elsewhere is not."""
    from daemon.judging.incidents import Incident

    w = make(homes={"0": [0, 0], "1": [0, 1]}, drills=[{"fault": "faulty-rank", "node": 0, "device": 1}])
    on_it = w._labelled(Incident(kind=Kind.RANK_OUTLIER, first_step=40, last_step=40, evidence={"suspects": [1]}))
    assert on_it.evidence["drill"]["fault"] == "faulty-rank" and "(a faulty-rank drill)" in on_it.detail
    elsewhere = w._labelled(Incident(kind=Kind.RANK_OUTLIER, first_step=40, last_step=40, evidence={"suspects": [0]}))
    assert "drill" not in elsewhere.evidence


def test_the_run_files_name_the_devices_a_drill_left_faulty(tmp_path):
    from daemon.processes.run_files import RunFiles

    (tmp_path / "run" / "drills").mkdir(parents=True)
    (tmp_path / "run" / "drills" / "faulty-node0-device1").touch()
    files = RunFiles(load_config(None, [f'run.dir="{tmp_path / "run"}"']), {})
    assert files.faulty_devices() == [{"fault": "faulty-rank", "node": 0, "device": 1}]


def test_a_disk_save_that_waited_for_the_one_before_is_checkpoint_time_in_the_goodput_ledger(tmp_path):
    """The watched rank's `waited` (its step held while the previous disk save finished) is claimed as checkpoint
    time, beside the save's own `staged` seconds; it is no save of its own, so an auto interval does not time it.
    Before, it was nobody's claim and the ledger called it `other`."""
    import io

    from daemon.acting import effects_of_watch
    from daemon.processes.run_files import RunFiles
    from daemon.records.eventlog import EventLog
    from daemon.records.ledger import Ledger
    from daemon.records.metrics import Metrics
    from daemon.records.notify import Notifier

    w = make()
    steps(w, 1, 3, 0.0)
    w.on_event(CheckpointEvent(rank=0, generation=1, step=3, stage="waited", seconds=0.75), 1.0)
    w.on_event(CheckpointEvent(rank=1, generation=1, step=3, stage="waited", seconds=0.5), 1.0)   # not watched
    effects = w.drain()
    assert kinds(effects, watch.Saving) == [watch.Saving("disk", "waited", 3, 0.75)]
    cfg = load_config(None, [f'run.dir="{tmp_path / "run"}"', 'checkpoint.interval_steps="auto"'])
    files = RunFiles(cfg, {})
    files.node_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(files.node_dir, EventLog(None, "r", stream=io.StringIO()), Metrics("r"), Notifier({}), total_steps=9)
    effects_of_watch.carry_out(kinds(effects, watch.Saving), ledger=ledger, gen=None, peers=None, files=files, cfg=cfg)
    assert ledger.goodput.pending == {"checkpoint": 0.75}       # claimed (settled against the wall time later)
