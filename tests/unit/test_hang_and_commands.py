import math

import numpy as np
import pytest

from contracts.config import HealthConfig, load_config
from contracts.protocol import Command, LrOverride, RecoveryDirective
from daemon.judging.hang import RankProgress, StepTimes, is_hung, timeout_s
from daemon.judging.incidents import Halt, Incident, IncidentRecord, Kind, Restart, Rollback
from daemon.processes.generation import socket_path
from daemon.records.state import RunState
from engine.rank.commands import WINDOW, CommandReader

CFG = HealthConfig(hang_floor_s=30, hang_step_multiplier=10, hang_start_timeout_s=600,
                   hang_compile_timeout_s=900, hang_checkpoint_timeout_s=300)


def _times(*values):
    t = StepTimes()
    for v in values:
        t.add(v)
    return t


@pytest.mark.parametrize("phase,times,expected", [
    ("starting", (), 600), ("restore", (), 600), ("compile", (), 900),
    ("train", (), 900),                      # no clean step yet: still compiling
    ("train", (0.5,) * 50, 30),              # 10 x 0.5 s < floor
    ("train", (0.5,) * 99 + (8.0,), 30),     # p99 of 100 samples is the 99th smallest: one outlier is ignored
    ("train", (0.5,) * 98 + (8.0, 8.0), 80),  # ... two are not
    ("train", (4.0,) * 10, 40),
    ("checkpoint", (4.0,), 300), ("exiting", (), 300), ("paused", (), math.inf),
])
def test_timeout_depends_on_phase_and_observed_step_times(phase, times, expected):
    assert timeout_s(phase, CFG, _times(*times)) == pytest.approx(expected)


@pytest.mark.parametrize("phase,since,now,hung", [
    ("train", 0.0, 29.9, False), ("train", 0.0, 30.1, True),
    ("compile", 0.0, 800.0, False), ("compile", 0.0, 901.0, True),
    ("paused", 0.0, 1e6, False),
])
def test_is_hung(phase, since, now, hung):
    assert is_hung(RankProgress(phase=phase, since_s=since), now, CFG, _times(0.5, 0.5))[0] is hung


def test_step_times_ignore_non_finite():
    t = _times(float("nan"), float("inf"), 1.0)
    assert t.p99() == 1.0


def _write(path, *commands):
    with open(path, "a") as f:
        for c in commands:
            f.write(c.to_json() + "\n")


def test_command_window_agrees_on_the_highest_read(tmp_path):
    path = tmp_path / "commands.jsonl"
    path.write_text("")
    fast, slow = CommandReader(str(path)), CommandReader(str(path))
    _write(path, Command(seq=1, name="checkpoint"), Command(seq=2, name="stop"))
    fast.poll()                                   # one rank saw both, the other nothing yet
    summed = fast.encode(0) + slow.encode(0)
    assert [c.name for c in fast.agreed(0, summed)] == ["checkpoint", "stop"]
    assert [c.name for c in slow.agreed(0, summed)] == ["checkpoint", "stop"]   # re-reads the file


def test_command_reader_skips_partial_and_malformed_lines(tmp_path, capsys):
    path = tmp_path / "commands.jsonl"
    path.write_text('{"seq": 1, "name": "checkpoint"}\nnot json\n{"seq": 2, "na')
    reader = CommandReader(str(path))
    assert reader.poll() == 1 and "malformed" in capsys.readouterr().err
    with open(path, "a") as f:
        f.write('me": "stop"}\n')
    assert reader.poll() == 2 and reader.commands[2].name == "stop"


def test_window_caps_far_ahead_readers(tmp_path):
    path = tmp_path / "c.jsonl"
    _write(path, *[Command(seq=i, name="checkpoint") for i in range(1, 20)])
    reader = CommandReader(str(path))
    reader.poll()
    slots = reader.encode(0)
    assert slots.sum() == 1 and slots[WINDOW - 1] == 1
    assert len(reader.agreed(0, slots)) == WINDOW - 1          # the rest follow over the next steps


def test_no_commands_file_means_no_commands():
    reader = CommandReader(None)
    assert reader.poll() == 0 and reader.agreed(0, np.zeros(WINDOW)) == []


def test_run_state_round_trips(tmp_path):
    crash = Incident(kind=Kind.CRASH, first_step=7, last_step=7, rank=1, exit_code=-9, detail="rank 1: killed")
    spike = Incident(kind=Kind.LOSS_SPIKE, first_step=30, last_step=33, evidence={"median": 2.0, "values": [9.0]})
    cut = LrOverride(start_step=26, factor=0.5, hold_steps=200, ramp_steps=200)
    records = [IncidentRecord(incident=crash, generation=1, unix_s=1.5, committed_step=5, action=Restart("crash")),
               IncidentRecord(incident=spike, generation=2, unix_s=2.5, committed_step=30,
                              action=Rollback("spike", checkpoint_step=25, skip=(232, 264), lr_overrides=(cut,))),
               IncidentRecord(incident=spike, generation=3, unix_s=3.5, action=Halt("numerics", 4))]
    recovery = RecoveryDirective(checkpoint_step=25, skip_ranges=((232, 264),), lr_overrides=(cut,))
    state = RunState(generation=3, restarts=2, incidents=records, recovery=recovery)
    state.save(tmp_path)
    back = RunState.load(tmp_path)
    assert (back.generation, back.restarts, back.incidents, back.recovery) == (3, 2, records, recovery)
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_socket_path_respects_the_107_byte_limit(tmp_path):
    cfg = load_config(None)
    deep = tmp_path / ("d" * 120)
    assert len(str(socket_path(cfg, deep, {}))) <= 107
    assert socket_path(cfg, tmp_path, {"RUNTIME_DIRECTORY": "/run/llm-pretrain"}) == \
        __import__("pathlib").Path("/run/llm-pretrain/tiny.sock")
