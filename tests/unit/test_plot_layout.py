"""The plot's pure parts: a skipped sample window in steps, the steps a later generation trained
again, incident labels, the folded list and the numbered markers. No matplotlib, no processes."""
import pytest

from cli.plot import Marker, incident_label, listing, place_markers, steps_for_samples, superseded_steps
from contracts.protocol import LrOverride
from daemon.judging.incidents import Halt, Incident, IncidentRecord, Kind, Restart, Rollback

pytestmark = pytest.mark.unit


def _every_step(first, last, per_step=8, offset=0):
    """(step, sample_start, sample_end) of steps first..last, `per_step` samples each."""
    return [(n, offset + per_step * (n - 1), offset + per_step * n) for n in range(first, last + 1)]


@pytest.mark.parametrize("ranges,window,expected", [
    (_every_step(1, 40), (232, 256), (30, 32)),                 # exactly steps 30-32
    (_every_step(1, 40), (236, 244), (30, 31)),                 # half of 30, half of 31
    (_every_step(1, 40), (232, 240), (30, 30)),
    (_every_step(1, 40), (320, 330), None),                     # after the last step of a log of every step
    (_every_step(26, 40), (0, 8), None),                        # before this generation's first step
    (_every_step(26, 40), (0, 208), (26, 26)),                  # overlaps its first step only
    (_every_step(1, 40), (240, 240), None),                     # an empty window
    ([], (0, 8), None),
    # a log written every 5 steps: steps in between are placed by the samples per step
    ([(n, 8 * (n - 1), 8 * n) for n in range(5, 41, 5)], (232, 256), (30, 32)),
    ([(n, 8 * (n - 1), 8 * n) for n in range(5, 41, 5)], (240, 248), (31, 31)),
    # ... and up to 4 steps past its last line (a rank that died before the next one), not further
    ([(n, 8 * (n - 1), 8 * n) for n in range(5, 41, 5)], (320, 344), (41, 43)),
    ([(n, 8 * (n - 1), 8 * n) for n in range(5, 41, 5)], (320, 400), None),   # its end is past them
    ([(n, 8 * (n - 1), 8 * n) for n in range(5, 41, 5)], (360, 400), None),
    # samples 16-40 were skipped before this generation: no step read them
    ([(1, 0, 8), (2, 8, 16), (3, 40, 48)], (16, 40), None),
    ([(1, 0, 8), (2, 8, 16), (3, 40, 48)], (16, 48), (3, 3)),
])
def test_a_sample_window_maps_to_the_steps_that_read_it(ranges, window, expected):
    assert steps_for_samples(ranges, window) == expected


@pytest.mark.parametrize("steps_by_gen,resumed_at,expected", [
    ({1: range(1, 61)}, {}, {}),
    # a rollback to 25 after a spike at 30-32: generation 1's 26-32 were trained again
    ({1: range(1, 33), 2: range(26, 61)}, {}, {1: (26, 32)}),
    ({1: range(1, 33), 2: range(26, 61)}, {1: 0, 2: 25}, {1: (26, 32)}),
    # sparse logs: generation 2 resumed from 25 but first logged step 30
    ({1: range(5, 35, 5), 2: range(30, 61, 5)}, {2: 25}, {1: (30, 30)}),
    ({1: range(5, 35, 5), 2: range(30, 61, 5)}, {}, {1: (30, 30)}),
    # a crash loop at step 12 from the checkpoint at 10: 1 and 2 both replaced
    ({1: range(1, 13), 2: range(11, 13), 3: range(11, 21)}, {}, {1: (11, 12), 2: (11, 12)}),
    # a generation that resumed and logged no step still starts the replacement
    ({1: range(1, 13)}, {2: 10}, {1: (11, 12)}),
    # a restart from a checkpoint at the last step: nothing trained twice
    ({1: range(1, 21), 2: range(21, 41)}, {2: 20}, {}),
    # a later generation that went back further supersedes more of an earlier one
    ({1: range(1, 41), 2: range(31, 36), 3: range(21, 61)}, {}, {1: (21, 40), 2: (31, 35)}),
])
def test_superseded_steps_are_those_a_later_generation_trained_again(steps_by_gen, resumed_at, expected):
    assert superseded_steps({g: list(s) for g, s in steps_by_gen.items()}, resumed_at) == expected


def _record(kind=Kind.LOSS_SPIKE, action=None, evidence=None, first=30, last=32):
    return IncidentRecord(incident=Incident(kind=kind, first_step=first, last_step=last, evidence=evidence or {},
                                            needs_action=action is not None),
                          generation=1, unix_s=0.0, action=action)


LR = (LrOverride(start_step=26, factor=0.5, hold_steps=200, ramp_steps=200),)


