"""The recovery policy, table-driven: (incident, history, config) -> action."""
import pytest

from contracts.config import load_config, with_changes
from daemon.judging import policy
from daemon.judging.incidents import Halt, Incident, Kind, Rerun, Restart, Rollback
from daemon.judging.policy import RunHistory, is_healthy, newest_healthy

CFG = load_config(None)           # margin 10, cut 0.5, hold 200, ramp 200, floor 1/16, window 1000
FP16 = load_config(None, ['train.precision="fp16"'])
CKPTS = (50, 100, 150, 200, 250)
RANGES = {s: (8 * (s - 1), 8 * s) for s in range(1, 400)}


def spike(first, last=None, kind="loss_spike", storm_start_scale=None, triaged=True):
    """A numerical incident; `triaged`: its rerun reproduced it (the rows below act on it)."""
    evidence = {"triage": {"verdict": "deterministic"}} if triaged else {}
    return Incident(kind=Kind(kind), first_step=first, last_step=last or first + 2,
                    storm_start_scale=storm_start_scale, evidence=evidence)


def decide(incident, history, cfg):
    return policy.decide(incident, history, cfg.health, cfg.train)


@pytest.mark.parametrize("restarts,expected", [(1, Restart), (2, Restart), (3, Halt), (5, Halt)])
def test_crashes_restart_until_the_crash_loop_limit(restarts, expected):
    action = decide(Incident(kind=Kind.CRASH, first_step=0, last_step=0), RunHistory(restarts_without_progress=restarts),
                    CFG)
    assert isinstance(action, expected)
    if expected is Halt:
        assert action.code == 3


def test_a_spike_rolls_back_before_it_skips_its_window_and_halves_the_lr():
    action = decide(spike(203, 205), RunHistory(committed_steps=CKPTS, sample_ranges=RANGES), CFG)
    assert isinstance(action, Rollback)
    assert action.checkpoint_step == 150            # 200 lies within the 10-step margin before 203
    assert action.skip == (8 * 202, 8 * 205)        # samples of steps 203..205
    (override,) = action.lr_overrides
    assert (override.start_step, override.factor, override.hold_steps, override.ramp_steps) == (151, 0.5, 200, 200)


@pytest.mark.parametrize("earlier,factor", [
    ([], 0.5),
    ([spike(120)], 0.25),                           # recurrence within 1000 steps compounds
    ([spike(120), spike(160, kind="non_finite")], 0.125),
    ([spike(120 - 1500)], 0.5),                     # outside the window: a fresh start
])
def test_recurrences_compound_the_lr_cut(earlier, factor):
    action = decide(spike(300), RunHistory(incidents=earlier, committed_steps=CKPTS, sample_ranges=RANGES), CFG)
    assert action.lr_overrides[0].factor == factor


@pytest.mark.parametrize("kind,earlier,checkpoint,skip,factor", [
    # a collapse is a numerical incident like a spike: roll back before it, skip its window, cut the lr
    ("loss_collapse", [], 150, (8 * 202, 8 * 205), 0.5),
    ("loss_spike", [], 150, (8 * 202, 8 * 205), 0.5),
    ("loss_collapse", [spike(120)], 150, (8 * 202, 8 * 205), 0.25),                  # after a spike: compounds
    ("loss_spike", [spike(120, kind="loss_collapse")], 150, (8 * 202, 8 * 205), 0.25),
    ("loss_collapse", [spike(145, 160, kind="loss_collapse")], 100, (8 * 202, 8 * 205), 0.25),  # 150 inside it
])
def test_a_loss_collapse_is_decided_like_a_spike(kind, earlier, checkpoint, skip, factor):
    action = decide(spike(203, 205, kind=kind), RunHistory(incidents=earlier, committed_steps=CKPTS,
                                                           sample_ranges=RANGES), CFG)
    assert isinstance(action, Rollback) and kind in action.reason
    assert (action.checkpoint_step, action.skip, action.lr_overrides[0].factor) == (checkpoint, skip, factor)


def test_past_the_lr_floor_it_gives_up_with_4():
    earlier = [spike(100), spike(150), spike(200), spike(250)]
    action = decide(spike(300), RunHistory(incidents=earlier, committed_steps=CKPTS), CFG)
    assert isinstance(action, Halt) and action.code == 4


def test_the_rollback_target_is_never_inside_an_earlier_incident():
    earlier = [spike(145, 160)]                      # checkpoint 150 is inside it, 100 is fine
    action = decide(spike(175), RunHistory(incidents=earlier, committed_steps=CKPTS, sample_ranges=RANGES), CFG)
    assert action.checkpoint_step == 100


def test_with_no_healthy_checkpoint_it_starts_over():
    assert decide(spike(40), RunHistory(committed_steps=CKPTS), CFG).checkpoint_step == 0


