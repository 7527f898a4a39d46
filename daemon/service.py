"""`llm-pretrain install-service`: the systemd units of systemd/, written for this installation.

Owns: rendering the shipped unit files (systemd/llm-pretrain.service, the
template llm-pretrain@.service, the tmpfiles.d entry and the Ascend
EnvironmentFile) for a given virtual environment, config, user and run
directories, and writing them. The shipped files are valid units with
default paths; rendering replaces whole `Key=` lines, nothing else.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from durable import write_atomically
from engine.config import ConfigError, load_config

UNITS_DIR = Path(__file__).resolve().parents[1] / "systemd"
DEFAULT_VENV = "/opt/llm-pretrain/.venv"


def _replace(text: str, key: str, value: str) -> str:
    lines = text.splitlines()
    hits = [i for i, line in enumerate(lines) if line.startswith(f"{key}=")]
    if not hits:
        raise ValueError(f"the shipped unit has no {key}= line")
    lines[hits[0]] = f"{key}={value}"
    return "\n".join(lines) + "\n"


def _insert_after(text: str, key: str, line: str) -> str:
    lines = text.splitlines()
    i = next(i for i, l in enumerate(lines) if l.startswith(f"{key}="))
    lines.insert(i + 1, line)
    return "\n".join(lines) + "\n"


def render(unit: str, *, venv: str, config: str | None, user: str, read_write: list[str] = (),
           env_file: str = "/etc/llm-pretrain/ascend.env") -> str:
    """The text of `unit` ("llm-pretrain.service" or "llm-pretrain@.service") for this installation."""
    text = (UNITS_DIR / unit).read_text()
    exe = str(Path(venv) / "bin" / "llm-pretrain")
    if unit == "llm-pretrain.service":
        text = _replace(text, "ExecStart", f"{exe} run --config {config or '/etc/llm-pretrain/config.toml'}")
    else:
        text = _replace(text, "ExecStart", f"{exe} run --config /etc/llm-pretrain/%i.toml --set run.name=%i")
    text = _replace(text, "EnvironmentFile", f"-{env_file}")
    text = _replace(text, "User", user)
    text = _replace(text, "Group", user)
    paths = [venv, config or ""]
    if any(p and (p == "/root" or p.startswith(("/home/", "/root/"))) for p in paths):
        text = _replace(text, "ProtectHome", "read-only")     # the venv or config lives in a home
    for path in read_write:
        text = _insert_after(text, "ProtectSystem", f"ReadWritePaths={path}")
    return text


def install(*, venv: str, config: str | None, user: str, dest: Path, tmpfiles_dest: Path,
            etc_dir: Path) -> list[Path]:
    """Writes the units (and the tmpfiles.d entry, and the Ascend env file if absent); returns the paths."""
    if not (Path(venv) / "bin" / "llm-pretrain").exists():
        raise ConfigError(f"{venv}/bin/llm-pretrain does not exist; pass --venv the virtual environment "
                          "llm-pretrain is installed in")
    read_write = []
    if config is not None:
        config = os.path.abspath(config)
        cfg = load_config(config)            # validated now, not at 3 a.m.
        for path in (cfg.run.dir, cfg.run.log_dir):
            if path and not path.startswith(("/var/lib/llm-pretrain", "/var/log/llm-pretrain")):
                read_write.append(os.path.abspath(path))
    written = []
    for unit in ("llm-pretrain.service", "llm-pretrain@.service"):
        written.append(_write(dest / unit, render(unit, venv=venv, config=config, user=user, read_write=read_write,
                                                   env_file=str(etc_dir / "ascend.env"))))
    tmpfiles = (UNITS_DIR / "llm-pretrain.tmpfiles.conf").read_text().replace(" llm-pretrain llm-pretrain ",
                                                                           f" {user} {user} ")
    written.append(_write(tmpfiles_dest / "llm-pretrain.conf", tmpfiles))
    env_file = etc_dir / "ascend.env"
    if not env_file.exists():
        written.append(_write(env_file, (UNITS_DIR / "ascend.env").read_text()))
    return written


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, text)
    path.chmod(0o644)
    return path


def default_venv() -> str:
    return sys.prefix
