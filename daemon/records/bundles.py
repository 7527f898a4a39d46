"""Post-mortem bundles: one directory per incident holding what someone needs to debug it later.

Owns what a bundle holds, its bounds, how it is written and when it is retired. Written by the daemon when an
incident is decided (daemon.acting.decisions), into `<node dir>/incidents/<NNNN>-g<generation>-<kind>/`
(NNNN: the incident's index in state.json's `incidents`), built in a hidden `.tmp` directory and renamed
into place, so a reader finds a whole bundle or none:

    incident.json          the incident record (kind, steps, rank, detail, evidence, action and its reason), the
                           committed step, the checkpoint the run resumes from and why, the trajectory hash
    events.jsonl           the daemon's events of the incident's generation and up to EVENTS_BEFORE lines before
    rank-<r>.log.tail      each of this machine's ranks' log, the last of this generation's part (a hang's Python
                           stacks included: faulthandler writes them there)
    config.resolved.toml   the config the generation's ranks ran with
    environment.json       Python, platform, host, CPU, MindSpore, CANN and the NPU driver (where present)

Every file is capped and the whole stays under BUNDLE_BYTES. Retired when the newest `keep` are exceeded, and with
the checkpoints: once retention has deleted the checkpoint an incident's run resumed from. Never imports MindSpore
(its version comes from the installed package's metadata).
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import socket
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping, Sequence

from daemon.judging.incidents import IncidentRecord
from durable import fsync_path, write_atomically

INCIDENTS_DIR = "incidents"         # in the node's own directory (the run directory on one machine)
INCIDENT_FILE = "incident.json"
LOG_TAIL_BYTES = 64 << 10           # a rank's log tail ...
LOG_TAILS_BYTES = 1 << 20           # ... and all of this machine's together (many ranks: less each)
EVENTS_BEFORE = 200                 # event lines kept before the incident's generation began
EVENTS_BYTES = 512 << 10            # the events file's cap (the newest lines kept)
CONFIG_BYTES = 128 << 10
BUNDLE_BYTES = 2 << 20              # the whole bundle
_NAME = re.compile(r"^(\d{4,})-g(\d+)-([a-z_]+)$")
ASCEND = Path("/usr/local/Ascend")


def name(index: int, generation: int, kind: str) -> str:
    """A bundle's directory name: sorted by the incident's index."""
    return f"{index:04d}-g{generation}-{kind}"


def parse(dirname: str) -> tuple[int, int, str] | None:
    """(index, generation, kind) of a bundle's directory name; None for anything else (a `.tmp` left by a kill)."""
    m = _NAME.match(dirname)
    return (int(m[1]), int(m[2]), m[3]) if m else None


