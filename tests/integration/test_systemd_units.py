"""The systemd units, checked by systemd's own tools (no systemd needs to run): verify passes
silently on the service and on an instance of the template, and the exposure rating is <= 4.0."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.protocol import FINAL_EXIT_CODES

needs_systemd = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
VENV = str(Path(sys.executable).parent.parent)


@pytest.fixture
def installed(tmp_path, cli, quiet_env):
    config = tmp_path / "demo.toml"
    config.write_text('[run]\nname = "demo"\n')
    done = subprocess.run([*cli, "install-service", "--venv", VENV, "--config", str(config), "--dest",
                           str(tmp_path / "units"), "--tmpfiles-dest", str(tmp_path / "tmpfiles"),
                           "--etc", str(tmp_path / "etc")], env=quiet_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return tmp_path


@needs_systemd
@pytest.mark.parametrize("unit", ["llm-pretrain.service", "llm-pretrain@demo.service"])
def test_systemd_analyze_verify_is_silent(installed, unit):
    done = subprocess.run(["systemd-analyze", "verify", str(installed / "units" / unit)],
                          capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


@needs_systemd
@pytest.mark.parametrize("unit", ["llm-pretrain.service", "llm-pretrain@demo.service"])
def test_exposure_is_at_most_4(installed, unit):
    done = subprocess.run(["systemd-analyze", "security", "--offline=true", str(installed / "units" / unit)],
                          capture_output=True, text=True)
    level = float(re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout).group(1))
    print(f"{unit}: exposure {level}")
    assert level <= 4.0


@needs_systemd
def test_a_broken_exec_start_fails_verify(installed):
    unit = installed / "units" / "llm-pretrain.service"
    unit.write_text(unit.read_text().replace(f"{VENV}/bin/llm-pretrain", "/nonexistent/llm-pretrain"))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    assert done.returncode != 0 and "not executable" in done.stderr


def test_the_units_encode_the_exit_code_contract_and_the_operating_model(installed):
    for unit in ("llm-pretrain.service", "llm-pretrain@.service"):
        text = (installed / "units" / unit).read_text()
        keys = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
        assert keys["RestartPreventExitStatus"].split() == [str(int(c)) for c in FINAL_EXIT_CODES if c != 0]
        assert (keys["Type"], keys["KillMode"], keys["Delegate"], keys["Restart"]) == ("notify", "mixed", "yes",
                                                                                     "on-failure")
        assert keys["ExecStart"].startswith(f"{VENV}/bin/llm-pretrain run --config ")
        assert keys["User"] == "llm-pretrain" and keys["ProtectSystem"] == "strict"
    assert "demo.toml" in (installed / "units" / "llm-pretrain.service").read_text()
    assert (installed / "etc" / "ascend.env").exists() and (installed / "tmpfiles" / "llm-pretrain.conf").exists()


def test_a_bad_config_is_refused_before_anything_is_written(tmp_path, cli, quiet_env):
    config = tmp_path / "bad.toml"
    config.write_text("[train]\nsteps = -1\n")
    done = subprocess.run([*cli, "install-service", "--venv", VENV, "--config", str(config), "--dest",
                           str(tmp_path / "units")], env=quiet_env, capture_output=True, text=True)
    assert done.returncode == 78 and "train.steps" in done.stderr
    assert not (tmp_path / "units").exists()
