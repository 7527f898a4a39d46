"""The pure parts of post-mortem bundles (daemon.records.bundles): naming, bounds, what is retired."""
import json

from daemon.judging.incidents import Incident, IncidentRecord, Kind, Restart
from daemon.records import bundles


def _line(generation, event="step"):
    return json.dumps({"event": event, "generation": generation})


def test_a_bundle_is_named_by_its_incident_and_read_back():
    assert bundles.name(3, 2, "loss_spike") == "0003-g2-loss_spike"
    assert bundles.parse("0003-g2-loss_spike") == (3, 2, "loss_spike")
    assert bundles.parse(".0003-g2-crash.tmp") is None and bundles.parse("notes") is None


def test_the_events_are_the_generation_s_and_a_bounded_number_before():
    lines = [_line(1) for _ in range(300)] + [_line(2) for _ in range(10)]
    kept = bundles.events_around(lines, 2, before=5)
    assert len(kept) == 15 and kept[5:] == lines[300:]
    assert bundles.events_around(["not json", _line(2)], 2, before=0) == [_line(2)]
    capped = bundles.events_around(lines, 2, before=200, cap=10 * (len(_line(2)) + 1))
    assert capped == lines[-10:]                                  # the newest kept within the cap


def test_rank_tails_share_a_budget_and_the_whole_is_bounded():
    assert bundles.tail_bytes(1) == bundles.LOG_TAIL_BYTES
    assert bundles.tail_bytes(64) * 64 <= bundles.LOG_TAILS_BYTES
    files = {"incident.json": b"{}", "events.jsonl": b"e" * 50, "rank-0.log.tail": b"0123456789" * 10}
    fitted = bundles.fit(files, total=80)
    assert fitted["incident.json"] == b"{}" and fitted["events.jsonl"] == b"e" * 50
    assert fitted["rank-0.log.tail"] == (b"0123456789" * 10)[-28:]      # its newest bytes
    assert sum(map(len, fitted.values())) <= 80


def test_the_newest_are_kept_and_the_others_go_with_their_checkpoints():
    found = {"0000-g1-crash": 0, "0001-g2-hang": 50, "0002-g3-crash": 100, "0003-g4-nan": 150}
    assert bundles.to_retire(found, keep=2, committed=[50, 100, 150]) == ["0000-g1-crash", "0001-g2-hang"]
    assert bundles.to_retire(found, keep=10, committed=[50, 100, 150]) == []     # nothing retired yet
    assert bundles.to_retire(found, keep=10, committed=[100, 150], retired=[50]) == ["0000-g1-crash", "0001-g2-hang"]
    assert bundles.to_retire(found, keep=10, committed=[150], retired=[100], ) == [
        "0000-g1-crash", "0001-g2-hang", "0002-g3-crash"]


def test_a_bundle_is_written_whole_and_retired(tmp_path):
    log = tmp_path / "rank-0.log"
    log.write_bytes(b"previous generation\n" + b"x" * 100)
    (tmp_path / "config.toml").write_text("[train]\nsteps = 5\n")
    root = tmp_path / "incidents"
    for i in range(3):
        record = IncidentRecord(incident=Incident(kind=Kind.CRASH, first_step=4, last_step=4, rank=0),
                                generation=i + 1, unix_s=0.0, committed_step=0, action=Restart("a crash"))
        bundles.write(root, record=record, index=i, resume_step=0, trajectory_hash="abc", run="r", node=0,
                      config_path=tmp_path / "config.toml", events_path=tmp_path / "absent.jsonl",
                      rank_logs={0: (str(log), 20)}, keep=2)
    assert list(bundles.listed(root)) == ["0001-g2-crash", "0002-g3-crash"]
    assert not list(root.glob(".*"))
    bundle = root / "0002-g3-crash"
    assert (bundle / "rank-0.log.tail").read_bytes() == b"x" * 100          # from where the generation began
    rec = json.loads((bundle / "incident.json").read_text())
    assert (rec["kind"], rec["resume_step"], rec["resume_reason"], rec["trajectory_hash"]) == ("crash", 0, "a crash",
                                                                                              "abc")
    assert "(not readable" in (bundle / "events.jsonl").read_text()
    assert bundles.retire(root, keep=5, committed=[10], retired=[5]) == ["0001-g2-crash", "0002-g3-crash"]