def test_fp32_non_finite_is_handled_like_a_spike():
    action = decide(spike(180, 180, kind="non_finite"), RunHistory(committed_steps=CKPTS, sample_ranges=RANGES), CFG)
    assert isinstance(action, Rollback) and action.lr_overrides[0].factor == 0.5 and action.skip == (8 * 179, 8 * 180)


def test_fp16_overflow_storm_lowers_the_scale_and_caps_its_growth():
    storm = spike(180, 189, kind="overflow_storm", storm_start_scale=65536.0)
    action = decide(storm, RunHistory(committed_steps=CKPTS), FP16)
    assert isinstance(action, Rollback) and action.lr_overrides == ()
    assert action.loss_scale == 16384.0 and action.loss_scale < 65536.0
    assert action.checkpoint_step == 150 and action.loss_scale_cap_until_step == 150 + 1000
    again = decide(spike(300, 309, kind="overflow_storm", storm_start_scale=65536.0),
                   RunHistory(incidents=[storm], committed_steps=CKPTS), FP16)
    assert again.loss_scale == 4096.0               # compounds


def test_fp16_storm_with_no_scale_left_cuts_the_lr_instead():
    storm = spike(180, 189, kind="overflow_storm", storm_start_scale=2.0)
    action = decide(storm, RunHistory(committed_steps=CKPTS, sample_ranges=RANGES), FP16)
    assert action.loss_scale is None and action.lr_overrides[0].factor == 0.5


@pytest.mark.parametrize("recompute,micro,accum,expected", [
    (False, 8, 1, {"train.recompute": True}),
    (True, 8, 1, {"train.micro_batch": 4, "train.grad_accum_steps": 2}),
    (True, 2, 4, {"train.micro_batch": 1, "train.grad_accum_steps": 8}),
    (True, 1, 8, None),
])
def test_out_of_memory_ladder(recompute, micro, accum, expected):
    cfg = with_changes(CFG, {"train.recompute": recompute, "train.micro_batch": micro, "train.grad_accum_steps": accum})
    action = decide(Incident(kind=Kind.OOM, first_step=10, last_step=10), RunHistory(), cfg)
    if expected is None:
        assert isinstance(action, Halt) and action.code == 3
    else:
        assert isinstance(action, Restart) and action.config_changes == expected


@pytest.mark.parametrize("step,healthy", [(90, True), (93, False), (100, False), (110, False), (111, True)])
def test_checkpoint_health_is_derived_from_the_incident_log(step, healthy):
    assert is_healthy(step, [spike(103, 110)], margin=10) is healthy


def test_newest_healthy_is_what_retention_protects():
    assert newest_healthy(CKPTS, [spike(245, 260)], 10) == 200
    assert newest_healthy(CKPTS, [], 10, before_step=100) == 50


def corrupt(step, blocks, total=1000):
    return Incident(kind=Kind.DATA_CORRUPT, first_step=step, last_step=step, rank=1,
                    evidence={"blocks": [{"file": f, "block": b} for f, b in blocks], "corpus_blocks": total})


def test_corrupt_data_resumes_from_the_newest_checkpoint_with_the_blocks_quarantined():
    action = decide(corrupt(205, [("tokens-00001.bin", 3), ("tokens-00001.bin", 4)]),
                    RunHistory(committed_steps=CKPTS, sample_ranges=RANGES), CFG)
    assert isinstance(action, Rollback)
    assert action.checkpoint_step == 200            # nothing trained on it: no margin, no skip, no lr cut
    assert action.skip is None and action.lr_overrides == ()
    assert action.quarantine == (("tokens-00001.bin", 3), ("tokens-00001.bin", 4))
    assert is_healthy(200, [corrupt(205, [("x", 1)])], margin=10)      # it taints no checkpoint


def test_quarantine_accumulates_in_the_directive_and_the_lr_in_force_stays():
    from contracts.protocol import LrOverride, RecoveryDirective

    cut = (LrOverride(start_step=51, factor=0.5, hold_steps=200, ramp_steps=200),)
    before = RecoveryDirective(checkpoint_step=50, skip_ranges=((8, 16),), lr_overrides=cut, quarantined_blocks=(("a", 1),))
    action = decide(corrupt(205, [("b", 2)]), RunHistory(committed_steps=CKPTS, quarantined=(("a", 1),)), CFG)
    after = policy.merge_recovery(before, action)
    assert after.quarantined_blocks == (("a", 1), ("b", 2)) and after.lr_overrides == cut
    assert after.skip_ranges == ((8, 16),) and after.checkpoint_step == 200
    assert RecoveryDirective.from_json(after.to_json()) == after


