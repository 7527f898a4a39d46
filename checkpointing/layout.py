"""Names and paths inside a checkpoint root, and the renames that retire or roll back checkpoints.

    <root>/step-00001200/manifest.json
    <root>/step-00001200/shard-00000-of-00002.safetensors
    <root>/step-00001250.tmp/        being written: never loaded, removed at start
    <root>/step-00001100.corrupt/    failed verification: kept for a person to look at
    <root>/step-00001000.deleting/   retired by retention, being deleted: removed at start
    <root>/LATEST                    a hint ("step-00001200"), written atomically after commit
    <root>/.spare/shard-…            a retired checkpoint's shards, for the next save to write over

The RAM tier of a run (checkpoint.memory_interval_steps) is a root of the same
layout on a tmpfs, one per machine: `memory_root`. On several machines each holds a whole
checkpoint written by its own ranks alone (shard-<local rank>-of-<ranks per machine>). Its writer recycles: a checkpoint it retires
leaves its shards in `.spare/`, and each rank's next save moves its own shard
from there into its `.tmp` and writes over it (on a tmpfs a new file's pages
cost several times the writing itself). A spare is never part of a checkpoint: it is
moved out after the retiring rename, and in before the commit's.
"""
from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Collection

from durable import fsync_path

MANIFEST = "manifest.json"
LATEST = "LATEST"
RUN_ID = ".run-id"
SPARE = ".spare"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def run_id(run_dir: Path) -> str:
    """The run's identity: a random id in `<run_dir>/.run-id`, made by whoever asks first (without
    overwriting: a race ends with every asker reading the winner's). A run directory deleted and made
    again gets a new one. Raises OSError if `run_dir` does not exist or cannot be written."""
    path = run_dir / RUN_ID
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    tmp = run_dir / f"{RUN_ID}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    tmp.write_text(uuid.uuid4().hex + "\n")
    fsync_path(tmp)
    try:
        os.link(tmp, path)
        fsync_path(run_dir)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


def memory_root(run_dir: Path, base: str | Path, node: int = 0) -> Path:
    """The RAM tier's root for the run in `run_dir`, under the tmpfs `base`: named by the run's id,
    so another run, or this run directory deleted and made again, never finds its RAM checkpoints;
    and, on a machine other than the run's node 0 (`node`: run.node_rank, the machine's own index),
    by that index too, so that machines whose tmpfs is one (containers on one host) never share one."""
    return Path(base) / (f"llm-pretrain-{run_id(run_dir)}" + (f"-node-{node}" if node else ""))


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def step_dir(root: Path, step: int) -> Path:
    return root / step_name(step)


def tmp_dir(root: Path, step: int) -> Path:
    return root / f"{step_name(step)}.tmp"


def shard_name(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def marker_name(rank: int, world: int) -> str:
    """Written by each rank once its shard is durable; the committer collects them."""
    return f"shard-{rank:05d}-of-{world:05d}.done.json"


def parse_step(name: str) -> int | None:
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def committed_steps(root: Path) -> list[int]:
    """Steps with a committed directory, ascending (a directory scan: the truth LATEST only hints at)."""
    try:
        with os.scandir(root) as entries:      # the entries' types come with the listing: no stat each
            steps = [parse_step(e.name) for e in entries if e.is_dir()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(s for s in steps if s is not None)


def retire(root: Path, step: int, *, recycle: bool | Collection[str] = False) -> None:
    """Deletes a committed checkpoint so that a crash midway never leaves a partial `step-N/`:
    it stops being a checkpoint at the rename, before any file goes. `recycle`: its shards go to
    `.spare/` (replacing older spares of the same name) for the next save to write over — all, or those
    of the names given (the ranks' own here: a buddy's copied shards no writer here writes over)."""
    doomed = root / f"{step_name(step)}.deleting"
    try:
        os.rename(step_dir(root, step), doomed)
    except FileNotFoundError:
        return
    fsync_path(root)
    if recycle:
        spare = root / SPARE
        spare.mkdir(exist_ok=True)
        for name in os.listdir(doomed):
            if name.startswith("shard-") and name.endswith(".safetensors") and (
                    recycle is True or name in recycle):
                os.rename(doomed / name, spare / name)     # over an older spare of the name
    shutil.rmtree(doomed, ignore_errors=True)


def take_spare(root: Path, name: str, into: Path) -> bool:
    """Moves the spare shard `name` (layout.retire's recycle) to `into`; False where there is none."""
    try:
        os.rename(root / SPARE / name, into)
        return True
    except FileNotFoundError:
        return False


def roll_back(root: Path, target: int) -> list[int]:
    """Makes `target` the newest checkpoint: every committed step after it is renamed
    `step-N.rolledback` (never loaded; kept for a person until the next rollback of the same step
    replaces it). Returns the steps rolled back."""
    moved = []
    for step in committed_steps(root):
        if step <= target:
            continue
        dest = root / f"{step_name(step)}.rolledback"
        if dest.exists():
            shutil.rmtree(dest)
        os.rename(step_dir(root, step), dest)
        moved.append(step)
    if moved:
        (root / LATEST).unlink(missing_ok=True)      # a hint only; the scan is the truth
        fsync_path(root)
    return moved


def remove_temporaries(root: Path) -> list[str]:
    """Deletes in-progress and half-deleted directories a crash left behind; returns their names."""
    removed = []
    if root.is_dir():
        for p in sorted([*root.glob("step-*.tmp"), *root.glob("step-*.deleting")]):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
        for p in root.glob(f".{LATEST}.tmp-*"):
            p.unlink(missing_ok=True)
        shutil.rmtree(root / SPARE, ignore_errors=True)     # memory only (another world's names, too)
    return removed


def remove_stale_saves(root: Path, *, before_step: int) -> list[str]:
    """Deletes the `step-N.tmp` directories of steps before `before_step`: saves are made one at a
    time, so those are what failed saves left (a rank re-creating one rank 0 already removed)."""
    removed = []
    for p in sorted(root.glob("step-*.tmp")):
        step = parse_step(p.name.removesuffix(".tmp"))
        if step is not None and step < before_step:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return removed
