"""Events for people: one line each, progress with step/total, loss, tokens/s and ETA, floats rounded,
long evidence folded; on a terminal the daemon's stream renders them, events.jsonl stays JSON."""
import io
import json

from cli.console import FOLD, ConsoleStream, human
from daemon.records.eventlog import EventLog


def test_progress_reads_as_a_progress_line():
    line = human({"ts": "2026-11-30T21:30:05.123Z", "level": "info", "event": "progress", "run": "tiny",
                  "generation": 2, "step": 120, "total_steps": 200, "loss": 2.345678, "lr": 0.0003,
                  "tokens_per_s": 12345.6, "eta_s": 80.0, "skipped": False})
    assert line == "21:30:05 INFO    g2 progress           step 120/200  loss 2.3457  lr 3.00e-04  12,346 tokens/s  ETA 1m20s"


def test_other_events_round_floats_and_fold_long_values():
    evidence = {"median": 2.123456789, "recent": [2.0 + i / 1000 for i in range(60)]}
    line = human({"ts": "2026-11-30T21:30:05.123Z", "level": "error", "event": "incident_detected",
                  "generation": 1, "kind": "loss_spike", "step": 205, "evidence": evidence}, full_time=True)
    assert line.startswith("2026-11-30T21:30:05.123Z ERROR   g1 incident_detected  kind=loss_spike step=205 evidence=")
    assert '"median":2.123' in line and line.endswith("…") and len(line.split("evidence=")[1]) == FOLD + 1


def test_colour_only_when_asked_and_by_level():
    record = {"ts": "2026-11-30T21:30:05.123Z", "level": "warning", "event": "stopping", "generation": 1}
    assert human(record, colour=True).startswith("\x1b[33m") and "\x1b" not in human(record)


def test_the_daemon_stream_on_a_terminal_is_human_and_the_file_stays_json(tmp_path):
    out = io.StringIO()
    log = EventLog(tmp_path / "events.jsonl", "tiny", ConsoleStream(out, colour=False))
    log.emit("progress", step=3, total_steps=10, loss=2.0, lr=1e-3, tokens_per_s=100.0, eta_s=7.0)
    log.emit("crash", level="error", rank=1, cause="exit code 1")
    log.close()
    shown = out.getvalue().splitlines()
    assert "step 3/10  loss 2.0000" in shown[0] and shown[1].endswith("crash              rank=1 cause=exit code 1")
    assert [json.loads(l)["event"] for l in (tmp_path / "events.jsonl").read_text().splitlines()] == ["progress", "crash"]


def test_train_s_own_events_read_as_progress_phases_checkpoints_and_its_end():
    """`train` by hand on a terminal: a step is a progress line whose ETA comes from the wall time
    between progress lines; phases, commits and the exit are sentences, not JSON."""
    out = io.StringIO()
    console = ConsoleStream(out, colour=False, total_steps=100)
    ticks = iter([100.0, 104.5])
    console.worker.clock = lambda: next(ticks)
    step = dict(kind="step", rank=0, generation=0, loss=2.5, grad_norm=1.0, loss_scale=1.0, lr=1e-3,
                lr_multiplier=1.0, skipped=False, sample_start=0, sample_end=8, tokens=512, tokens_per_s=5120.0)
    console.write(json.dumps({"kind": "phase", "rank": 0, "generation": 0, "phase": "compile", "step": 0}) + "\n")
    console.write(json.dumps({**step, "step": 1, "step_s": 30.0}) + "\n")          # compiled: not in the ETA
    console.write(json.dumps({**step, "step": 10, "step_s": 0.5}) + "\n")
    console.write(json.dumps({"kind": "checkpoint", "rank": 0, "generation": 0, "step": 10, "stage": "staged"}) + "\n")
    console.write(json.dumps({"kind": "checkpoint", "rank": 0, "generation": 0, "step": 10, "stage": "committed",
                              "seconds": 1.5}) + "\n")
    console.write(json.dumps({"kind": "exit", "rank": 0, "generation": 0, "step": 10, "reason": "stopped"}) + "\n")
    lines = out.getvalue().splitlines()
    assert "compiling the step" in lines[0]
    assert "step 10/100" in lines[2] and "loss 2.5000" in lines[2] and "5,120 tokens/s" in lines[2]
    assert "ETA" not in lines[1] and "ETA 0m45s" in lines[2]      # 4.5 s for 9 steps: 90 more x 0.5 s
    assert "checkpoint step 10 committed in 1.5 s" in lines[3]
    assert lines[4].endswith("stopped at step 10")
    assert not any(line.lstrip().startswith("{") for line in lines)