def test_too_much_corrupt_data_gives_up_with_65():
    earlier = tuple(("tokens-00000.bin", b) for b in range(45))
    ok = decide(corrupt(205, [("tokens-00001.bin", 0)] * 1), RunHistory(committed_steps=CKPTS, quarantined=earlier), CFG)
    assert isinstance(ok, Rollback)                                      # 46 of 1000: within 5 %
    many = [("tokens-00001.bin", b) for b in range(10)]
    action = decide(corrupt(205, many), RunHistory(committed_steps=CKPTS, quarantined=earlier), CFG)
    assert isinstance(action, Halt) and action.code == 65 and "55 of 1000" in action.reason


def test_the_policy_is_a_table_with_a_row_for_every_kind_it_acts_on_and_none_for_a_warning():
    warnings = {Kind.GRAD_NORM_BURST, Kind.THROUGHPUT_REGRESSION, Kind.LOSS_STALLED, Kind.CHECKPOINT_FAILING,
                Kind.DISK_SPACE_LOW}
    assert set(policy.RULES) == set(Kind) - warnings
    with pytest.raises(ValueError, match="no policy for incident kind 'loss_stalled'"):
        policy.decide(Incident(kind=Kind.LOSS_STALLED, first_step=5, last_step=9), policy.RunHistory(),
                      CFG.health, CFG.train)


@pytest.mark.parametrize("kind", ["loss_spike", "loss_collapse", "non_finite"])
def test_a_numerical_incident_is_rerun_from_the_checkpoint_before_it_before_anything_is_cut(kind):
    action = decide(spike(203, 205, kind=kind, triaged=False), RunHistory(committed_steps=CKPTS, sample_ranges=RANGES),
                    CFG)
    assert isinstance(action, Rerun)
    # the newest checkpoint before its first step (no margin: nothing is skipped or cut, the steps are compared)
    assert (action.checkpoint_step, action.first_step, action.last_step) == (200, 203, 205)


def test_a_reproduced_incident_is_decided_on_its_row_and_a_rerun_is_not_repeated_where_one_passed():
    history = RunHistory(committed_steps=CKPTS, sample_ranges=RANGES)
    assert isinstance(decide(spike(203, 205, triaged=True), history, CFG), Rollback)
    # an incident at a step a rerun already found transient comes back: it is no passing fault
    again = RunHistory(committed_steps=CKPTS, sample_ranges=RANGES, transient_steps=(203,))
    assert isinstance(decide(spike(203, 205, triaged=False), again, CFG), Rollback)
    assert isinstance(decide(spike(230, 232, triaged=False), again, CFG), Rerun)


def test_with_rerun_off_the_rows_act_at_once_and_an_fp16_storm_and_a_crash_are_never_rerun():
    off = with_changes(CFG, {"health.rerun": False})
    assert isinstance(decide(spike(203, 205, triaged=False), RunHistory(committed_steps=CKPTS, sample_ranges=RANGES),
                             off), Rollback)
    storm = Incident(kind=Kind.OVERFLOW_STORM, first_step=203, last_step=212, storm_start_scale=1024.0)
    assert isinstance(decide(storm, RunHistory(committed_steps=CKPTS), FP16), Rollback)
    crash = Incident(kind=Kind.CRASH, first_step=203, last_step=203)
    assert isinstance(decide(crash, RunHistory(committed_steps=CKPTS), CFG), Restart)


def test_a_rerun_starts_from_the_ram_tier_when_it_holds_a_nearer_checkpoint():
    history = RunHistory(committed_steps=CKPTS, sample_ranges=RANGES, memory_steps=(195, 200, 205))
    action = decide(spike(203, 205, triaged=False), history, CFG)
    assert isinstance(action, Rerun) and action.checkpoint_step == 200
    nearer = RunHistory(committed_steps=CKPTS, sample_ranges=RANGES, memory_steps=(201, 202))
    assert decide(spike(203, 205, triaged=False), nearer, CFG).checkpoint_step == 202
    # a rollback's target: the newest healthy checkpoint before the margin, in either tier (201 and 202 lie within it)
    assert decide(spike(203, 205), nearer, CFG).checkpoint_step == 150


def test_a_rollback_starts_from_the_ram_tier_when_it_holds_a_healthy_checkpoint_nearer_than_the_disk():
    """Issue 50, item 4: the rollback after a reproduced spike went back to the disk's 150 although the RAM tier
    held 192, healthy (before 203 - margin 10)."""
    history = RunHistory(committed_steps=CKPTS, sample_ranges=RANGES, memory_steps=(181, 192, 193, 202))
    action = decide(spike(203, 205), history, CFG)
    assert isinstance(action, Rollback) and action.checkpoint_step == 192
    assert action.lr_overrides[0].start_step == 193
