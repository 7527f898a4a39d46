"""state.json: strict JSON both ways; a corrupt file is an error that names it, never a traceback; the
daemon sets it aside and rebuilds the state from the event log (daemon.records.state_rebuild, tested with literal events)."""
import io
import json
import math

import pytest

from cli import main as cli_main
from contracts.errors import DataError
from contracts.protocol import ExitCode, LrOverride, RecoveryDirective
from daemon.judging.incidents import Incident, IncidentRecord, Kind, Rollback
from daemon.records import state_rebuild
from daemon.records.eventlog import EventLog
from daemon.records.ledger import Ledger
from daemon.records.metrics import Metrics
from daemon.records.notify import Notifier
from daemon.records.state import STATE_FILE, RunState, StateCorruptError, set_aside

TS = "2025-01-02T03:04:05.250Z"
UNIX_S = 1735787045.25
CUT = {"start_step": 26, "factor": 0.5, "hold_steps": 200, "ramp_steps": 200}
DEEPER = {"start_step": 51, "factor": 0.25, "hold_steps": 200, "ramp_steps": 200}
ROLLBACK_SPIKE = {"type": "rollback", "reason": "loss_spike #1", "checkpoint_step": 25, "skip": [232, 264],
                  "lr_overrides": [CUT], "loss_scale": None, "loss_scale_cap_until_step": None}
ROLLBACK_COLLAPSE = {"type": "rollback", "reason": "loss_collapse #2", "checkpoint_step": 50, "skip": [472, 496],
                     "lr_overrides": [DEEPER], "loss_scale": None, "loss_scale_cap_until_step": None}


def ev(event, generation, level="info", **fields):
    """One line of events.jsonl, as daemon.records.eventlog writes it."""
    return {"ts": TS, "level": level, "event": event, "run": "r", "generation": generation, **fields}


def incident(generation, kind, first, last, action, event="incident", **extra):
    """An `incident` / `health_warning` event: an IncidentRecord's log_fields."""
    return ev(event, generation, "error", kind=kind, first_step=first, last_step=last,
              action_needed=action is not None, evidence=extra.pop("evidence", {}), action=action, **extra)


# A run's log: a warning, a spike rolled back, a crash and an out-of-memory restart, a pause, then a
# collapse whose rollback was recorded but not carried out (the daemon died), and a line from a newer daemon.
EVENTS = [
    ev("daemon_start", 0, pid=100),
    ev("generation_start", 1, resume_step=0),
    ev("progress", 1, step=20, loss=3.0, lr=1e-3, tokens_per_s=500.0, skipped=False),
    incident(1, "throughput_regression", 20, 20, None, event="health_warning", evidence={"drop": 0.5}),
    incident(1, "loss_spike", 30, 32, ROLLBACK_SPIKE, committed_step=30,
             evidence={"median": 3.0, "values": [12.0, "nan", "inf"]}),
    ev("rollback", 1, "warning", cause="loss_spike", checkpoint_step=25, rolled_back_steps=[30]),
    ev("restart", 1, "warning", cause="loss_spike", restarts=1, restarts_without_progress=0),
    ev("generation_start", 2, resume_step=25),
    incident(2, "crash", 40, 40, {"type": "restart", "reason": "crash", "config_changes": {}}, step=40, rank=1,
             exit_code=-9, committed_step=40),
    ev("restart", 2, "warning", cause="crash", restarts=2, restarts_without_progress=1),
    ev("generation_start", 3, resume_step=40),
    incident(3, "oom", 41, 41, {"type": "restart", "reason": "oom: recompute on",
                                "config_changes": {"train.recompute": True}}, step=41, rank=0, exit_code=-9),
    ev("restart", 3, "warning", cause="oom", restarts=3, restarts_without_progress=2),
    ev("generation_start", 4, resume_step=40),
    ev("control", 4, name="pause", file="pause-1", body={"reason": "maintenance"}),
    ev("progress", 4, step=60, loss="nan", lr=5e-4, tokens_per_s=480.0, skipped=True),
    incident(4, "loss_collapse", 60, 62, ROLLBACK_COLLAPSE, committed_step=60),
    incident(4, "a_kind_from_the_future", 63, 63, None),
]


# The pure rebuild ------------------------------------------------------------------------------