@pytest.mark.parametrize("record,skipped,label", [
    (_record(action=Rollback("r", checkpoint_step=25, skip=(232, 256), lr_overrides=LR)), (30, 32),
     "loss_spike -> rollback to 25, skip steps 30\u201332 (samples 232\u2013256), lr x0.5"),
    (_record(action=Rollback("r", checkpoint_step=25, skip=(232, 240), lr_overrides=LR)), (30, 30),
     "loss_spike -> rollback to 25, skip step 30 (samples 232\u2013240), lr x0.5"),
    (_record(action=Rollback("r", checkpoint_step=25, skip=(232, 256), lr_overrides=LR)), None,
     "loss_spike -> rollback to 25, skip samples 232\u2013256, lr x0.5"),
    (_record(Kind.NON_FINITE, Rollback("r", checkpoint_step=20, skip=None, lr_overrides=()),
             {"drill": {"fault": "nan", "seq": 3}}), None, "non_finite (drill) -> rollback to 20"),
    (_record(Kind.OVERFLOW_STORM, Rollback("r", checkpoint_step=20, skip=None, lr_overrides=LR, loss_scale=1024.0)),
     None, "overflow_storm -> rollback to 20, lr x0.5, scale 1024"),
    (_record(Kind.DATA_CORRUPT, Rollback("r", checkpoint_step=20, skip=None, lr_overrides=(),
                                         quarantine=(("shard-0.bin", 3), ("shard-0.bin", 4)))),
     None, "data_corrupt -> rollback to 20, quarantine 2 block(s)"),
    (_record(Kind.THROUGHPUT_REGRESSION), None, "throughput_regression (warning)"),
    (_record(Kind.LOSS_SPIKE, evidence={"drill": {"fault": "spike"}}), None, "loss_spike (drill) (warning)"),
    (_record(Kind.CRASH, Restart("crash")), None, "crash -> restart"),
    (_record(Kind.OOM, Restart("oom", {"train.micro_batch": 4})), None, "oom -> restart, train.micro_batch=4"),
    (_record(action=Halt("numerics", 4)), None, "loss_spike -> halt (gave_up_numerics)"),
    (_record(action=Halt("odd", 99)), None, "loss_spike -> halt (exit 99)"),
])
def test_an_incident_label_says_what_was_done(record, skipped, label):
    assert incident_label(record, skipped) == label


@pytest.mark.parametrize("count,shown,last", [
    (0, 0, None), (1, 1, "1. e0"), (15, 15, "15. e14"), (16, 15, "\u2026 and 2 more"), (30, 15, "\u2026 and 16 more"),
])
def test_the_list_folds_past_fifteen(count, shown, last):
    out = listing([f"e{i}" for i in range(count)], max_entries=15)
    assert len(out) == shown
    assert (out[-1] if out else None) == last


def test_a_long_entry_wraps_under_its_number_and_is_cut_at_three_lines():
    out = listing(["word " * 60], width=30, max_lines=3)
    lines = out[0].split("\n")
    assert len(lines) == 3 and lines[0].startswith("1. word") and lines[1].startswith("   word")
    assert lines[-1].endswith("\u2026") and all(len(line) <= 30 for line in lines)


@pytest.mark.parametrize("xs,rows,texts", [
    ([], [], []),
    ([10, 50, 90], [0, 0, 0], ["1", "2", "3"]),              # far apart: one row
    ([10, 10.5, 11], [0, 1, 2], ["1", "2", "3"]),            # close: stacked
    ([10, 10, 10, 10, 10], [0, 1, 2], ["1,4,5", "2", "3"]),  # every row taken: numbers share a marker
    ([90, 10, 10.2], [0, 0, 1], ["1", "2", "3"]),            # numbered in the order given, placed by x
])
def test_markers_never_overlap(xs, rows, texts):
    markers = place_markers(xs, char_width=1.0, max_rows=3)
    assert [m.row for m in markers] == rows and [m.text for m in markers] == texts
    for row in {m.row for m in markers}:
        placed = sorted((m for m in markers if m.row == row), key=lambda m: m.x)
        for left, right in zip(placed, placed[1:]):
            assert right.x - left.x >= (len(left.text) + len(right.text) + 3) / 2


@pytest.mark.parametrize("numbers,text", [
    ([4], "4"), ([4, 5], "4,5"), ([4, 5, 6, 7], "4\u20137"), ([1, 3], "1,3"),
    ([1, 2, 3, 9, 11, 12], "1\u20133,9,11,12"),
])
def test_a_marker_shortens_runs_of_numbers(numbers, text):
    assert Marker(0.0, 0, numbers).text == text


def test_one_spike_does_not_flatten_the_loss_axis():
    """A drill's 16.0 among losses between 2.5 and 3.5: the axis keeps the curve readable and names what
    stands above it; without an outlier the axis holds every value."""
    from cli.plot import loss_limits

    losses = [3.5 - i / 1000 for i in range(1000)] + [16.0]
    lo, hi, above = loss_limits(losses)
    assert lo < 2.501 and 3.5 < hi < 4.2 and above == [16.0]
    lo, hi, above = loss_limits([3.0, float("nan"), 2.0, 2.5])
    assert lo < 2.0 and hi >= 3.0 and above == []
    assert loss_limits([float("nan")]) is None


def test_the_title_says_what_triage_found_and_which_devices_sit_out():
    from cli.plot import verdicts_text
    from daemon.records.state import RunState

    state = RunState(triage={"transient": 2, "device": 1},
                     lemons={"node 0 device 1": {"faults": [], "quarantines": 1}, "node 0 device 0": {"faults": []}})
    assert verdicts_text(state) == "; triage: device 1, transient 2; quarantined: node 0 device 1"
    assert verdicts_text(RunState()) == ""
