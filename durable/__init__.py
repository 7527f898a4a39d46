"""Durable files: the one place that knows how to put bytes on disk so a crash never shows half of them.

Owns: fsync of a path, the atomic writer (temporary name, fsync, rename over
the target, fsync of the directory), writing over a file in place, and the sha256 of a file. Everyone uses
these — the checkpoint writer, the corpus writer, the daemon's state, control,
metrics and unit files. Stdlib only; imports nothing of the project.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def fsync_path(path: Path | str) -> None:
    """fsync a file or a directory by path (a directory's fsync makes its renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path | str, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            digest.update(block)
    return digest.hexdigest()


def write_over(path: Path | str, parts: list) -> None:
    """Writes the buffers `parts` one after another into `path` from its first byte, reusing the
    file's pages where it exists (on a tmpfs, 5x faster than a new file's: no pages to allocate and
    clear), cuts it to their length and fsyncs it. Not atomic: for a file in a directory nobody
    reads until it is committed (a checkpoint's `.tmp`)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    with open(fd, "wb") as f:               # an fd: no truncation, the old pages are written over
        for part in parts:
            f.write(part)
        f.truncate()
        f.flush()
        os.fsync(f.fileno())


def write_atomically(path: Path | str, data: str | bytes | list, *, sync_dir: bool = True) -> None:
    """Writes `data` to a hidden temporary name beside `path`, fsyncs it and renames it over `path`:
    readers see the old file or the whole new one, never a part (someone polling for `path` never
    finds it empty). `data`: text, bytes, or a list of buffers written one after another. `sync_dir`
    also fsyncs the directory, making the rename itself durable; a caller that fsyncs the directory
    after several writes may skip it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    parts = data if isinstance(data, list) else [data.encode() if isinstance(data, str) else data]
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)       # a full disk must not also keep the part written
        raise
    if sync_dir:
        fsync_path(path.parent)
