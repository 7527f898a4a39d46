"""`llm-pretrain plan` as a user runs it: the report, its exit status, and `run` refusing a layout
that cannot fit — all without MindSpore or devices."""
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEVEN_B = str(ROOT / "configs" / "llama-7b.toml")


def _plan(cli, env, *args):
    return subprocess.run([*cli, "plan", *args], capture_output=True, text=True, env=env, timeout=120)


def test_the_shipped_7b_layout_fits_eight_devices_and_alternatives_are_listed(cli, quiet_env):
    proc = _plan(cli, quiet_env, "--config", SEVEN_B, "--devices", "8")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "6.74B parameters" in out and "dp4 tp2 pp1 opt-shard" in out
    for part in ("params", "grads", "optimizer", "activations", "comm_buffers", "total"):
        assert f"\n{part} " in out
    assert "  fits: " in out and "layouts of 8 devices that fit" in out
    listed = [line for line in out.splitlines() if line.startswith("  dp") and "tokens/s" in line]
    assert 1 <= len(listed) <= 10


def test_a_broken_rule_is_shown_and_the_exit_is_78(cli, quiet_env):
    proc = _plan(cli, quiet_env, "--config", SEVEN_B, "--devices", "12", "--set", "parallel.tp=3",
                 "--set", "parallel.dp=4")
    assert proc.returncode == 78
    assert "  FAIL model.num_heads (32) divisible by tp (3)" in proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "llm-pretrain: plan: the config cannot run as written on 12 devices: a rule is broken: "
        "model.num_heads (32) divisible by tp (3)"]


def test_too_little_device_memory_is_78_but_still_proposes_layouts(cli, quiet_env):
    proc = _plan(cli, quiet_env, "--config", SEVEN_B, "--devices", "8", "--device-memory-gib", "32")
    assert proc.returncode == 78 and "DOES NOT FIT" in proc.stdout
    assert "more than 32 GiB" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "layouts of 8 devices that fit" in proc.stdout


def test_dry_run_without_the_toolkit_says_so_and_exits_69(cli, quiet_env):
    env = {k: v for k, v in quiet_env.items() if not k.startswith("ASCEND_")}
    if Path("/usr/local/Ascend").exists():
        import pytest
        pytest.skip("this host has an Ascend toolkit")
    proc = _plan(cli, env, "--config", SEVEN_B, "--devices", "8", "--dry-run")
    assert proc.returncode == 69
    assert "needs the Ascend toolkit" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_bad_arguments_are_one_line(cli, quiet_env):
    proc = _plan(cli, quiet_env, "--devices", "0")
    assert proc.returncode == 78 and proc.stderr.count("\n") == 1 and "--devices = 0" in proc.stderr


def test_run_refuses_an_ascend_layout_that_cannot_fit_before_starting_anything(cli, quiet_env, tmp_path):
    proc = subprocess.run([*cli, "run", "--config", SEVEN_B, "--set", "parallel.device_memory_gib=16",
                           "--set", f"run.dir='{tmp_path / 'r'}'"], capture_output=True, text=True, env=quiet_env,
                          timeout=120)
    assert proc.returncode == 78
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel.device_memory_gib = 16" in lines[0] and "llm-pretrain plan" in lines[0]
    assert not (tmp_path / "r").exists()


def test_the_dry_run_compiles_every_ranks_graph_first_and_names_the_ranks_that_fail(monkeypatch, capsys):
    """`plan --dry-run` (Ascend hosts) compiles each rank's graph at MS_SIMULATION_LEVEL=0 before the
    per-stage memory simulation: here each "rank" is a real process that fails as rank 2 of level 0."""
    import sys

    from contracts.config import load_config
    from engine.layout import dry_run
    from engine.layout.memory_model import Layout

    script = ("import os, sys; print('compiling'); sys.stderr.write('strategy of MatMul-op3 does not fit\\n'); "
              "sys.exit(3 if os.environ['RANK_ID'] == '2' and os.environ['MS_SIMULATION_LEVEL'] == '0' else 0)")
    monkeypatch.setattr(dry_run, "stage_command", lambda *a: [sys.executable, "-c", script])
    layout = Layout.of(load_config(SEVEN_B, []))
    assert not dry_run.compile_every_rank(SEVEN_B, [], layout, timeout_s=60)
    out = capsys.readouterr().out
    assert "rank 2: exit 3: strategy of MatMul-op3 does not fit" in out and "7 of 8 ranks compiled" in out
    assert "rank 1:" not in out
