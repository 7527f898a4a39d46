"""Writing one rank's shard in the background, and the commit that makes a checkpoint exist.

Protocol, on a filesystem every rank sees (no collective needed):
1. every rank writes its shard into `step-N.tmp/`, fsyncs it, then writes and
   fsyncs a small marker (`shard-R-of-W.done.json`: file, checksum, tensors;
   rank 0 keeps its own in memory);
2. rank 0, once the other W-1 markers are there, writes `manifest.json` (tensor →
   shard, shapes, dtypes, the checksum of each shard — sha256, or the RAM
   tier's CRC32C: checkpointing.checksums — step, world size, run state),
   fsyncs it, renames `step-N.tmp/` to `step-N/`, fsyncs the parent, then
   updates `LATEST` atomically and calls the `on_commit` hook, if any.
A crash at any moment leaves either the previous checkpoints or the new one
complete; `*.tmp` directories are never loaded and are removed at the next start.

The caller blocks only while it copies its tensors to host memory; the thread
here serialises, hashes and fsyncs at the lowest CPU priority, so it takes
cycles the training step leaves idle. A save due while this rank's previous one
is still being written waits for it (reported as "waited"), never doubles up.
Errors never propagate into training: they are reported as "failed" events
and kept in `last_error`.

Retention is not the writer's decision (see checkpointing.retention): the
caller retires old checkpoints from `on_commit`, or, for a writer used on its
own, passes `keep_last`.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import safetensors.numpy as safetensors_numpy

from checkpointing import CheckpointError, checksums, layout, parts, retention
from checkpointing.safetensors_parts import PartsCache, parts_and_table
import durable

FORMAT = "llm-pretrain-checkpoint"
VERSION = 1

Emit = Callable[..., None]   # emit(stage, step=..., seconds=..., error=...)


def _write_durably(path: Path, data: bytes | list) -> None:
    """Appears under its name only once complete (the committer polls for markers); the directory
    is fsynced once after all of a rank's files."""
    durable.write_atomically(path, data, sync_dir=False)


def _copy_unlocked(dst: memoryview, src: memoryview) -> None:
    """dst[:] = src with the GIL released (numpy's copy): this low-priority thread must not hold the
    step's thread waiting on it."""
    np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))