def test_the_rebuild_recovers_history_counts_and_the_directive_from_literal_events():
    state, counts = state_rebuild.state_from_events(EVENTS)
    assert [r.kind for r in state.incidents] == ["throughput_regression", "loss_spike", "crash", "oom",
                                                 "loss_collapse"]
    spike = state.incidents[1]
    assert spike.generation == 1 and spike.unix_s == UNIX_S and spike.committed_step == 30
    assert spike.incident.evidence["values"][0] == 12.0 and math.isnan(spike.incident.evidence["values"][1])
    assert isinstance(spike.action, Rollback) and spike.action.skip == (232, 264)
    assert state.incidents[2].incident.rank == 1 and state.incidents[2].incident.exit_code == -9
    assert state.incidents[0].action is None and not state.incidents[0].incident.needs_action
    assert (state.generation, state.restarts, state.restarts_without_progress) == (4, 3, 2)
    assert state.config_changes == {"train.recompute": True}
    # policy.merge_recovery folded over the two rollbacks: skips accumulate, the newest lr list is in force
    assert state.recovery == RecoveryDirective(checkpoint_step=50, skip_ranges=((232, 264), (472, 496)),
                                      lr_overrides=(LrOverride(**DEEPER),))
    assert state.pending_rollback == 50                  # recorded, never carried out (no `rollback` event)
    assert state.last_control == {"name": "pause", "file": "pause-1", "unix_s": UNIX_S, "reason": "maintenance"}
    assert state.last_progress["step"] == 60 and math.isnan(state.last_progress["loss"])
    assert state.last_progress["unix_s"] == UNIX_S
    assert counts == {"events": len(EVENTS), "incidents": 4, "warnings": 1, "rollbacks": 2, "restarts": 3,
                      "unreadable": 1}


def test_the_rebuild_keeps_the_last_validation_loss():
    state, _ = state_rebuild.state_from_events([
        ev("validation", 1, step=100, loss=2.5, perplexity=12.18, sequences=32, tokens=2048, seconds=0.4),
        ev("validation", 1, step=200, loss=2.25, perplexity=9.49, sequences=32, tokens=2048, seconds=0.4)])
    assert state.last_validation == {"step": 200, "loss": 2.25, "perplexity": 9.49, "unix_s": UNIX_S}


def test_a_finished_rollback_is_not_pending_and_the_restart_total_survives_a_dropped_backup():
    later = [e for e in EVENTS[:7]]                     # up to the spike's rollback and its restart
    state, _ = state_rebuild.state_from_events(later)
    assert state.pending_rollback is None and state.recovery.skip_ranges == ((232, 264),)
    # the oldest backup rotated away: two `restart` events left, the last says 3 in all
    state, counts = state_rebuild.state_from_events(EVENTS[8:])
    assert counts["restarts"] == 2 and state.restarts == 3


def test_a_rollback_whose_event_was_lost_is_not_pending_once_a_later_generation_ran():
    """Finishing it again would roll back the checkpoints the later generations made."""
    lost = [e for e in EVENTS[:7] if e["event"] != "rollback"]
    assert state_rebuild.state_from_events(lost)[0].pending_rollback == 25
    assert state_rebuild.state_from_events([*lost, ev("daemon_start", 0), ev("state_rebuilt", 0)])[0].pending_rollback == 25
    assert state_rebuild.state_from_events([*lost, ev("generation_start", 2)])[0].pending_rollback is None


def test_an_empty_log_rebuilds_a_new_state():
    state, counts = state_rebuild.state_from_events([])
    assert state == RunState() and set(counts.values()) == {0}


def test_rotated_logs_are_read_oldest_first_and_torn_lines_passed_over(tmp_path):
    log = tmp_path / "events.jsonl"
    lines = [json.dumps(e) for e in EVENTS]
    (tmp_path / "events.jsonl.2").write_text("\n".join(lines[:5]) + "\n")
    (tmp_path / "events.jsonl.1").write_text("\n".join(lines[5:10]) + '\n{"ts": "2025-01-02T0')   # torn
    log.write_text("\n".join(lines[10:]) + "\n[1, 2]\n")
    (tmp_path / "events.jsonl.old").write_text("not a backup")
    assert state_rebuild.read_events(log) == EVENTS


# RunState's own methods (the only way the state changes) -----------------------------------------

def test_the_live_path_and_the_rebuild_apply_an_incident_alike():
    """RunState.apply_incident is the one place an incident changes the state: the Ledger calls it live,
    the rebuild for each incident event; fed the same records, they agree."""
    rebuilt, _ = state_rebuild.state_from_events(EVENTS)
    live = RunState()
    live.hold_undecided(rebuilt.incidents[1].incident)
    for record in rebuilt.incidents:
        live.apply_incident(record)
    assert live.undecided is None                                       # a decided incident is no longer held
    assert (live.incidents, live.config_changes, live.recovery, live.pending_rollback) == (
        rebuilt.incidents, rebuilt.config_changes, rebuilt.recovery, rebuilt.pending_rollback)
    live.rollback_done(50)
    assert live.pending_rollback is None and live.last_committed_step == 50


