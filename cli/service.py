"""`llm-pretrain install-service`: the systemd units of systemd/, written for this installation.

Owns: rendering the shipped unit files (systemd/llm-pretrain.service, the
template llm-pretrain@.service, the tmpfiles.d entry and the Ascend
EnvironmentFile) for a given virtual environment, config, user and run
directories, and writing them. The shipped files are valid units with
default paths; rendering replaces whole `Key=` lines, nothing else.
"""
from __future__ import annotations

import grp
import os
import pwd
import stat
import sys
from pathlib import Path

from contracts.config import load_config
from contracts.errors import CantCreateError, ConfigError
from durable import write_atomically

UNITS_DIR = Path(__file__).resolve().parents[1] / "systemd"
DEFAULT_VENV = "/opt/llm-pretrain/.venv"
PRIVATE_TMP = ("/tmp", "/var/tmp")       # the units run with PrivateTmp=yes: the service sees these empty
SEARCHED_UNIT_DIRS = ("/etc/systemd/system", "/run/systemd/system", "/usr/lib/systemd/system", "/lib/systemd/system")


def _under_private_tmp(path: str) -> bool:
    resolved = os.path.realpath(path)
    return any(resolved == d or resolved.startswith(d + "/") for d in PRIVATE_TMP)


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


def _in_home(path: str) -> bool:
    return path == "/root" or path.startswith(("/home/", "/root/"))


def render(unit: str, *, venv: str, config: str | None, user: str, read_write: list[str] = (),
           env_file: str = "/etc/llm-pretrain/ascend.env", etc_dir: str = "/etc/llm-pretrain",
           interpreter: str = "") -> str:
    """The text of `unit` ("llm-pretrain.service" or "llm-pretrain@.service") for this installation."""
    text = (UNITS_DIR / unit).read_text()
    exe = str(Path(venv) / "bin" / "llm-pretrain")
    if unit == "llm-pretrain.service":
        text = _replace(text, "ExecStart", f"{exe} run --config {config or '/etc/llm-pretrain/config.toml'}")
    else:
        text = _replace(text, "ExecStart", f"{exe} run --config {etc_dir}/%i.toml --set run.name=%i")
    text = _replace(text, "EnvironmentFile", f"-{env_file}")
    text = _replace(text, "User", user)
    text = _replace(text, "Group", user)
    if any(p and _in_home(p) for p in (venv, config or "", interpreter)):
        text = _replace(text, "ProtectHome", "read-only")     # the venv, its Python or the config lives in a home
    for path in read_write:
        text = _insert_after(text, "ProtectSystem", f"ReadWritePaths={path}")
    return text


