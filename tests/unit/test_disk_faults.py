"""A disk that refuses writes (full, read-only) never ends the daemon: its log, its state and its
commands degrade and recover; failed saves leave nothing behind."""
import io
import json
import shutil

from checkpointing import layout
from daemon.judging.incidents import Kind
from daemon.records.eventlog import EventLog
from daemon.records.ledger import Ledger
from daemon.records.metrics import Metrics
from daemon.records.notify import Notifier
from durable import write_atomically


def test_the_event_log_on_a_full_disk_goes_on_to_the_stream(tmp_path, capsys):
    out = io.StringIO()
    log = EventLog(tmp_path / "events.jsonl", "r", stream=out)
    log._sink.path = tmp_path / "full"                 # reopened below onto /dev/full: every write ENOSPC
    log._sink._file.close()
    log._sink._file = open("/dev/full", "a", buffering=1)
    for i in range(3):
        log.emit("progress", step=i)
    assert [json.loads(l)["step"] for l in out.getvalue().splitlines()] == [0, 1, 2]
    assert capsys.readouterr().err.count("cannot write") == 1          # said once, not per line
    log.close()


def test_an_unwritable_state_is_kept_in_memory_and_written_when_the_disk_takes_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    out = io.StringIO()
    ledger = Ledger(run, EventLog(None, "r", stream=out), Metrics("r"), Notifier({}), total_steps=10)
    shutil.rmtree(run)
    run.write_text("not a directory")                  # state.json cannot be written: NotADirectoryError
    ledger.state.generation = 3
    ledger.save()
    ledger.checkpoint_failed(40, "OSError: [Errno 28] No space left on device")
    ledger.checkpoint_failed(50, "OSError: [Errno 28] No space left on device")
    events = [json.loads(l) for l in out.getvalue().splitlines()]
    assert [e["event"] for e in events] == ["state_save_failed", "health_warning"]
    assert events[1]["kind"] == Kind.CHECKPOINT_FAILING and "since step 40" in events[1]["detail"]
    assert "llm_pretrain_checkpoints_failing_since_step{" in ledger.metrics.render()
    assert [l for l in ledger.metrics.render().splitlines()
            if l.startswith("llm_pretrain_checkpoints_failing_since_step{")][0].endswith(" 40")
    run.unlink()
    run.mkdir()
    ledger.state_file.retried_at = 0.0
    ledger.tick(now=0.0)
    assert json.loads((run / "state.json").read_text())["generation"] == 3
    assert json.loads(out.getvalue().splitlines()[-1])["event"] == "state_saved"
    ledger.checkpoint_committed(60)
    assert json.loads(out.getvalue().splitlines()[-1])["failing_since_step"] == 40
    assert json.loads((run / "state.json").read_text())["checkpoints_failing_since"] is None
    assert [l for l in ledger.metrics.render().splitlines()
            if l.startswith("llm_pretrain_checkpoints_failing_since_step{")][0].endswith(" 0")


def test_a_refused_atomic_write_leaves_no_part_behind(tmp_path):
    try:
        write_atomically(tmp_path / "x" / "f", "data")   # no such directory
    except OSError:
        pass
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").mkdir()                       # a directory in the way of the rename
    try:
        write_atomically(tmp_path / "d" / "f", "data")
    except OSError:
        pass
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["f"]


def test_rank_0_removes_what_failed_saves_of_earlier_steps_left(tmp_path):
    for name in ("step-00000010.tmp", "step-00000020.tmp", "step-00000030.tmp", "step-00000020"):
        (tmp_path / name).mkdir()
    assert layout.remove_stale_saves(tmp_path, before_step=30) == ["step-00000010.tmp", "step-00000020.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000020", "step-00000030.tmp"]


def test_a_metrics_textfile_the_disk_refuses_never_raises_and_is_written_again_later(tmp_path):
    metrics = Metrics("r")
    blocked = tmp_path / "textfile-dir"
    metrics.textfile(blocked / "llm_pretrain.prom")
    blocked.rmdir()
    blocked.write_text("a file where the textfile's directory should be")
    metrics.update(step=5)
    metrics.flush(force=True)                            # NotADirectoryError: kept, never raised
    assert metrics.textfile_error and "textfile-dir" in metrics.textfile_error
    blocked.unlink()
    blocked.mkdir()
    metrics.flush(force=True)
    assert metrics.textfile_error is None and "llm_pretrain_step" in (blocked / "llm_pretrain.prom").read_text()


def test_room_for_fewer_than_two_more_checkpoints_is_one_warning_until_space_comes_back(tmp_path):
    from contracts.config import load_config
    from daemon.acting.effects_of_watch import _disk_space
    from daemon.processes.run_files import RunFiles

    files = RunFiles(load_config(None, [f'run.dir="{tmp_path / "run"}"']), {})
    step_dir = layout.step_dir(files.ckpt_root, 10)
    step_dir.mkdir(parents=True)
    free = shutil.disk_usage(tmp_path).free

    def checkpoint_of(size):
        (step_dir / "manifest.json").write_text(json.dumps({"format": "llm-pretrain-checkpoint", "version": 1, "step": 10,
                                                         "shards": [{"size_bytes": size}]}))

    out = io.StringIO()
    ledger = Ledger(tmp_path / "run", EventLog(None, "r", stream=out), Metrics("r"), Notifier({}), total_steps=10)
    checkpoint_of(free // 3)                           # room for about three: quiet
    _disk_space(ledger, files, 10)
    checkpoint_of(free // 2 + 1)                       # room for one: a warning, once
    _disk_space(ledger, files, 10)
    _disk_space(ledger, files, 10)
    checkpoint_of(1024)                                # space came back: said again next time
    _disk_space(ledger, files, 10)
    checkpoint_of(free)
    _disk_space(ledger, files, 10)
    warnings = [json.loads(l) for l in out.getvalue().splitlines() if '"health_warning"' in l]
    assert [w["kind"] for w in warnings] == [Kind.DISK_SPACE_LOW] * 2
    assert "room for fewer than two more checkpoints" in warnings[0]["detail"]