def test_another_node_takes_node_0s_changes_and_directive_as_they_are_and_holds_no_rollback():
    state = RunState(config_changes={"train.recompute": True})
    record = state_rebuild.state_from_events(EVENTS)[0].incidents[1]          # the spike, rolled back
    directive = RecoveryDirective(checkpoint_step=25, skip_ranges=((1, 2), (232, 264)))
    state.apply_incident(record, in_force=({"train.micro_batch": 4}, directive))
    assert state.config_changes == {"train.micro_batch": 4} and state.recovery == directive
    assert state.pending_rollback is None and state.incidents == [record]


def test_a_failing_spell_of_checkpoints_begins_once_and_ends_at_a_commit():
    state = RunState()
    assert [state.checkpoint_failed(40), state.checkpoint_failed(50)] == [True, False]
    assert state.checkpoint_committed() == 40 and state.checkpoint_committed() is None
    assert state.checkpoints_failing_since is None


def test_restarts_count_against_progress_until_a_newer_checkpoint_is_committed():
    state = RunState()
    state.set_last_committed(20)
    state.count_restart_progress(20)
    state.count_restart_progress(20)
    assert state.restarts_without_progress == 2
    state.count_restart_progress(30)
    assert state.restarts_without_progress == 0 and state.count_restart() == 1


# Strict JSON ------------------------------------------------------------------------------------

def test_non_finite_floats_are_written_as_strings_and_read_back(tmp_path):
    state = RunState(generation=2, last_progress={"step": 7, "loss": float("nan"), "lr": float("inf")})
    state.incidents.append(IncidentRecord(incident=Incident(kind=Kind.NON_FINITE, first_step=7, last_step=7,
                                                            evidence={"loss": float("nan"), "grads": [float("-inf")]}),
                                          generation=2, unix_s=1.0))
    state.save(tmp_path)
    text = (tmp_path / STATE_FILE).read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in state.json"))
    back = RunState.load(tmp_path)
    assert math.isnan(back.last_progress["loss"]) and back.last_progress["lr"] == math.inf
    assert math.isnan(back.incidents[0].incident.evidence["loss"])
    assert back.incidents[0].incident.evidence["grads"] == [-math.inf]


def test_an_older_file_with_a_bare_nan_still_loads(tmp_path):
    (tmp_path / STATE_FILE).write_text('{"generation": 3, "last_progress": {"loss": NaN}, "a_newer_key": 1}')
    state = RunState.load(tmp_path)
    assert state.generation == 3 and math.isnan(state.last_progress["loss"])


# Corrupt files ----------------------------------------------------------------------------------

CORRUPT = [
    # (content, words of the reason)
    (b"\x00\xff\x13garbage\x89PNG", "not UTF-8"),
    (b"{ this is not json", "not JSON"),
    (b"[]", "top level is a list"),
    (b'"state"', "top level is a string"),
    (b'{"generation": "x"}', 'generation = "x" is not an integer'),
    (b'{"restarts": true}', "restarts = true is not an integer"),
    (b'{"recovery": [1, 2]}', "recovery = [1, 2] is not an object or null"),
    (b"", "empty"),
    (b"\n  \n", "empty"),
    (b'{"incidents": [5]}', "incidents[0] = 5 is not an object"),
    (b'{"incidents": {"kind": "crash"}}', "incidents = "),
    (b'{"incidents": [{"kind": "no_such_kind", "first_step": 1}]}', "incidents[0] is not an incident record"),
    (b'{"incidents": [{"first_step": 1}]}', "incidents[0] is not an incident record: no 'kind'"),
    (b'{"recovery": {"skip_ranges": []}}', "recovery is not a recovery directive: no 'checkpoint_step'"),
]


@pytest.mark.parametrize("content,why", CORRUPT, ids=[c[1] for c in CORRUPT])
def test_a_corrupt_file_is_an_error_naming_it_and_why(tmp_path, content, why):
    (tmp_path / STATE_FILE).write_bytes(content)
    with pytest.raises(StateCorruptError) as info:
        RunState.load(tmp_path)
    assert isinstance(info.value, DataError)            # the CLI's exit 65
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / STATE_FILE) in message and why in message
    assert "rebuilds it from the event log" in message


def _ledger(run, out):
    return Ledger(run, EventLog(run / "logs" / "events.jsonl", "r", stream=out), Metrics("r"), Notifier({}),
                  total_steps=100)