def install(*, venv: str, config: str | None, user: str, dest: Path, tmpfiles_dest: Path,
            etc_dir: Path) -> list[Path]:
    """Writes the units (and the tmpfiles.d entry, and the Ascend env file if absent); returns the paths."""
    if not (Path(venv) / "bin" / "llm-pretrain").exists():
        raise ConfigError(f"{venv}/bin/llm-pretrain does not exist; pass --venv the virtual environment "
                          "llm-pretrain is installed in")
    read_write, cfg = [], None
    if config is not None:
        config = os.path.abspath(config)
        cfg = load_config(config)            # validated now, not at 3 a.m.
        for path in (cfg.run.dir, cfg.run.log_dir):
            if path and not path.startswith(("/var/lib/llm-pretrain", "/var/log/llm-pretrain")):
                read_write.append(os.path.abspath(path))
    for what, path in (("the venv", venv), ("the config", config), ("run.dir", cfg.run.dir if cfg else None),
                       ("run.log_dir", cfg.run.log_dir if cfg else None)):
        if path and _under_private_tmp(path):
            raise ConfigError(f"{what} {path} is under {', '.join(PRIVATE_TMP)}, which the service sees private and "
                              "empty (the units set PrivateTmp=yes); keep it elsewhere (e.g. /opt/llm-pretrain, "
                              "/etc/llm-pretrain, /var/lib/llm-pretrain)")
    interpreter = str((Path(venv) / "bin" / "python").resolve())
    for what, path, need in (("the venv's llm-pretrain", Path(venv) / "bin" / "llm-pretrain", stat.S_IXOTH),
                             ("the venv's base interpreter", Path(interpreter), stat.S_IXOTH),
                             ("the config", Path(config) if config else None, stat.S_IROTH)):
        blocked = _blocked_for(user, path, need) if path else None
        if blocked:
            fix = ("keep the config where that user can read it (e.g. /etc/llm-pretrain/)" if what == "the config"
                   else "install the venv with a Python outside any home directory (e.g. /usr/bin/python3 -m venv "
                        "/opt/llm-pretrain/.venv)")
            raise ConfigError(f"the service user {user} cannot reach {what} {path}: {blocked}; {fix}, or pass "
                              "--user a user that can reach it")
    written = []
    for unit in ("llm-pretrain.service", "llm-pretrain@.service"):
        written.append(_write(dest / unit, render(unit, venv=venv, config=config, user=user, read_write=read_write,
                                                   env_file=str(etc_dir / "ascend.env"), etc_dir=str(etc_dir),
                                                   interpreter=interpreter)))
    tmpfiles = (UNITS_DIR / "llm-pretrain.tmpfiles.conf").read_text().replace(" llm-pretrain llm-pretrain ",
                                                                           f" {user} {user} ")
    tmpfiles = tmpfiles.replace("d /etc/llm-pretrain ", f"d {etc_dir} ")      # where --etc put the configs
    written.append(_write(tmpfiles_dest / "llm-pretrain.conf", tmpfiles))
    env_file = etc_dir / "ascend.env"
    if cfg is not None and cfg.train.device == "ascend" and not env_file.exists():   # the units read it if present
        written.append(_write(env_file, (UNITS_DIR / "ascend.env").read_text()))
    return written


def next_steps(user: str, written: list[Path]) -> str:
    """The commands that start what `install` wrote (it runs none of them): a system user only where
    `user` does not exist yet."""
    steps = []
    try:
        pwd.getpwnam(user)
    except KeyError:
        steps.append(f"useradd --system --home-dir /var/lib/llm-pretrain --shell /usr/sbin/nologin {user}")
    tmpfiles = [str(p) for p in written if p.name == "llm-pretrain.conf"]
    steps += [f"systemd-tmpfiles --create {' '.join(tmpfiles)}".rstrip(), "systemctl daemon-reload"]
    units = [p for p in written if p.suffix == ".service"]
    if units and str(units[0].parent) not in SEARCHED_UNIT_DIRS:
        # units outside systemd's search path are linked into it (by name, the same for the template)
        steps += [f"systemctl link {' '.join(str(p) for p in units)}",
                  "systemctl enable --now llm-pretrain (or llm-pretrain@NAME)"]
    else:
        steps.append("systemctl enable --now llm-pretrain (or llm-pretrain@NAME)")
    return "; ".join(steps)


def _blocked_for(user: str, path: Path, need: int) -> str | None:
    """Why `user` cannot reach `path` (search every directory above it, then `need` on it: S_IXOTH to
    run, S_IROTH to read), or None. A user not created yet is a new system user: the "other" bits."""
    try:
        pw = pwd.getpwnam(user)
        uid, gids = pw.pw_uid, {pw.pw_gid, *(g.gr_gid for g in grp.getgrall() if user in g.gr_mem)}
    except KeyError:
        uid, gids = None, set()
    if uid == 0:
        return None
    for p, bit in [*((d, stat.S_IXOTH) for d in reversed(path.parents)), (path, need)]:
        try:
            st = os.stat(p)
        except OSError as e:
            return f"{p}: {e.strerror}"
        shift = 6 if st.st_uid == uid else 3 if st.st_gid in gids else 0
        if not (st.st_mode >> shift) & bit:
            return f"{p} is mode {stat.S_IMODE(st.st_mode):04o} (owner uid {st.st_uid})"
    return None


def _write(path: Path, text: str) -> Path:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, text)
        path.chmod(0o644)
    except OSError as e:
        raise CantCreateError(f"cannot write {path}: {e.strerror or e}; run install-service as root, or pass "
                              "--dest, --tmpfiles-dest and --etc directories you can write") from None
    return path


def default_venv() -> str:
    return sys.prefix