def tail_bytes(ranks: int) -> int:
    """How much of each rank's log a bundle keeps: LOG_TAIL_BYTES, less where many ranks share LOG_TAILS_BYTES."""
    return min(LOG_TAIL_BYTES, LOG_TAILS_BYTES // max(1, ranks))


def _generation_of(line: str) -> int | None:
    try:
        return int(json.loads(line).get("generation"))
    except (ValueError, TypeError, AttributeError):
        return None


def events_around(lines: Sequence[str], generation: int, *, before: int = EVENTS_BEFORE,
                  cap: int = EVENTS_BYTES) -> list[str]:
    """The event lines of `generation` onwards and up to `before` lines before its first; the newest kept
    where they exceed `cap` bytes."""
    first = next((i for i, line in enumerate(lines) if _generation_of(line) == generation), len(lines))
    chosen, kept, size = lines[max(0, first - before):], [], 0
    for line in reversed(chosen):
        size += len(line.encode()) + 1
        if size > cap:
            break
        kept.append(line)
    return kept[::-1]


def fit(files: Mapping[str, bytes], total: int = BUNDLE_BYTES) -> dict[str, bytes]:
    """The files within `total` bytes, in their order: a log or event file cut to its newest bytes where
    the budget runs short (the JSON and config files come first, small, and are kept whole)."""
    out, left = {}, total
    for fname, data in files.items():
        if len(data) > left and fname.endswith((".tail", ".jsonl")):
            data = data[len(data) - left:] if left else b""
        out[fname] = data
        left = max(0, left - len(data))
    return out


def to_retire(bundles: Mapping[str, int], *, keep: int, committed: Sequence[int],
              retired: Sequence[int] = ()) -> list[str]:
    """Which bundles go (`bundles`: directory name -> the step its incident's run resumed from): all but the
    newest `keep`, and those whose checkpoint retention has deleted (not committed any more, at or below the
    newest step just `retired`)."""
    names = sorted(bundles, key=lambda n: parse(n)[0])
    old = set(names[:max(0, len(names) - keep)])
    newest_retired = max(retired, default=None)
    if newest_retired is not None:
        old |= {n for n, step in bundles.items() if step not in committed and step <= newest_retired}
    return sorted(old)


# Effects -------------------------------------------------------------------------------------------
def _tail(path: Path, start: int, nbytes: int) -> bytes:
    """The last `nbytes` after byte `start` of `path` (start past the end: the file was cut; from 0)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(start if start <= size else 0, size - nbytes))
            return f.read(nbytes)
    except OSError as e:
        return f"(not readable: {e.strerror or e})\n".encode()


def _events(path: Path | None, generation: int) -> bytes:
    if path is None:
        return b""
    window = 4 * EVENTS_BYTES
    data = _tail(path, 0, window)
    if len(data) == window:                  # the first line read is likely cut: from the next one
        data = data.split(b"\n", 1)[-1]
    lines = data.decode("utf-8", errors="replace").splitlines()
    return "".join(f"{line}\n" for line in events_around(lines, generation)).encode()


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _version_file(paths: Sequence[Path]) -> dict[str, Any] | None:
    """The first version file of `paths` that exists: its path, the version it states, its text (capped)."""
    for path in paths:
        try:
            text = path.read_text(errors="replace")[:2048]
        except OSError:
            continue
        found = re.search(r"(?im)^\s*(?:version|[a-z_]*running_version)\s*=\s*\[?([^\]\s]+)", text)
        return {"path": str(path), "version": found[1] if found else None, "text": text}
    return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def environment(env: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """Where the run ran: Python, the platform, the host, the CPU, MindSpore (its package's version: the daemon never
    imports it), CANN and the NPU driver where their version files are; None for what is not there."""
    cann = [ASCEND / "ascend-toolkit" / "latest" / "version.cfg"]
    if env.get("ASCEND_HOME_PATH"):
        home = Path(env["ASCEND_HOME_PATH"])
        cann += [home / "version.info", *sorted(home.glob("*/version.info"))]
    return {"python": platform.python_version(), "python_executable": sys.executable,
            "platform": platform.platform(), "hostname": socket.gethostname(), "cpu": _cpu_model(),
            "cpus": os.cpu_count(), "mindspore": _version("mindspore"), "llm_pretrain": _version("llm-pretrain"),
            "cann": _version_file(cann), "npu_driver": _version_file([ASCEND / "driver" / "version.info"])}


def summary(record: IncidentRecord, *, index: int, resume_step: int, trajectory_hash: str, run: str,
            node: int) -> dict[str, Any]:
    """incident.json: the record, and the checkpoint chosen and why."""
    action = record.action.to_dict() if record.action else None
    return {"index": index, "run": run, "node": node, **record.to_dict(), "trajectory_hash": trajectory_hash,
            "resume_step": resume_step, "resume_reason": action["reason"] if action else None,
            "written_unix_s": time.time()}


def write(root: Path, *, record: IncidentRecord, index: int, resume_step: int, trajectory_hash: str, run: str,
          node: int, config_path: Path, events_path: Path | None, rank_logs: Mapping[int, tuple[str, int]],
          keep: int) -> Path | None:
    """The incident's bundle under `root`, whole or not at all; then the newest `keep` kept. None when `keep`
    is 0 (no bundles). OSError: the disk refused it (the caller says so; the run goes on)."""
    if keep <= 0:
        return None
    final = root / name(index, record.generation, record.kind.value)
    files = {INCIDENT_FILE: json.dumps(summary(record, index=index, resume_step=resume_step, run=run, node=node,
                                               trajectory_hash=trajectory_hash), indent=2, default=str).encode(),
             "environment.json": json.dumps(environment(), indent=2).encode(),
             "config.resolved.toml": _tail(config_path, 0, CONFIG_BYTES),
             "events.jsonl": _events(events_path, record.generation)}
    each = tail_bytes(len(rank_logs))
    files.update({f"rank-{r}.log.tail": _tail(Path(p), start, each) for r, (p, start) in sorted(rank_logs.items())})
    _publish(root, final, fit(files))
    retire(root, keep=keep)
    return final


def _publish(root: Path, final: Path, files: Mapping[str, bytes]) -> None:
    """Each file durable in a hidden directory, then the directory renamed into place."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for fname, data in files.items():
        write_atomically(tmp / fname, data, sync_dir=False)
    fsync_path(tmp)
    shutil.rmtree(final, ignore_errors=True)      # a state.json rebuilt with fewer incidents reuses an index
    os.rename(tmp, final)
    fsync_path(root)


def listed(root: Path) -> dict[str, Path]:
    """The bundles under `root` by directory name, in the incidents' order."""
    found = [p for p in root.iterdir() if parse(p.name)] if root.is_dir() else []
    return {p.name: p for p in sorted(found, key=lambda p: parse(p.name)[0])}


def resume_step_of(bundle: Path) -> int:
    try:
        return int(json.loads((bundle / INCIDENT_FILE).read_text()).get("resume_step") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def retire(root: Path, *, keep: int, committed: Sequence[int] = (), retired: Sequence[int] = ()) -> list[str]:
    """Removes the bundles `to_retire` names (and any `.tmp` a killed daemon left); returns their names."""
    bundles = listed(root)
    gone = to_retire({n: resume_step_of(p) for n, p in bundles.items()}, keep=keep, committed=committed,
                     retired=retired)
    for n in gone:
        shutil.rmtree(bundles[n], ignore_errors=True)
    for tmp in root.glob(".*.tmp") if root.is_dir() else ():
        shutil.rmtree(tmp, ignore_errors=True)
    return gone
