"""Finding, verifying and loading committed checkpoints; setting aside (as step-N.corrupt) the ones that fail.

A checkpoint is trusted only after verification: the manifest parses, every
shard exists with the recorded size and checksum (sha256; CRC32C in the RAM
tier), and every tensor the manifest names is in its shard with the recorded
shape and dtype. One that fails is
renamed `step-N.corrupt` (kept for a person to inspect) and the previous one
is used. `LATEST` is only a hint; the directory scan is the truth.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

from checkpointing import CheckpointError, checksums, layout
from checkpointing.writer import FORMAT, VERSION
import durable


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((path / layout.MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {layout.MANIFEST} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: {layout.MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an llm-pretrain checkpoint manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: format version {manifest.get('version')!r}, this build reads {VERSION}")
    return manifest


def looks_complete(path: Path) -> list[str]:
    """The cheap part of `verify` (no hashing): a readable manifest and every shard present at its
    size. What the daemon checks before it names a step; the ranks verify in full when they load."""
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return [str(e)]
    problems = []
    for shard in manifest.get("shards") or ():
        file = path / shard["file"]
        size = file.stat().st_size if file.is_file() else None
        if size != shard["size_bytes"]:
            problems.append(f"{file.name}: {'missing' if size is None else f'{size} bytes'}, "
                            f"manifest says {shard['size_bytes']}")
    return problems


def verify(path: Path) -> list[str]:
    """Every problem found with a committed checkpoint (empty: it is complete and intact)."""
    try:
        manifest = read_manifest(path)
    except CheckpointError as e:
        return [str(e)]
    problems = []
    for shard in manifest["shards"]:
        file = path / shard["file"]
        if not file.is_file():
            problems.append(f"{file.name}: missing")
            continue
        if file.stat().st_size != shard["size_bytes"]:
            problems.append(f"{file.name}: {file.stat().st_size} bytes, manifest says {shard['size_bytes']}")
            continue
        recorded = checksums.recorded(shard)
        if recorded is None:
            problems.append(f"{file.name}: the manifest records no checksum ({' or '.join(checksums.ALGORITHMS)})")
            continue
        if checksums.file_digest(file, recorded[0]) != recorded[1]:
            problems.append(f"{file.name}: {recorded[0]} mismatch (corrupt)")
            continue
        with safe_open(file, framework="numpy") as f:
            present = set(f.keys())
            for name, meta in manifest["tensors"].items():
                if meta["shard"] != shard["file"]:
                    continue
                if name not in present:
                    problems.append(f"{file.name}: tensor {name!r} missing")
                elif list(f.get_slice(name).get_shape()) != meta["shape"]:
                    problems.append(f"{file.name}: tensor {name!r} has the wrong shape")
    return problems


def load_tensors(path: Path, manifest: dict[str, Any] | None = None, *,
                 shard: str | None = None) -> dict[str, np.ndarray]:
    """All tensors of a (verified) checkpoint, by name; `shard`: only those of that shard file."""
    manifest = manifest or read_manifest(path)
    out: dict[str, np.ndarray] = {}
    for entry in manifest["shards"]:
        if shard is None or entry["file"] == shard:
            out.update(load_file(path / entry["file"]))
    wanted = {n for n, meta in manifest["tensors"].items() if shard is None or meta["shard"] == shard}
    missing = wanted - set(out)
    if missing:
        raise CheckpointError(f"{path}: tensors missing from the shards: {sorted(missing)[:5]}")
    return out


def set_aside(path: Path) -> Path | None:
    """Renames a failed checkpoint out of the way; None if another process already did."""
    target = path.with_name(f"{path.name}.corrupt")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt-{n}")
    try:
        os.rename(path, target)
    except FileNotFoundError:
        return None
    durable.fsync_path(path.parent)
    return target


def find_latest(root: Path, *, before_step: int | None = None, after_step: int | None = None,
                accept: Callable[[dict[str, Any]], bool] | None = None,
                on_corrupt: Callable[[Path, list[str]], None] | None = None,
                set_aside_failed: bool = True) -> tuple[Path, dict[str, Any]] | None:
    """The newest committed checkpoint (below `before_step`, above `after_step` if given) that verifies
    and whose manifest `accept` takes (if given).

    Ones that fail are set aside as step-N.corrupt (if `set_aside_failed`) and reported through
    `on_corrupt`; the search goes on with the next older one.
    """
    for step in reversed(layout.committed_steps(root)):
        if before_step is not None and step >= before_step:
            continue
        if after_step is not None and step <= after_step:
            break
        path = layout.step_dir(root, step)
        problems = verify(path)
        if not problems:
            manifest = read_manifest(path)
            if accept is None or accept(manifest):
                return path, manifest
            continue
        if set_aside_failed and set_aside(path) is not None and on_corrupt is not None:
            on_corrupt(path, problems)
    return None


def find_newest(disk: Path, memory: Path | None, *, accept: Callable[[dict[str, Any]], bool] | None = None,
                on_corrupt: Callable[[Path, list[str]], None] | None = None,
                at_most: int | None = None) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from: the RAM tier's newest (`memory`, a root of the same layout) when
    it is newer than every committed disk checkpoint, verifies, and `accept`s its manifest (the
    caller's check: same config, same layout); else the newest verified one on disk. A torn RAM copy
    is never committed, a corrupt one fails verification (and is set aside), a wiped RAM tier (a
    reboot) is empty: either way the disk's answer stands. `at_most`: none after that step is looked at."""
    before = None if at_most is None else at_most + 1
    on_disk = [s for s in layout.committed_steps(disk) if before is None or s < before]
    found = find_latest(memory, before_step=before, after_step=on_disk[-1] if on_disk else None, accept=accept,
                        on_corrupt=on_corrupt) if memory is not None else None
    return found or find_latest(disk, before_step=before, on_corrupt=on_corrupt)
