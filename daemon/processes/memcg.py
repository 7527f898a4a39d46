"""Per-rank memory cgroups: a limit the kernel enforces, an OOM-kill counter, a peak.

Owns: finding this process's memory cgroup (cgroup v2 — the unified
hierarchy, delegated by systemd's `Delegate=yes` — or the v1 memory
controller where that is what the host has), creating one child per rank and
generation with the limit, moving a freshly forked rank into it before it
execs, and reading back `oom_kill` and the peak. An OOM kill is then told
apart from any other SIGKILL by the counter, not guessed from the signal.
Only files under /sys/fs/cgroup; no processes are signalled here.
"""
from __future__ import annotations

import os

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


class CgroupError(RuntimeError):
    """No memory cgroup can be created here; the message says why."""


def _own_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """(v2 path, v1 memory path) of this process, from the text of /proc/self/cgroup."""
    v2 = v1 = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def locate(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> tuple[int, Path]:
    """(version, directory) of the memory cgroup this process may create children in."""
    text = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
    v2, v1 = _own_paths(text)
    if v1 is not None and (root / "memory" / "memory.limit_in_bytes").exists():
        return 1, _creatable(root / "memory" / v1.lstrip("/"))
    if v2 is not None:
        base = root / v2.lstrip("/")
        controllers = base / "cgroup.controllers"
        if controllers.exists() and "memory" in controllers.read_text().split():
            return 2, _creatable(base)
    raise CgroupError("no memory cgroup controller is available to this process (cgroup v2 needs "
                      "Delegate=yes under systemd; v1 needs the memory controller mounted)")


def _creatable(path: Path) -> Path:
    """`path`, if this process may create cgroups in it: said at the daemon's start, not by the first
    generation's ranks after MindSpore has started."""
    if not os.access(path, os.W_OK):
        raise CgroupError(f"cannot create memory cgroups under {path}: permission denied "
                          "(run.worker_memory_limit_bytes needs root, or a cgroup delegated to this user: "
                          "Delegate=yes under systemd)")
    return path


class MemoryCgroup:
    """One rank's cgroup for one generation."""

    def __init__(self, version: int, path: Path):
        self.version, self.path = version, path

    @classmethod
    def create(cls, parent: tuple[int, Path], name: str, limit_bytes: int) -> "MemoryCgroup":
        version, base = parent
        try:
            if version == 2:
                _prepare_v2_parent(base)
            path = base / name
            path.mkdir(parents=True, exist_ok=True)
            group = cls(version, path)
            if version == 1:
                (path / "memory.limit_in_bytes").write_text(str(limit_bytes))
                memsw = path / "memory.memsw.limit_in_bytes"
                if memsw.exists():                      # no escape into swap either
                    try:
                        memsw.write_text(str(limit_bytes))
                    except OSError:
                        pass
            else:
                (path / "memory.max").write_text(str(limit_bytes))
                swap = path / "memory.swap.max"
                if swap.exists():
                    swap.write_text("0")
        except OSError as e:
            raise CgroupError(f"cannot create memory cgroup {base / name}: {e.strerror or e}") from e
        return group

    def join(self) -> None:
        """Moves the calling process in; meant for subprocess's preexec_fn (the child, before exec)."""
        with open(self.path / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            pass
        return 0

    def peak_bytes(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def remove(self) -> None:
        """Removes the (empty) cgroup; a cgroup still holding a process stays and is logged by nobody."""
        try:
            self.path.rmdir()
        except OSError:
            pass


def _prepare_v2_parent(base: Path) -> None:
    """cgroup v2 allows processes only in leaves: move this process into `base/supervisor`, then
    enable the memory controller for base's children."""
    control = base / "cgroup.subtree_control"
    if "memory" in control.read_text().split():
        return
    leaf = base / "supervisor"
    leaf.mkdir(exist_ok=True)
    for pid in (base / "cgroup.procs").read_text().split():
        try:
            (leaf / "cgroup.procs").write_text(pid)
        except OSError:
            pass        # exited meanwhile
    control.write_text("+memory")


def remove_tree(path: Path) -> None:
    """Removes empty cgroups under `path`, leaves first (rmdir is the only way to delete a cgroup)."""
    if not path.is_dir():
        return
    for child in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        try:
            child.rmdir()
        except OSError:
            pass
    try:
        path.rmdir()
    except OSError:
        pass



