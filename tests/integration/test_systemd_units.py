"""The systemd units, checked by systemd's own tools (no systemd needs to run): verify passes
silently on the service and on an instance of the template, and the exposure rating is <= 4.0."""
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from contracts.protocol import FINAL_EXIT_CODES

needs_systemd = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
SYSTEM_PYTHON = "/usr/bin/python3"
# a directory every user can reach that the units' PrivateTmp=yes does not hide (a venv under /tmp or /var/tmp
# is refused: the service would see an empty one); tmp_path hangs off a 0700 directory
REACHABLE_TMP = "/dev/shm"


def _fake_venv(parent: Path) -> Path:
    """What install-service looks at in a venv — bin/llm-pretrain and bin/python — with a Python outside
    any home, as a production venv has (the test's own venv may hang off a pyenv under /root)."""
    if not Path(SYSTEM_PYTHON).exists():
        pytest.skip(f"no {SYSTEM_PYTHON} to build a reachable venv from")
    venv = parent / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(SYSTEM_PYTHON)
    exe = venv / "bin" / "llm-pretrain"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return venv


@pytest.fixture(scope="module")
def reachable_venv():
    base = Path(tempfile.mkdtemp(prefix="llm-pretrain-units-", dir=REACHABLE_TMP))
    base.chmod(0o755)
    yield str(_fake_venv(base))
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def installed(tmp_path, cli, quiet_env, reachable_venv):
    global VENV
    VENV = reachable_venv
    config = Path(reachable_venv).parent / f"{tmp_path.name}.toml"      # readable by the service user
    config.write_text('[run]\nname = "demo"\n')
    done = subprocess.run([*cli, "install-service", "--venv", VENV, "--config", str(config), "--dest",
                           str(tmp_path / "units"), "--tmpfiles-dest", str(tmp_path / "tmpfiles"),
                           "--etc", str(tmp_path / "etc")], env=quiet_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (tmp_path / "stdout").write_text(done.stdout)
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
        # the service user's standby may come back from SCHED_IDLE to nice 0, never above (engine/rank/idle_cpu.py)
        assert keys["LimitNICE"] == "+0"
        # a failure that repeats is not restarted forever; SIGHUP reopens the log; the journal names the run
        assert (keys["StartLimitIntervalSec"], keys["StartLimitBurst"]) == ("600", "5")
        assert keys["ExecReload"] == "/bin/kill -HUP $MAINPID"
        assert keys["SyslogIdentifier"] == ("llm-pretrain" if unit == "llm-pretrain.service" else "llm-pretrain-%i")
    assert f"--config {Path(VENV).parent}/{installed.name}.toml" in (installed / "units" / "llm-pretrain.service").read_text()
    assert not (installed / "etc" / "ascend.env").exists()                    # a cpu config: no Ascend toolkit
    assert (installed / "tmpfiles" / "llm-pretrain.conf").exists()


def test_a_bad_config_is_refused_before_anything_is_written(tmp_path, cli, quiet_env):
    config = tmp_path / "bad.toml"
    config.write_text("[train]\nsteps = -1\n")
    done = subprocess.run([*cli, "install-service", "--venv", VENV, "--config", str(config), "--dest",
                           str(tmp_path / "units")], env=quiet_env, capture_output=True, text=True)
    assert done.returncode == 78 and "train.steps" in done.stderr
    assert not (tmp_path / "units").exists()


def test_a_venv_or_config_the_service_user_cannot_reach_is_refused_naming_the_blocker(tmp_path, cli, quiet_env,
                                                                                     reachable_venv):
    """A venv under a 0700 directory (like /root) would give a unit that cannot start."""
    blocker = Path(tempfile.mkdtemp(prefix="llm-pretrain-units-", dir=REACHABLE_TMP))      # mode 0700
    try:
        hidden = _fake_venv(blocker)
        args = ["install-service", "--dest", str(tmp_path / "units"), "--tmpfiles-dest", str(tmp_path / "tmpfiles"),
                "--etc", str(tmp_path / "etc")]
        done = subprocess.run([*cli, *args, "--venv", str(hidden)], env=quiet_env, capture_output=True, text=True)
        assert done.returncode == 78 and "cannot reach the venv's llm-pretrain" in done.stderr
        assert f"{blocker} is mode" in done.stderr and not (tmp_path / "units").exists()
        done = subprocess.run([*cli, *args, "--venv", str(hidden), "--user", "root"], env=quiet_env,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr                   # root reaches it (not advised: the rating)
    finally:
        shutil.rmtree(blocker, ignore_errors=True)


def test_the_template_reads_etc_and_ascend_env_is_written_only_for_ascend(tmp_path, cli, quiet_env, reachable_venv):
    base = Path(reachable_venv).parent
    for device, written in (("cpu", False), ("ascend", True)):
        config = base / f"{tmp_path.name}-{device}.toml"
        config.write_text(f'[train]\ndevice = "{device}"\n' + ('precision = "bf16"\n' if device == "ascend" else ""))
        etc = tmp_path / f"etc-{device}"
        done = subprocess.run([*cli, "install-service", "--venv", reachable_venv, "--config", str(config),
                               "--dest", str(tmp_path / device), "--tmpfiles-dest", str(tmp_path / "tmpfiles"),
                               "--etc", str(etc)], env=quiet_env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert (etc / "ascend.env").exists() is written
        template = (tmp_path / device / "llm-pretrain@.service").read_text()
        assert f"--config {etc}/%i.toml" in template and f"EnvironmentFile=-{etc}/ascend.env" in template


def test_a_venv_whose_base_interpreter_the_service_user_cannot_reach_is_refused(tmp_path, cli, quiet_env):
    """A venv made from a Python under /root (pyenv): its llm-pretrain is reachable, its interpreter not."""
    base = Path(tempfile.mkdtemp(prefix="llm-pretrain-units-", dir=REACHABLE_TMP))
    try:
        base.chmod(0o755)
        venv = _fake_venv(base)
        hidden_python = tmp_path / "pyenv" / "python3"           # tmp_path hangs off a 0700 directory
        hidden_python.parent.mkdir()
        shutil.copy(SYSTEM_PYTHON, hidden_python)
        (venv / "bin" / "python").unlink()
        (venv / "bin" / "python").symlink_to(hidden_python)
        done = subprocess.run([*cli, "install-service", "--venv", str(venv), "--dest", str(tmp_path / "units"),
                               "--tmpfiles-dest", str(tmp_path / "tmpfiles"), "--etc", str(tmp_path / "etc")],
                              env=quiet_env, capture_output=True, text=True)
        assert done.returncode == 78 and "cannot reach the venv's base interpreter" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "units").exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@needs_systemd
def test_relative_paths_are_written_absolute_and_next_steps_are_printed_not_run(tmp_path, cli, quiet_env,
                                                                                reachable_venv):
    """A newcomer staging the units under a relative directory: every path in them is absolute (verify is
    silent), and the last line says what to run, with no `useradd` for a user that exists."""
    here = Path(reachable_venv).parent
    (here / f"{tmp_path.name}.toml").write_text('[run]\nname = "demo"\n')
    stage = f"sysroot-{tmp_path.name}"
    done = subprocess.run([*cli, "install-service", "--venv", "venv", "--config", f"{tmp_path.name}.toml",
                           "--user", "root", "--dest", f"{stage}/units", "--tmpfiles-dest", f"{stage}/tmpfiles",
                           "--etc", f"{stage}/etc"], env=quiet_env, capture_output=True, text=True, cwd=here)
    assert done.returncode == 0, done.stderr
    units = here / stage / "units"
    for unit in ("llm-pretrain.service", "llm-pretrain@demo.service"):
        checked = subprocess.run(["systemd-analyze", "verify", str(units / unit)], capture_output=True, text=True)
        assert (checked.returncode, checked.stderr) == (0, ""), (unit, checked.stderr)
    text = (units / "llm-pretrain.service").read_text() + (units / "llm-pretrain@.service").read_text()
    assert f"EnvironmentFile=-{here / stage / 'etc' / 'ascend.env'}" in text
    assert f"--config {here / f'{tmp_path.name}.toml'}" in text and f"--config {here / stage / 'etc'}/%i.toml" in text
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("not done by install-service") and "useradd" not in last, last
    assert f"systemd-tmpfiles --create {here / stage / 'tmpfiles' / 'llm-pretrain.conf'}" in last


@pytest.mark.parametrize("where", ["venv", "config"])
def test_a_venv_or_config_under_a_private_tmp_is_refused(tmp_path, cli, quiet_env, reachable_venv, where):
    """The units set PrivateTmp=yes: the service would see an empty /tmp and /var/tmp, so a venv or config
    kept there is refused before anything is written (78), in one line."""
    base = Path(tempfile.mkdtemp(prefix="llm-pretrain-units-", dir="/var/tmp"))
    try:
        venv = str(_fake_venv(base)) if where == "venv" else reachable_venv
        config = (base if where == "config" else Path(reachable_venv).parent) / f"{tmp_path.name}.toml"
        config.write_text('[run]\nname = "demo"\n')
        done = subprocess.run([*cli, "install-service", "--venv", venv, "--config", str(config), "--dest",
                               str(tmp_path / "units"), "--tmpfiles-dest", str(tmp_path / "tmpfiles"), "--etc",
                               str(tmp_path / "etc")], env=quiet_env, capture_output=True, text=True)
        assert done.returncode == 78 and "PrivateTmp=yes" in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "units").exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_destination_it_cannot_write_is_one_line_and_exit_73(tmp_path, cli, quiet_env, reachable_venv):
    """As an unprivileged user /etc/systemd/system is not writable: one line naming the path, exit 73 (as
    root, a destination under a regular file fails the same way)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = subprocess.run([*cli, "install-service", "--venv", reachable_venv, "--dest", str(blocker / "units"),
                           "--tmpfiles-dest", str(tmp_path / "tmpfiles"), "--etc", str(tmp_path / "etc")],
                          env=quiet_env, capture_output=True, text=True)
    assert done.returncode == 73, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "Traceback" not in done.stderr
    assert f"cannot write {blocker / 'units'}" in done.stderr and "--dest" in done.stderr


def test_units_staged_elsewhere_are_linked_and_the_tmpfiles_entry_names_the_etc_given(installed):
    """--dest outside systemd's search path: the next steps link the units there; --etc: the tmpfiles entry
    creates that directory, not /etc/llm-pretrain."""
    tmpfiles = (installed / "tmpfiles" / "llm-pretrain.conf").read_text()
    assert f"d {installed / 'etc'} " in tmpfiles and "/etc/llm-pretrain" not in tmpfiles
    last = (installed / "stdout").read_text().strip().splitlines()[-1]
    units = installed / "units"
    assert f"systemctl link {units / 'llm-pretrain.service'} {units / 'llm-pretrain@.service'}" in last, last
