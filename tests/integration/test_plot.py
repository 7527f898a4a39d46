"""`llm-pretrain plot` on a run with a rolled-back spike writes a valid PNG, and its summary names
the skipped steps, the superseded tail, the checkpoints and each incident's label."""
import json
import struct
import subprocess
import zlib

from cli import plot
from daemon.judging.incidents import Incident, IncidentRecord, Kind, Rollback
from daemon.records.state import RunState
from tests.integration.test_recovery_policy import QUICK_HEALTH
from tests.integration.test_supervisor import _finish, _start


def test_plot_of_a_run_with_a_rollback_is_a_valid_png(tmp_path, cli, quiet_env):
    run = tmp_path / "run"
    code, _, err = _finish(_start(run, overrides=QUICK_HEALTH, fake=[
        "--steps", "60", "--interval", "5", "--spike-at", "30", "--fault-generations", "1"]))
    assert code == 0, err
    out = tmp_path / "plots" / "loss.png"
    done = subprocess.run([*cli, "plot", str(run), "-o", str(out)], env=quiet_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "2 generation(s), 1 incident(s)" in done.stdout
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    # walk the chunks: every CRC right, IHDR first, IEND last, a sensible size
    pos, chunks = 8, []
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind}"
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height = struct.unpack(">II", chunks[0][1][:8])
    assert width >= 800 and height >= 500

    # the same picture in-process, for its summary
    info = plot.plot(run, tmp_path / "plots" / "again.png")
    skip_start, skip_end = RunState.load(run).incidents[0].action.skip
    assert skip_start == 8 * 29          # the fake worker reads 8 samples a step: step 30 is 232-240
    last = skip_end // 8
    assert info["skipped_steps"] == [[30, last]]
    assert info["labels"] == [f"loss_spike -> rollback to 25, skip steps 30\u2013{last} "
                              f"(samples 232\u2013{skip_end}), lr x0.5"]
    # generation 1 trained past 30 before it was stopped; generation 2 went back to 25 and trained 26 on
    assert info["superseded_steps"][1][0] == 26 and info["superseded_steps"][1][1] >= last
    assert 2 not in info["superseded_steps"]
    # committed every 5 steps: 5-30 in generation 1, 30-60 in generation 2
    assert info["checkpoints"] >= 6 + 7
    assert (info["generations"], info["incidents"]) == (2, 1)


def test_plot_of_a_run_that_never_trained_says_so(tmp_path, cli, quiet_env):
    (tmp_path / "run" / "logs").mkdir(parents=True)
    (tmp_path / "run" / "logs" / "rank-0.log").write_text("starting\n")
    done = subprocess.run([*cli, "plot", str(tmp_path / "run")], env=quiet_env, capture_output=True, text=True)
    assert done.returncode == 2 and "no step events" in done.stderr


def test_plot_reads_a_sparse_log_with_a_nan_step_and_labels_a_drill(tmp_path):
    # a rank log of every 5th step (`train.log_interval_steps = 5`) and of step 23, a NaN drill after which
    # generation 2 resumed from 20 (its compile phase says so) and first logged step 25
    run, lines = tmp_path / "run", ["starting"]
    for gen, steps, resumed in ((1, range(5, 24, 5), 0), (2, range(25, 41, 5), 20)):
        lines.append(json.dumps({"kind": "phase", "phase": "compile", "generation": gen, "rank": 0, "step": resumed}))
        for n in [*steps, 23] if gen == 1 else steps:
            lines.append(json.dumps({"kind": "step", "generation": gen, "rank": 0, "step": n,
                                     "loss": "nan" if n == 23 else 3.0, "lr": 1e-3, "tokens_per_s": 1e5,
                                     "sample_start": 8 * (n - 1), "sample_end": 8 * n}, sort_keys=True))
            if n % 10 == 0:
                lines.append(json.dumps({"kind": "checkpoint", "stage": "committed", "generation": gen,
                                         "rank": 0, "step": n}, sort_keys=True))
                lines.append(json.dumps({"kind": "eval", "generation": gen, "rank": 0, "step": n, "loss": 3.5,
                                         "perplexity": 33.1, "sequences": 32, "tokens": 2048, "seconds": 0.1}))
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "rank-0.log").write_text("\n".join(lines) + "\n")
    drill = Incident(kind=Kind.NON_FINITE, first_step=23, last_step=23, evidence={"drill": {"fault": "nan"}})
    slow = [IncidentRecord(incident=Incident(kind=Kind.THROUGHPUT_REGRESSION, first_step=s, last_step=s,
                                             needs_action=False), generation=2, unix_s=0.0) for s in (30, 35)]
    RunState(generation=2, status="finished", incidents=[IncidentRecord(
        incident=drill, generation=1, unix_s=0.0,
        action=Rollback("drill", checkpoint_step=20, skip=(176, 184), lr_overrides=())), *slow]).save(run)
    info = plot.plot(run, tmp_path / "loss.png")
    # the two throughput warnings are not incidents: neither listed nor counted
    assert info["labels"] == ["non_finite (drill) -> rollback to 20, skip step 23 (samples 176\u2013184)"]
    assert info["incidents"] == 1
    assert info["generations_drawn"] == 2          # both have finite losses to draw
    assert info["skipped_steps"] == [[23, 23]]
    assert info["superseded_steps"] == {1: [23, 23]}        # 21-22 were not logged, 23 was
    assert info["checkpoints"] == 4 and info["steps"] == 9       # 10, 20; 30, 40
    assert info["validations"] == 4                              # the validation loss after each of them
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_a_generation_with_nothing_to_draw_is_not_listed_and_a_lone_step_is_a_dot(tmp_path):
    """Generation 2 crashed after one step whose loss was NaN: nothing of it can be drawn, so it is not in the
    legend; generation 3's single step is drawn as a dot."""
    run = tmp_path / "run"
    lines = []
    for gen, steps, loss in ((1, range(1, 11), 3.0), (2, [11], "nan"), (3, [11], 2.9)):
        for n in steps:
            lines.append(json.dumps({"kind": "step", "generation": gen, "rank": 0, "step": n, "loss": loss,
                                     "lr": 1e-3, "tokens_per_s": 1e5}))
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "rank-0.log").write_text("\n".join(lines) + "\n")
    RunState(generation=3, status="finished").save(run)
    info = plot.plot(run, tmp_path / "loss.png")
    assert (info["generations"], info["generations_drawn"]) == (3, 2)
