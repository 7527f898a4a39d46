"""The daemon's log: one schema on every line, strict JSON, size-based rotation."""
import io
import json

from daemon.records.eventlog import COMMON, EventLog


def test_every_line_has_the_common_fields_first_and_rotation_keeps_n_files(tmp_path):
    out = io.StringIO()
    log = EventLog(tmp_path / "events.jsonl", "demo", stream=out, max_bytes=400, backups=2)
    for step in range(30):
        log.generation = 1 + step // 10
        log.emit("progress", step=step, loss=float("nan") if step == 3 else 2.5)
    log.emit("incident", level="error", generation=7, evidence={"values": [float("inf")]})
    log.close()
    lines = out.getvalue().splitlines()
    records = [json.loads(l, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c))) for l in lines]
    assert all(list(r)[:5] == list(COMMON) for r in records)
    assert records[3]["loss"] == "nan" and records[-1]["evidence"] == {"values": ["inf"]}
    assert records[-1]["generation"] == 7 and records[-1]["level"] == "error"
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["events.jsonl", "events.jsonl.1", "events.jsonl.2"]
    assert all(p.stat().st_size <= 400 for p in tmp_path.iterdir())
    kept = [l for name in reversed(files) for l in (tmp_path / name).read_text().splitlines()]
    assert kept == lines[-len(kept):]                 # the newest lines, in order; the oldest dropped


def test_under_journald_each_stream_line_carries_its_level_as_a_syslog_priority(tmp_path, monkeypatch):
    import os

    from daemon.records.eventlog import EventLog

    out = tmp_path / "journal"
    with open(out, "w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        log = EventLog(tmp_path / "events.jsonl", "r", stream)
        log.emit("crash", level="error", rank=1)
        log.emit("progress", step=3)
        log.emit("stopping", level="warning")
        log.close()
    lines = out.read_text().splitlines()
    assert [l[:4] for l in lines] == ["<3>{", "<6>{", "<4>{"]
    assert all(not l.startswith("<") for l in (tmp_path / "events.jsonl").read_text().splitlines())


def test_not_under_journald_the_stream_gets_plain_json(tmp_path, monkeypatch):
    from daemon.records.eventlog import EventLog

    monkeypatch.setenv("JOURNAL_STREAM", "1:2")
    out = tmp_path / "stream"
    with open(out, "w") as stream:
        log = EventLog(None, "r", stream)
        log.emit("crash", level="error")
    assert out.read_text().startswith('{"ts"')
