"""The soak's pure parts: its arguments, the verdict, the report's per-fault numbers, reading a run."""
import argparse
import json

import pytest

from chaos import faults
from chaos.command import fault_list, seconds
from chaos.soak import verdict
from chaos.view import RunView


@pytest.mark.parametrize("text,expected", [("90", 90.0), ("90s", 90.0), ("10m", 600.0), ("1.5h", 5400.0)])
def test_durations(text, expected):
    assert seconds(text) == expected


@pytest.mark.parametrize("text", ["", "0", "-5m", "10d", "m"])
def test_bad_durations_name_what_is_allowed(text):
    with pytest.raises(argparse.ArgumentTypeError, match="s, m or h"):
        seconds(text)


def test_fault_lists():
    assert fault_list("crash, daemon-kill,crash") == ["crash", "daemon-kill"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown fault.*boom.*choose from crash"):
        fault_list("crash,boom")


def _report(*kinds, finished=True, digest="a", code=0, error=None):
    return {"faults": [{"fault": k, "error": error} for k in kinds], "finished": finished,
            "params_sha256": digest, "daemon_exit_code": code}


@pytest.mark.parametrize("report,reference,exact,ok", [
    (_report("crash", "daemon-kill"), "a", True, True),
    (_report("crash"), "b", False, False),                      # recovered, but the weights differ
    (_report("crash", "nan"), "b", None, True),                 # a rollback changes the trajectory by design
    (_report("crash"), None, None, True),                       # no reference run to compare with
    (_report("crash", finished=False), "a", None, False),
    (_report("crash", error="not recovered within 600 s"), "a", True, False),
    (_report("crash", code=3), "a", True, False),
])
def test_verdict(report, reference, exact, ok):
    out = verdict(report, reference)
    assert out["bit_exact"] is exact and out["ok"] is ok
    assert (out["bit_exact_note"] == "") is (exact is not None)


def test_an_injection_reports_its_times_from_the_moment_of_injection():
    inj = faults.Injection("crash", at=100.0, generation=1, step=40, rank=1, detected_at=100.5, recovered_at=112.25,
                           resume_step=30, lost_steps=10)
    out = inj.to_dict()
    assert (out["detection_s"], out["recovery_s"], out["lost_steps"]) == (0.5, 12.25, 10)
    assert "_cleared_at" not in out


def test_the_view_reads_events_steps_pids_and_the_digest_skipping_partial_lines(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "events.jsonl").write_text(
        '{"ts": "2026-11-30T20:00:00.000Z", "event": "generation_start", "generation": 1, '
        '"pids": {"-1": 10, "0": 11, "1": 12}, "resume_step": 0}\n'
        '{"ts": "2026-11-30T20:00:05.500Z", "event": "crash", "generation": 1}\n{"ts": "2026-11-30T2')
    steps = [{"kind": "step", "generation": 1, "step": s, "step_s": 0.1} for s in (1, 2, 3)]
    (logs / "rank-0.log").write_text("\n".join(json.dumps(s) for s in steps) + "\n[WARNING] noise\n"
                                     + json.dumps({"kind": "exit", "params_sha256": "abc"}) + "\n")
    (tmp_path / "daemon.lock").write_text("4242\n")
    view = RunView(tmp_path, logs)
    assert view.rank_pids() == {-1: 10, 0: 11, 1: 12} and view.daemon_pid() == 4242
    assert view.last_step() == (1, 3) and view.final_digest() == "abc"
    crash = view.first("crash", since_unix_s=0)
    assert crash["unix_s"] - view.events()[0]["unix_s"] == pytest.approx(5.5)
    assert view.first("crash", since_unix_s=crash["unix_s"] + 1) is None
