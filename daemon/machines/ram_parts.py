"""RAM-tier steps taken from peers: a whole step, or the parts that make one, and a buddy's part copied.

`take`: a machine whose RAM tier lacks the step the run resumes from (rebooted, replaced, back after the run went
on) or holds only its own part of it (checkpoint.memory_placement = "buddy": checkpointing.parts) gets the rest
from the peers that hold it, over their daemons' HTTP (daemon.machines.ram_peers): a whole copy from one, or each
missing machine's part from whoever holds it — the machine itself, or its buddy's copy when it is lost. Built in
`step-N.tmp` (the part already here linked, not copied), verified by the manifest's checksums, then put in place.

`copy_part`: a buddy's copy, while the ranks train: the newest step of a peer's own part that this machine holds
its own part of too, added to this machine's `step-N/` (its shards, checked, then the manifest naming both). Never
imports MindSpore.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import time
import urllib.error
from pathlib import Path
from typing import Callable, Sequence

from checkpointing import CheckpointError, checksums, layout, parts, reader
from daemon.machines.ram_peers import STEPS, FetchError, get
import durable

_FILE = re.compile(r"[A-Za-z0-9._-]+")
_FAILURES = (OSError, ValueError, KeyError, TypeError, CheckpointError, urllib.error.URLError,
             http.client.HTTPException)              # a peer gone mid-response: IncompleteRead


def take(urls: Sequence[str], run_id: str, step: int, into: Path, *, deadline_s: float, trust_own: bool = True,
         tick: Callable[[], None] = lambda: None) -> tuple[int, list[str]]:
    """Makes committed step `step` whole in the RAM tier `into` from the peers at `urls` (tried in order; each
    gives what it holds that is still lacking). `trust_own`: what `into` holds of the step is this run's history
    (this machine ran the last generation); else it is another's (trained before a rollback, or while the run went
    on without it) and is replaced whole. Returns (bytes copied, the peers that gave); raises FetchError, the
    partial copy removed and any part already here kept."""
    name, own, tmp = layout.step_name(step), layout.step_dir(into, step), layout.tmp_dir(into, step)
    started, failures, given, copied = time.monotonic(), [], [], 0
    left = lambda: deadline_s - (time.monotonic() - started)       # noqa: E731
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        into.mkdir(parents=True, exist_ok=True)
        have = [reader.read_manifest(own)] if own.is_dir() and trust_own else []
        if have and parts.is_whole(have[0]):
            return 0, []
        tmp.mkdir()
        for shard in have[0]["shards"] if have else ():
            os.link(own / shard["file"], tmp / shard["file"])
        whole = None
        for url in urls:
            try:
                got, n = _from_peer(url, run_id, name, tmp, have[0] if have else None, left, tick)
            except (FetchError, *_FAILURES) as e:
                failures.append(f"{url}: {e}")
                continue
            if got is None:
                continue
            copied += n
            given.append(url)
            have = [got if parts.is_whole(got) else parts.merge([*have, got])]
            if parts.is_whole(have[0]):
                whole = have[0]
                break
        if whole is None:
            lacking = sorted(set(range(parts.slots(have[0])[1])) - parts.slots(have[0])[0]) if have else "all"
            raise FetchError(f"step {step}: no peer gave the part(s) of slot(s) {lacking}"
                             + (f" ({'; '.join(failures)})" if failures else ""))
        durable.write_atomically(tmp / layout.MANIFEST, json.dumps(whole, sort_keys=True).encode(), sync_dir=False)
        problems = reader.verify(tmp)
        if problems:
            raise FetchError(f"the copy of step {step} fails verification: {'; '.join(problems[:3])}")
        for path in tmp.iterdir():
            durable.fsync_path(path)
        durable.fsync_path(tmp)
        _put_in_place(into, step, tmp)
        return copied, given
    except FetchError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except _FAILURES as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise FetchError(f"taking step {step} from {', '.join(urls)} failed: {e}") from e


def _from_peer(url: str, run_id: str, name: str, tmp: Path, have: dict | None, left: Callable[[], float],
               tick: Callable[[], None]) -> tuple[dict | None, int]:
    """What the peer at `url` holds of step `name` that `have` (the manifest of what `tmp` holds) lacks, copied into
    `tmp`: its manifest (whole, or a part naming the slots it gave) and the bytes copied; (None, 0) where it holds
    nothing new."""
    theirs = json.loads(get(url, run_id, f"/{name}/{layout.MANIFEST}", None, left()))
    if parts.is_whole(theirs):
        wanted = theirs
    else:
        held = parts.slots(have)[0] if have and parts.slots(have) else frozenset()
        new = sorted(parts.slots(theirs)[0] - held)
        if not new:
            return None, 0
        slices = [parts.of_slot(theirs, s) for s in new]
        wanted = {**theirs, "shards": [sh for shards, _ in slices for sh in shards],
                  "tensors": {n: t for _, tensors in slices for n, t in tensors.items()},
                  "part": {**theirs["part"], "slots": new}}
    ours = {sh["file"] for sh in have["shards"]} if have else set()
    copied = 0
    for shard in wanted["shards"]:
        if not _FILE.fullmatch(shard["file"]):
            raise FetchError(f"the manifest names a shard {shard['file']!r}")
        if shard["file"] not in ours:                  # a shard here already is this machine's own, linked
            with open(tmp / shard["file"], "wb") as out:
                copied += get(url, run_id, f"/{name}/{shard['file']}", out, left(), tick)
    return wanted, copied


def _put_in_place(into: Path, step: int, tmp: Path) -> None:
    """`tmp` becomes `step-N/`; a part there before goes (its files are linked into `tmp`). A crash between the
    two renames leaves neither: the step is taken again, or the run resumes from the disk."""
    own = layout.step_dir(into, step)
    if own.exists():
        doomed = into / f"{layout.step_name(step)}.deleting"
        shutil.rmtree(doomed, ignore_errors=True)
        os.rename(own, doomed)
        os.rename(tmp, own)
        shutil.rmtree(doomed, ignore_errors=True)
    else:
        os.rename(tmp, own)
    durable.fsync_path(into)


def copy_part(url: str, run_id: str, slot: int, into: Path, *, after: int, deadline_s: float,
              tick: Callable[[], None] = lambda: None, copying: Callable[[int], None] = lambda step: None) -> int | None:
    """Copies the part of slot `slot` from the peer at `url` (its own) into this machine's `step-N/` of the
    newest step after `after` it holds too, its own part there. Returns the step copied, or None (no newer step
    both hold; or one this machine already holds whole or with that slot). Raises FetchError, or OSError where the
    step was retired meanwhile (the next round copies a newer one). `copying(step)`: before the transfer (retention
    keeps that step meanwhile); `tick` between chunks (it may raise to stop the copy)."""
    started = time.monotonic()
    left = lambda: deadline_s - (time.monotonic() - started)       # noqa: E731
    try:
        steps = json.loads(get(url, run_id, STEPS, None, left()))
        step = max((s for s in steps if s > after and layout.step_dir(into, s).is_dir()), default=None)
        if step is None:
            return None
        own = layout.step_dir(into, step)
        copying(step)
        mine = reader.read_manifest(own)
        held = parts.slots(mine)
        if held is None or slot in held[0]:
            return None
        name = layout.step_name(step)
        theirs = json.loads(get(url, run_id, f"/{name}/{layout.MANIFEST}", None, left()))
        if parts.slots(theirs) is None or slot not in parts.slots(theirs)[0]:
            raise FetchError(f"{url} holds no part of slot {slot} at step {step}")
        shards, tensors = parts.of_slot(theirs, slot)
        for shard in shards:
            if not _FILE.fullmatch(shard["file"]):
                raise FetchError(f"the manifest names a shard {shard['file']!r}")
            partial = own / f".{shard['file']}.copy"
            try:
                with open(partial, "wb") as out:
                    get(url, run_id, f"/{name}/{shard['file']}", out, left(), tick)
                recorded = checksums.recorded(shard)
                if recorded is None or checksums.file_digest(partial, recorded[0]) != recorded[1]:
                    raise FetchError(f"{shard['file']} of step {step} from {url} fails its checksum")
                durable.fsync_path(partial)
                tick()                                  # nothing is put in place once the caller stopped
                os.rename(partial, own / shard["file"])
            finally:
                partial.unlink(missing_ok=True)          # a copy that broke off: nothing of it stays
        durable.fsync_path(own)
        copy = {**theirs, "shards": shards, "tensors": tensors, "part": {**theirs["part"], "slots": [slot]}}
        tick()
        durable.write_atomically(own / layout.MANIFEST, json.dumps(parts.merge([mine, copy]), sort_keys=True)
                                 .encode())
        return step
    except (ValueError, KeyError, TypeError, CheckpointError, urllib.error.URLError, http.client.HTTPException) as e:
        raise FetchError(f"copying slot {slot}'s part from {url} failed: {e}") from e