class ShardWriter:
    def __init__(self, root: str | Path, *, rank: int, world: int, emit: Emit | None = None,
                 on_commit: Callable[[int], None] | None = None, keep_last: int | None = None,
                 keep_every: int = 0, commit_timeout_s: float = 300.0, low_priority: bool = True,
                 indent_manifest: bool = True, checksum: str = checksums.SHA256, recycle: bool = False,
                 latest_hint: bool = True, part: Mapping[str, int] | None = None, direct: bool = True):
        """`on_commit(step)` runs on rank 0's writer thread right after `step` is committed (an error
        it raises is reported like a failed save). `keep_last`/`keep_every`, for a writer used on
        its own, retire old checkpoints after each commit (retention.retire_old); None: never.
        `checksum`: what each shard is recorded with (checkpointing.checksums). `recycle`: what
        this writer retires, it writes the next save over (layout: `.spare/`) — the RAM tier's.
        `latest_hint`: update `LATEST` after each commit (a hint for people; the RAM tier has none).
        `part`: this writer's ranks commit one machine's part of the checkpoint ({slot, slots, ranks_per_slot}:
        checkpointing.parts), its first rank the committer, `rank` and `world` the run's. `direct`: shards
        are written past the page cache where the file system allows (durable.write_direct)."""
        self.root = Path(root)
        self.rank, self.world = rank, world
        self.part = dict(part) if part and part["slots"] > 1 else None
        # the ranks whose shards this writer's committer collects, itself first: all, or its machine's part's
        self.committers_ranks = parts.ranks_of(self.part) if self.part else range(world)
        self.commits = self.committer(rank, self.part)
        self.emit = emit or (lambda stage, **info: None)
        self.on_commit = on_commit
        self.keep_last, self.keep_every = keep_last, keep_every
        self.commit_timeout_s = commit_timeout_s
        # a writer process whose rank died: whether it is so, and how long its commit then waits for shards
        self.orphaned: Callable[[], bool] = lambda: False
        self.orphan_wait_s = 0.0
        self.low_priority = low_priority
        self.indent_manifest = indent_manifest   # False: the C JSON encoder, 3x faster (the RAM tier's saves)
        self.checksum, self.recycle, self.latest_hint = checksums.require(checksum), recycle, latest_hint
        self.direct = direct
        self._layouts = PartsCache()                 # the caller's staging buffers come again each save
        self.last_error: BaseException | None = None   # of the latest save; None while it goes well
        self.last_committed: int | None = None
        # one thread for all of this writer's saves, started at the first: a thread started per save
        # cost the caller ~0.4 ms (Thread.start waits for it to run), measured on tiny's RAM saves
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()

    @staticmethod
    def committer(rank: int, part: Mapping[str, int] | None) -> bool:
        """Whether `rank` commits: rank 0, or the first rank of its machine's `part`."""
        return rank == (parts.ranks_of(part)[0] if part and part["slots"] > 1 else 0)

    def save(self, step: int, tensors: Mapping[str, np.ndarray], *, run_state: dict[str, Any] | None = None,
             versions: dict[str, str] | None = None) -> None:
        """Starts writing this rank's `tensors` (already host copies) for `step`; returns at once."""
        if self.commits and run_state is None:
            raise ValueError("the committing rank must pass run_state")
        self.ready(step)
        self.last_error = None       # from here on it describes this save
        self._idle.clear()
        self._jobs.put((step, dict(tensors), run_state, versions or {}))
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=f"checkpoint-writer-{self.root.name}",
                                            daemon=True)
            self._thread.start()

    def ready(self, step: int) -> None:
        """Waits until this rank's previous save is done (reported as "waited"): after this, buffers the
        previous save was given may be reused."""
        if not self._idle.is_set():
            started = time.monotonic()
            self._idle.wait()
            self.emit("waited", step=step, seconds=time.monotonic() - started)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until the save in flight is done; True if none is left running."""
        return self._idle.wait(timeout_s)

    def _serve(self) -> None:
        """The writer's thread: one save at a time (save() waits for the previous one first)."""
        if self.low_priority:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except OSError:
                pass
        while True:
            job = self._jobs.get()
            try:
                self.write_now(*job)
            finally:
                self._idle.set()

    def refuse(self, step: int, reason: str) -> None:
        """This rank does not write its shard of `step` (a save that cannot fit): rank 0 removes what
        failed saves left (space a full disk needs back, so saves can resume by themselves); any
        other rank tells the committer at once, which would otherwise wait out its timeout for a
        shard that never comes (the ranks judge free space each at its own moment)."""
        self.last_error = CheckpointError(reason)
        try:
            if self.commits:
                layout.remove_stale_saves(self.root, before_step=step)
                return
            tmp = layout.tmp_dir(self.root, step)
            tmp.mkdir(parents=True, exist_ok=True)    # rank 0's next save removes it if it refused too
            _write_durably(tmp / layout.marker_name(self.rank, self.world), json.dumps({"error": reason}).encode())
        except OSError:
            pass

    def staging(self, like: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Host buffers of `like`'s names, shapes and dtypes for the caller to copy its tensors into
        and pass to save(), made once and reused (no page faults; ready() says when they are free)."""
        return {name: np.empty_like(a) for name, a in like.items()}

    # Writing: on the writer's thread, or in a writer process ---------------
    def write_now(self, step: int, tensors: Mapping[str, np.ndarray], run_state: dict[str, Any] | None,
                  versions: dict[str, str]) -> None:
        """Writes this rank's shard of `step` and, on rank 0, commits it, on the caller's thread (the
        writer's own, or a writer process's); a failure is reported and kept in last_error."""
        started = time.monotonic()
        tmp = layout.tmp_dir(self.root, step)
        try:
            if layout.step_dir(self.root, step).exists():
                self.emit("exists", step=step, seconds=0.0)
                return
            if self.commits:            # what failed saves of earlier steps left (a full disk, most often)
                layout.remove_stale_saves(self.root, before_step=step)
            tmp.mkdir(parents=True, exist_ok=True)
            shard = layout.shard_name(self.rank, self.world)
            meta = {"step": str(step), "rank": str(self.rank)}
            try:
                parts, table = parts_and_table(tensors, metadata=meta, cache=self._layouts)
            except ValueError:          # a dtype only the library knows how to name
                parts = [safetensors_numpy.save(dict(tensors), metadata=meta)]
                table = {n: {"shape": list(a.shape), "dtype": a.dtype.name} for n, a in tensors.items()}
            running = checksums.Running(self.checksum)
            if self.recycle:            # a retired shard of ours, written over in place (or a new file)
                layout.take_spare(self.root, shard, tmp / shard)
                durable.write_over(tmp / shard, parts)
                running.update_all(parts)
            elif self.direct:           # past the page cache, checksummed chunk by chunk as it goes
                durable.write_direct(tmp / shard, parts, running.update, copy=_copy_unlocked)
            else:
                _write_durably(tmp / shard, parts)
                running.update_all(parts)
            marker = {"file": shard, self.checksum: running.hexdigest(),
                      "size_bytes": sum(len(p) for p in parts),
                      "tensors": table}
            del parts
            if not self.commits:        # the committer's own marker stays in its memory
                _write_durably(tmp / layout.marker_name(self.rank, self.world), json.dumps(marker).encode())
            durable.fsync_path(tmp)
            self.emit("written", step=step, seconds=time.monotonic() - started)
            if self.commits:
                self._commit(step, tmp, marker, run_state or {}, versions, started)
        except BaseException as e:   # a thread boundary: report, never kill training
            self.last_error = e
            self.emit("failed", step=step, seconds=time.monotonic() - started, error=f"{type(e).__name__}: {e}")
            if self.commits:
                shutil.rmtree(tmp, ignore_errors=True)
                return
            try:        # its own shard goes (it is space a full disk needs back) ...
                (tmp / layout.shard_name(self.rank, self.world)).unlink(missing_ok=True)
            except OSError:
                pass
            try:        # ... and the committer is told at once rather than left to wait out its timeout
                marker = tmp / layout.marker_name(self.rank, self.world)
                _write_durably(marker, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
            except OSError:
                try:
                    os.rmdir(tmp)       # only if empty: never re-create a directory rank 0 removed
                except OSError:
                    pass

    def _commit(self, step: int, tmp: Path, own: dict, run_state: dict[str, Any], versions: dict[str, str],
                started: float) -> None:
        """`own`: rank 0's marker, never written (only the other ranks' travel through files)."""
        others = self.committers_ranks[1:]
        markers = [tmp / layout.marker_name(r, self.world) for r in others]
        deadline, orphan = time.monotonic() + self.commit_timeout_s, False
        while not all(m.exists() for m in markers):
            if not orphan and self.orphaned():     # counted once, from when it was first seen
                deadline, orphan = min(deadline, time.monotonic() + self.orphan_wait_s), True
            if time.monotonic() > deadline:
                missing = [r for r, m in zip(others, markers) if not m.exists()]
                raise CheckpointError(f"rank(s) {missing} did not finish their shard of step {step} within "
                                      + (f"{self.orphan_wait_s:g} s of this rank's end" if orphan else
                                         f"{self.commit_timeout_s:.0f} s"))
            time.sleep(0.02)
        shards, tensors = [], {}
        for rank, info in zip(self.committers_ranks, [own, *(json.loads(m.read_text()) for m in markers)]):
            if "error" in info:
                raise CheckpointError(f"rank {rank} failed to write its shard of step {step}: {info['error']}")
            shards.append({k: info[k] for k in ("file", *checksums.ALGORITHMS, "size_bytes") if k in info})
            for name, meta in info["tensors"].items():
                if name in tensors:
                    raise CheckpointError(f"tensor {name!r} was written by two ranks at step {step}")
                tensors[name] = {"shard": info["file"], **meta}
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "world_size": self.world,
                    "created_unix_s": time.time(), "versions": versions, "shards": shards,
                    "tensors": tensors, "run_state": run_state}
        if self.part:
            manifest["part"] = parts.part_of_writer(self.part)
        _write_durably(tmp / layout.MANIFEST, json.dumps(manifest, indent=1 if self.indent_manifest else None,
                                                         sort_keys=True).encode())
        for m in markers:
            m.unlink()
        durable.fsync_path(tmp)
        os.rename(tmp, layout.step_dir(self.root, step))
        durable.fsync_path(self.root)
        if self.latest_hint:
            durable.write_atomically(self.root / layout.LATEST, layout.step_name(step) + "\n")
        self.last_committed = step
        self.emit("committed", step=step, seconds=time.monotonic() - started)
        if self.keep_last is not None:
            doomed = retention.retire_old(self.root, keep_last=self.keep_last, keep_every=self.keep_every,
                                          recycle=self.recycle)
            if doomed:
                self.emit("retired", step=step, steps=doomed)
        if self.on_commit is not None:
            self.on_commit(step)
