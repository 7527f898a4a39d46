"""Durable files: the one place that knows how to put bytes on disk so a crash never shows half of them.

Owns: fsync of a path, the atomic writer (temporary name, fsync, rename over
the target, fsync of the directory) and writing over a file in place. Everyone uses these — the checkpoint writer,
the corpus writer, the daemon's state, control, metrics and unit files (checksums of files:
checkpointing.checksums). Stdlib only; imports nothing of the project.
"""
from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


def fsync_path(path: Path | str) -> None:
    """fsync a file or a directory by path (a directory's fsync makes its renames durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_over(path: Path | str, parts: list) -> None:
    """Writes the buffers `parts` one after another into `path` from its first byte, reusing the
    file's pages where it exists (on a tmpfs, 5x faster than a new file's: no pages to allocate and
    clear), cuts it to their length and fsyncs it. Not atomic: for a file in a directory nobody
    reads until it is committed (a checkpoint's `.tmp`)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)     # no O_TRUNC: the old pages are written over
    try:
        os.ftruncate(fd, _write_all(fd, parts))
        os.fsync(fd)
    finally:
        os.close(fd)


_IOV_MAX = 1024


def _write_all(fd: int, parts: list) -> int:
    """Writes the buffers one after another with as few system calls as the kernel allows (writev:
    a checkpoint shard is a header and a buffer per tensor); returns the bytes written."""
    views = [memoryview(p).cast("B") for p in parts]
    views = [v for v in views if len(v)]
    total = sum(len(v) for v in views)
    first = 0
    while first < len(views):
        written = os.writev(fd, views[first:first + _IOV_MAX])
        while first < len(views) and written >= len(views[first]):
            written -= len(views[first])
            first += 1
        if written:                     # a short write: the rest of that buffer next
            views[first] = views[first][written:]
    return total


DIRECT_CHUNK = 1 << 20       # a write past the page cache: this much at a time, through a buffer the cache keeps
_BLOCK = 4096                # O_DIRECT's alignment: of the buffer, the offset and the length


def _copy(dst: memoryview, src: memoryview) -> None:
    dst[:] = src


def write_direct(path: Path | str, parts: list, on_bytes: Callable[[memoryview], None],
                 copy: Callable[[memoryview, memoryview], None] = _copy) -> bool:
    """Writes the buffers `parts` one after another into a new file `path` past the page cache
    (O_DIRECT), through one page-aligned chunk at a time, and fsyncs it; `on_bytes` is called with
    each chunk's bytes in order (a checksum taken while they are in the CPU's cache: the parts are
    read from memory once, where a buffered write and a checksum after it read them twice and
    write them to the page cache once more, its writeback reading them again). The tail is
    padded to the block and the file cut back to its length. False where the file system takes
    no O_DIRECT (refused at the open or the first write: overlayfs on older kernels, a tmpfs before
    Linux 6.6): then it is written buffered, `on_bytes` called with each part. Atomic
    as write_atomically (a hidden name, renamed over `path`; the directory is not fsynced). `copy(dst,
    src)` fills the chunk: a memoryview's own copy by default, which holds the GIL (a caller with
    numpy passes one that releases it)."""
    return _replacing(path, lambda tmp: _write_direct(tmp, parts, on_bytes, copy))


def _write_direct(path: Path, parts: list, on_bytes: Callable[[memoryview], None],
                  copy: Callable[[memoryview, memoryview], None]) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o666)
    except (AttributeError, OSError) as e:
        if isinstance(e, OSError) and e.errno != errno.EINVAL:
            raise
        _write_buffered(path, parts, on_bytes)
        return False
    told: list[int] = []

    def tell(data: memoryview) -> None:
        told.append(len(data))
        on_bytes(data)

    try:
        # page-aligned; unmapped when the last view of it goes (a failure's traceback may hold one)
        total = _write_chunks(fd, parts, mmap.mmap(-1, DIRECT_CHUNK), tell, copy)
        os.ftruncate(fd, total)
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL or told:             # refused at its first write: opened, yet not taken
            raise
        os.close(fd)
        fd = -1
        _write_buffered(path, parts, on_bytes)
        return False
    finally:
        if fd >= 0:
            os.close(fd)
    return True


def _write_chunks(fd: int, parts: list, chunk: mmap.mmap, on_bytes: Callable[[memoryview], None],
                  copy: Callable[[memoryview, memoryview], None]) -> int:
    view, filled, total = memoryview(chunk), 0, 0
    for part in parts:
        data = memoryview(part).cast("B")
        at = 0
        while at < len(data):
            n = min(len(data) - at, len(view) - filled)
            copy(view[filled:filled + n], data[at:at + n])
            filled, at = filled + n, at + n
            if filled == len(view):
                _write_block(fd, view)
                on_bytes(view)                          # after the write: a refused first write told nothing
                total, filled = total + filled, 0
    if filled:
        padded = -(-filled // _BLOCK) * _BLOCK
        view[filled:padded] = bytes(padded - filled)
        _write_block(fd, view[:padded])
        on_bytes(view[:filled])
        total += filled
    return total


def _write_block(fd: int, view: memoryview) -> None:
    written = 0
    while written < len(view):                 # O_DIRECT writes whole blocks; a short one is of whole blocks
        n = os.write(fd, view[written:])
        if n <= 0:
            raise OSError(errno.EIO, "a write past the page cache wrote nothing")
        written += n


def _write_buffered(path: Path | str, parts: list, on_bytes: Callable[[memoryview], None]) -> None:
    _write_file(path, parts)
    for part in parts:
        on_bytes(memoryview(part).cast("B"))


def write_atomically(path: Path | str, data: str | bytes | list, *, sync_dir: bool = True) -> None:
    """Writes `data` to a hidden temporary name beside `path`, fsyncs it and renames it over `path`:
    readers see the old file or the whole new one, never a part (someone polling for `path` never
    finds it empty). `data`: text, bytes, or a list of buffers written one after another. `sync_dir`
    also fsyncs the directory, making the rename itself durable; a caller that fsyncs the directory
    after several writes may skip it."""
    parts = data if isinstance(data, list) else [data.encode() if isinstance(data, str) else data]
    _replacing(path, lambda tmp: _write_file(tmp, parts))
    if sync_dir:
        fsync_path(Path(path).parent)


def _replacing(path: Path | str, write: Callable[[Path], T]) -> T:
    """`write(tmp)` to a hidden temporary name beside `path`, then renamed over it; what `write` returns.
    A failure removes the temporary (a full disk must not also keep the part written)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        result = write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return result


def _write_file(path: Path | str, parts: list) -> None:
    """The buffers one after another into a new (or emptied) file, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)    # as open(): less the umask
    try:
        _write_all(fd, parts)
        os.fsync(fd)
    finally:
        os.close(fd)
