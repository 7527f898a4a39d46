"""`status` tells the truth: an ETA from the recent mean step time, elapsed time, what recovery keeps
in force, and a loud warning when the daemon is dead but processes of its run are not."""
import json
import os

from cli.status import render, summary
from daemon.processes.generation import start_ticks

DEAD_PID = 2 ** 22 + 12345          # above pid_max's default: never a live process


def _state(run, **fields):
    base = {"status": "running", "total_steps": 1000, "daemon_pid": os.getpid(), "started_unix_s": 1000.0,
            "last_progress": {"step": 400, "loss": 2.5, "tokens_per_s": 9000.0, "tokens": 512, "unix_s": 4600.0,
                              "mean_step_s": 0.25}}
    (run / "state.json").write_text(json.dumps({**base, **fields}))


def test_eta_is_the_recent_mean_step_time_times_the_steps_left(tmp_path):
    _state(tmp_path)
    s = summary(tmp_path, now=4601.0)
    assert s["eta_s"] == 600 * 0.25 and s["elapsed_s"] == 3601.0
    text = render(s)
    assert "ETA              2m30s  (0.250 s/step, recent mean)" in text and "elapsed          1h00m" in text


def test_paused_says_so_instead_of_an_eta(tmp_path):
    _state(tmp_path, status="paused")
    s = summary(tmp_path, now=4601.0)
    assert s["eta_s"] is None and "ETA              paused" in render(s)


def test_what_recovery_keeps_in_force_is_shown(tmp_path):
    recovery = {"checkpoint_step": 300, "skip_ranges": [[100, 140]], "quarantined_blocks": [["tokens-00001.bin", 3]],
                "lr_overrides": [{"start_step": 301, "factor": 0.5, "hold_steps": 200, "ramp_steps": 200}],
                "loss_scale": None, "loss_scale_cap": 1024.0, "loss_scale_cap_until_step": 1300}
    _state(tmp_path, recovery=recovery)
    text = render(summary(tmp_path, now=4601.0))
    assert "lr override      x0.5 from step 301, held 200, ramped back over 200" in text
    assert "loss scale cap   1024 until step 1300" in text
    assert "1 skipped sample window(s), 1 quarantined corpus block(s)" in text


def test_a_dead_daemon_with_live_processes_of_its_run_is_a_warning(tmp_path):
    me = {"pid": os.getpid(), "start_ticks": start_ticks(os.getpid()), "pgid": os.getpgid(0), "role": "rank",
          "rank": 0}
    _state(tmp_path, daemon_pid=DEAD_PID, processes=[me, {**me, "pid": DEAD_PID}])
    s = summary(tmp_path, now=4601.0)
    assert s["status"] == "running (daemon not running)" and s["unsupervised_pids"] == [os.getpid()]
    assert s["eta_s"] is None
    assert f"WARNING          the daemon is not running but processes of this run are: pids {os.getpid()}" in render(s)
    _state(tmp_path, processes=[me])                   # a live daemon: its own ranks, no warning
    assert summary(tmp_path, now=4601.0)["unsupervised_pids"] == []


def test_an_incident_a_drill_caused_is_labelled_as_a_drill(tmp_path):
    _state(tmp_path)
    s = summary(tmp_path, now=4601.0)
    s["last_incident"] = {"kind": "non_finite", "first_step": 80, "action": "rollback", "reason": "NaN", "drill": True}
    assert "last incident    non_finite (drill) at step 80 -> rollback: NaN" in render(s)
    s["last_incident"]["drill"] = False
    assert "non_finite at step 80 -> rollback" in render(s)