@pytest.mark.parametrize("content,why", CORRUPT, ids=[c[1] for c in CORRUPT])
def test_the_daemon_sets_a_corrupt_file_aside_and_rebuilds_from_the_log(tmp_path, content, why):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    lines = [json.dumps(e) for e in EVENTS]
    (run / "logs" / "events.jsonl.1").write_text("\n".join(lines[:9]) + "\n")
    (run / "logs" / "events.jsonl").write_text("\n".join(lines[9:]) + "\n")
    (run / STATE_FILE).write_bytes(content)
    out = io.StringIO()
    ledger = _ledger(run, out)
    (aside,) = run.glob(f"{STATE_FILE}.corrupt-*")
    assert aside.read_bytes() == content                         # never deleted, never changed
    state = ledger.state
    assert [r.kind for r in state.incidents][1:] == ["loss_spike", "crash", "oom", "loss_collapse"]
    assert state.recovery.skip_ranges == ((232, 264), (472, 496)) and state.pending_rollback == 50
    assert state.log_dir == str(run / "logs") and state.total_steps == 100
    (event,) = [json.loads(l) for l in out.getvalue().splitlines() if '"state_rebuilt"' in l]
    assert event["level"] == "error" and event["path"] == str(aside) and why in event["detail"]
    assert event["rebuilt"]["incidents"] == 4 and event["generations"] == 4 and event["pending_rollback"] == 50
    ledger.begin(total_steps=100, log_dir=run / "logs")          # what the daemon does next: saved, readable
    assert RunState.load(run).recovery == state.recovery
    ledger.log.close()


def test_a_sound_file_is_loaded_not_rebuilt(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    RunState(generation=7).save(run)
    out = io.StringIO()
    ledger = _ledger(run, out)
    assert ledger.state.generation == 7 and "state_rebuilt" not in out.getvalue()
    assert not list(run.glob("*.corrupt-*"))
    ledger.log.close()


def test_setting_aside_never_overwrites_an_earlier_corrupt_file(tmp_path):
    for n in range(3):
        (tmp_path / STATE_FILE).write_text(f"bad {n}")
        set_aside(tmp_path, 1700000000.9)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "state.json.corrupt-1700000000", "state.json.corrupt-1700000000-1", "state.json.corrupt-1700000000-2"]
    assert (tmp_path / "state.json.corrupt-1700000000-2").read_text() == "bad 2"


# The CLI ----------------------------------------------------------------------------------------

def test_status_on_a_corrupt_file_is_one_line_and_65(tmp_path, capsys):
    (tmp_path / STATE_FILE).write_bytes(b"\x00garbage")
    assert cli_main.main(["status", str(tmp_path)]) == ExitCode.DATA_ERROR == 65
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("llm-pretrain: data error: ") and "state.json is corrupt" in line
    assert "the daemon sets it aside and rebuilds it" in line and "Traceback" not in captured.err
    assert captured.out == ""


def test_logs_on_a_corrupt_file_still_reads_the_log(tmp_path, capsys):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "events.jsonl").write_text(json.dumps(EVENTS[0]) + "\n")
    (tmp_path / STATE_FILE).write_text("[]")
    assert cli_main.main(["logs", str(tmp_path), "--json"]) == ExitCode.OK
    captured = capsys.readouterr()
    assert json.loads(captured.out) == EVENTS[0] and "state.json is corrupt" in captured.err



def test_the_rebuild_keeps_a_pending_rerun_until_its_verdict_and_counts_the_verdicts():
    rerun = {"type": "rerun", "reason": "non_finite: rerun step 70 from step 68", "checkpoint_step": 68,
             "first_step": 70, "last_step": 70}
    decided = [ev("generation_start", 1, resume_step=0),
               incident(1, "non_finite", 70, 70, rerun, evidence={"observed": {"70": ["nan", "inf", True]},
                                                                  "drill": {"fault": "spike", "rank": 1}}),
               ev("rollback", 1, "warning", cause="non_finite", checkpoint_step=68, rolled_back_steps=[]),
               ev("generation_start", 2, resume_step=68)]
    state, counts = state_rebuild.state_from_events(decided)
    assert state.rerun["first_step"] == 70 and state.rerun["checkpoint_step"] == 68
    assert math.isnan(state.rerun["observed"]["70"][0]) and state.rerun["drills"] == [{"fault": "spike", "rank": 1}]
    assert state.recovery is None and state.pending_rollback is None and counts["rollbacks"] == 0
    state, _ = state_rebuild.state_from_events([*decided, ev("triage", 2, "warning", verdict="transient",
                                                             first_step=70)])
    assert state.rerun is None and state.triage == {"transient": 1} and state.transient_steps == [70]
    # and state.json keeps them both ways
    again = RunState.from_dict(json.loads(json.dumps(state.to_dict())))
    assert (again.triage, again.transient_steps, again.rerun) == ({"transient": 1}, [70], None)
