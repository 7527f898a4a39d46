"""The README's make targets as a newcomer types them: `EXTRAS` with commas or spaces, each set of
extras installed once into the same venv (checked with `make -n`: nothing is installed)."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")


def _plan(*args: str, venv: Path) -> list[str]:
    # not the variables of a `make test` these tests may run under: make exports its command line's (CI's
    # EXTRAS=test,interop) to its recipes' environment and passes them down through MAKEFLAGS
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "EXTRAS", "VENV", "ARGS", "PYTHON")}
    done = subprocess.run(["make", "-n", "-C", str(ROOT), f"VENV={venv}", *args], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize("extras", ["test interop", "test,interop", " test , interop ", "test  interop"])
def test_extras_with_spaces_or_commas_install_the_same_set(tmp_path, extras):
    plan = _plan("test-fast", f"EXTRAS={extras}", venv=tmp_path / "venv")
    assert any(line.endswith("pip install -q -e '.[test,interop]'") for line in plan), plan


def test_another_set_of_extras_is_installed_into_a_venv_set_up_with_the_default(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    first = _plan("test-fast", venv=venv)
    installs = [line for line in first if "pip install -q -e" in line]
    assert installs == [f"{venv}/bin/python -m pip install -q -e '.[test]'"], first
    (venv / ".installed-test").touch()              # as the install leaves it
    assert not [line for line in _plan("test-fast", venv=venv) if "pip install" in line]    # done once
    again = _plan("test-fast", "EXTRAS=test interop", venv=venv)
    assert [line for line in again if "pip install -q -e" in line] == [
        f"{venv}/bin/python -m pip install -q -e '.[test,interop]'"]