def test_logs_filter_by_rank_keeps_only_that_rank_s_events(tmp_path):
    import io

    from cli.status import logs

    path = tmp_path / "events.jsonl"
    records = [{"event": "crash", "level": "error", "rank": 1}, {"event": "crash", "level": "error", "rank": 0},
               {"event": "generation_start", "level": "info"}, {"event": "hang", "level": "error", "rank": 1}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = io.StringIO()
    logs(path, follow=False, level=None, events=[], rank=1, as_json=True, out=out)
    assert [json.loads(line)["event"] for line in out.getvalue().splitlines()] == ["crash", "hang"]


def test_a_multi_node_run_shows_node_0_s_view_and_every_node_without_etcd_saying_liveness_is_unknown(tmp_path):
    waiting = "waiting for a decider since 2026-12-03 03:00:01 UTC (incident: node_lost: node 0's daemon is gone)"
    for node, step in ((0, 400), (1, 398)):
        d = tmp_path / "nodes" / f"node-{node}"
        d.mkdir(parents=True)
        _state(d, generation=3, last_progress={"step": step, "loss": 2.5, "unix_s": 4600.0, "mean_step_s": 0.25},
               **({"waiting": waiting} if node == 1 else {}))
    s = summary(tmp_path, now=4601.0)          # no resolved config: no coordinator to ask
    assert s["step"] == 400 and [(n["node"], n["step"], n["lease"]) for n in s["nodes"]] == [(0, 400, None),
                                                                                            (1, 398, None)]
    text = render(s)
    assert f"node 1           running, generation 3, step 398; {waiting}" in text
    assert "etcd unreachable (node liveness unknown)" in text


def test_elapsed_stops_when_the_run_ends(tmp_path):
    """A run that ended (its daemon gone) does not age: elapsed is to its daemon's last word."""
    _state(tmp_path, status="finished", daemon_pid=DEAD_PID, updated_unix_s=4700.0)
    assert summary(tmp_path, now=4601.0 + 20 * 60)["elapsed_s"] == 3700.0
    assert "elapsed          1h01m" in render(summary(tmp_path, now=99999.0))


def test_the_step_shown_is_never_behind_the_last_committed_checkpoint(tmp_path):
    """The last progress kept may predate the last save (state.json is written every 10 s): a committed
    checkpoint proves its step was trained."""
    _state(tmp_path)                                     # last progress: step 400
    (tmp_path / "checkpoints" / "step-00000420").mkdir(parents=True)
    s = summary(tmp_path, now=4601.0)
    assert s["step"] == 420 and s["last_checkpoint"]["step"] == 420
    assert "step             420 / 1000" in render(s)


def test_the_lemon_list_shows_each_faulty_device_and_how_long_it_sits_out(tmp_path):
    lemons = {"node 0 device 1": {"node": 0, "device": 1, "quarantines": 1, "quarantined_until_unix_s": 4600.0 + 3600,
                                  "reason": "a device fault", "faults": [{"kind": "rank_outlier", "step": 61,
                                                                          "unix_s": 4600.0}]},
              "node 0 device 3": {"node": 0, "device": 3, "quarantines": 0, "quarantined_until_unix_s": None,
                                  "faults": [{"kind": "transient", "step": 70, "unix_s": 4000.0}]}}
    _state(tmp_path, lemons=lemons)
    s = summary(tmp_path, now=4601.0)
    assert s["lemons"]["node 0 device 1"]["quarantined_for_s"] == 3599.0
    text = render(s)
    assert "1 fault(s), quarantined 1x; left out for 59m59s more (a device fault)" in text
    assert "node 0 device 3" in text and "quarantined 0x; in the run" in text


def test_a_warning_never_hides_the_last_incident(tmp_path):
    """After a spike rolled back, throughput warnings follow (a busy machine): `status` still names the
    spike as the last incident, counts incidents without the warnings, and shows the last warning apart."""
    spike = {"kind": "loss_spike", "first_step": 300, "last_step": 304, "rank": None, "detail": "loss 9.1",
             "evidence": {}, "generation": 2, "unix_s": 4000.0, "committed_step": 250,
             "action": {"type": "rollback", "reason": "loss spike: roll back to 250", "checkpoint_step": 250}}
    warnings = [{"kind": "throughput_regression", "first_step": s, "last_step": s, "rank": None,
                 "detail": "", "evidence": {"tokens_per_s": 6000.0}, "generation": 3, "unix_s": 4100.0 + s,
                 "action": None} for s in (350, 380, 410)]
    _state(tmp_path, incidents=[spike, *warnings])
    s = summary(tmp_path, now=4601.0)
    assert s["last_incident"]["kind"] == "loss_spike" and s["last_incident"]["action"] == "rollback"
    assert (s["incidents"], s["warnings"]) == (1, 3)
    text = render(s)
    assert "last incident    loss_spike at step 300 -> rollback: loss spike: roll back to 250" in text
    assert "last warning     throughput_regression at step 410  (3 warnings in all)" in text


def test_logs_of_a_rank_keep_the_verdict_and_the_quarantine_of_its_device(tmp_path):
    """A faulty rank 1 (device 1 of node 0): its incident, the triage verdict naming it among the suspects, its
    device's quarantine and the next generation leaving that device out all concern rank 1; rank 0's crash and
    device 0 do not."""
    import io

    from cli.status import logs

    homes = {"0": [0, 0], "1": [0, 1]}
    records = [
        {"event": "incident", "level": "error", "kind": "rank_outlier", "rank": None,
         "evidence": {"suspects": [1], "homes": homes}},
        {"event": "triage", "level": "warning", "verdict": "device", "suspects": [1], "homes": homes},
        {"event": "quarantined", "level": "warning", "node": 0, "device": 1},
        {"event": "quarantined", "level": "warning", "node": 0, "device": 0},
        {"event": "devices_quarantined", "level": "warning", "devices": [0], "left_out": [1]},
        {"event": "crash", "level": "error", "rank": 0},
        {"event": "generation_start", "level": "info"}]
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = io.StringIO()
    logs(path, follow=False, level=None, events=[], rank=1, as_json=True, out=out)
    got = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [r["event"] for r in got] == ["incident", "triage", "quarantined", "devices_quarantined"]
    assert got[2]["device"] == 1


def test_after_a_clean_finish_every_machine_s_daemon_ended_it_was_not_lost(tmp_path):
    """Both daemons of a two-machine run exit after it finished: their leases are gone from etcd, which is
    what a lost machine looks like too; a node whose state says it ended is shown ended, one still running
    without a lease is LOST."""
    for node in (0, 1):
        d = tmp_path / "nodes" / f"node-{node}"
        d.mkdir(parents=True)
        _state(d, status="finished", generation=3, daemon_pid=DEAD_PID)
    s = summary(tmp_path, now=4601.0)
    for n in s["nodes"]:
        n["lease"] = False                                        # etcd answered: no lease for either
    text = render(s)
    assert "LOST" not in text and "node 1           finished, generation 3, step 400, daemon ended" in text
    s["nodes"][1]["status"] = "running"
    assert "node 1           running, generation 3, step 400, daemon LOST (no etcd lease)" in render(s)


def test_goodput_is_the_ratio_the_daemon_saved_not_one_rederived_from_rounded_seconds(tmp_path):
    """The daemon saves the ratio of its unrounded seconds (0.7285, also in the metrics); re-derived from the
    seconds as saved (rounded to ms) it is 0.7284: status said 72.8 % where the metrics said 72.85 %."""
    _state(tmp_path, goodput={"productive_s": 72.84, "badput_s": {"other": 27.16}, "wall_s": 100.0, "ratio": 0.7285})
    s = summary(tmp_path, now=4601.0)
    assert s["goodput"]["ratio"] == 0.7285
    assert "goodput          72.9% of" in render(s)