def test_json_is_kept_on_a_terminal_when_asked_and_people_get_lines_by_default(monkeypatch):
    import argparse
    import os
    import pty
    import sys

    from cli import main as cli_main

    leader, follower = pty.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            monkeypatch.setattr(sys, "stdout", tty)
            assert tty.isatty()
            assert cli_main._console(argparse.Namespace(log_format="json"), default=True) is None
            assert cli_main._console(argparse.Namespace(log_format="auto"), default=True) is not None
            assert cli_main._console(argparse.Namespace(log_format="auto"), default=False) is None
    finally:
        os.close(leader)
        os.close(follower)


def test_the_daemons_last_line_gives_its_reason_in_full():
    reason = "rank 0 ended with exit code 78: config error: " + "x" * 200 + " (see runs/tiny/logs/rank-0.log)"
    line = human({"ts": "2026-11-30T21:30:05.123Z", "level": "error", "event": "daemon_exit", "code": 78,
                  "reason": "worker_error", "detail": reason})
    assert reason in line
    assert "…" in human({"ts": "2026-11-30T21:30:05.123Z", "level": "info", "event": "incident", "detail": reason})


def test_saves_are_said_on_the_next_progress_line_not_one_line_each():
    """1,500 steps with a save every 50 and a progress line every 500 (what the default intervals give a fast
    run): three progress lines, no line of their own for the 30 commits; a final commit no progress line
    follows is said once, before the daemon's last word."""
    import json as _json

    out = io.StringIO()
    console = ConsoleStream(out, colour=False)

    def event(name, **fields):
        console.write(_json.dumps({"ts": "2026-12-06T04:00:00Z", "level": "info", "event": name, "run": "tiny",
                                   "generation": 1, **fields}) + "\n")

    for step in range(50, 1501, 50):
        event("checkpoint_committed", rank=0, step=step, detail="step-%08d" % step)
        if step % 500 == 0:
            event("progress", step=step, total_steps=1600, loss=2.5, lr=1e-3, tokens_per_s=9000.0)
    event("checkpoint_committed", rank=0, step=1600, detail="final")
    event("daemon_exit", code=0, status="finished")
    lines = out.getvalue().splitlines()
    assert len(lines) == 5, lines
    assert [("progress" in l, "saved step" in l) for l in lines[:3]] == [(True, True)] * 3
    assert "saved step 1500" in lines[2]
    assert "checkpoint_committed" in lines[3] and "step=1600" in lines[3] and "daemon_exit" in lines[4]


def test_why_the_daemon_gave_up_is_said_in_full_and_other_prose_is_folded_at_a_word():
    reason = ("3 restarts without a new checkpoint; the last incident: crash: rank 0: exit code 70: "
              "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)")
    line = human({"ts": "2026-12-06T04:00:00Z", "level": "error", "event": "gave_up", "generation": 3,
                  "reason": reason, "last_incident": {"x": "y" * 300}})
    assert f"reason={reason}" in line and line.endswith("…")        # the evidence is folded, the reason is not
    incident = human({"ts": "2026-12-06T04:00:00Z", "level": "error", "event": "incident", "detail": reason})
    shown = incident.split("detail=")[1]
    assert shown.endswith("…") and reason.startswith(shown[:-1]) and reason[len(shown) - 1] == " "
