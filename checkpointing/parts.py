"""A checkpoint in parts, one per machine: the RAM tier's buddy placement (checkpoint.memory_placement = "buddy").

On several machines each machine's ranks write the shards the run's plan gives them (the disk's plan,
checkpointing.partition, over every rank), and the machine's first rank commits those alone: a committed
`step-N/` whose manifest has a `part` ({"slots": [its slot], "of": machines, "ranks_per_slot": ranks each}).
A machine's slot is its place in the generation (its ranks are slot x ranks_per_slot onwards). A buddy machine
adds a copy of another's part to its own `step-N/` (daemon.machines.buddy_copies): the manifest then names both
slots. A part is never loaded; a step is whole once the parts of every slot are in one directory (`merge`), which
the daemons make before the ranks resume from it (daemon.machines.ram_parts). Pure: no files but what is given.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

_SHARD_RANK = re.compile(r"^shard-(\d+)-of-(\d+)\.safetensors$")


def ranks_of(part: Mapping[str, int]) -> range:
    """The ranks whose shards make part `part` ({slot, slots, ranks_per_slot}: a writer's)."""
    first = part["slot"] * part["ranks_per_slot"]
    return range(first, first + part["ranks_per_slot"])


def part_of_writer(part: Mapping[str, int]) -> dict[str, Any]:
    """The manifest's `part` for the part a writer commits."""
    return {"slots": [part["slot"]], "of": part["slots"], "ranks_per_slot": part["ranks_per_slot"]}


def slots(manifest: Mapping[str, Any]) -> tuple[frozenset[int], int] | None:
    """The slots a manifest's step directory holds and of how many; None: it is whole."""
    part = manifest.get("part")
    if not part:
        return None
    return frozenset(int(s) for s in part["slots"]), int(part["of"])


def is_whole(manifest: Mapping[str, Any]) -> bool:
    held = slots(manifest)
    return held is None or len(held[0]) == held[1]


def slot_of_shard(file: str, ranks_per_slot: int) -> int:
    """The slot whose ranks wrote shard `file` (shard-<rank>-of-<world>)."""
    m = _SHARD_RANK.match(file)
    if m is None:
        raise ValueError(f"{file!r} is not a shard's name")
    return int(m.group(1)) // ranks_per_slot


def of_slot(manifest: Mapping[str, Any], slot: int) -> tuple[list[dict], dict[str, dict]]:
    """The shards and tensors of `slot` in a part's manifest."""
    per = int(manifest["part"]["ranks_per_slot"])
    shards = [s for s in manifest["shards"] if slot_of_shard(s["file"], per) == slot]
    files = {s["file"] for s in shards}
    return shards, {n: t for n, t in manifest["tensors"].items() if t["shard"] in files}


def merge(manifests: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One manifest of the parts of the same step in `manifests` (the first's run state and fields): its `part`
    names every slot they hold together, or none where they make the step whole. ValueError where they are of
    different steps or layouts, or hold the same slot differently."""
    manifests = list(manifests)
    first = manifests[0]
    part = first.get("part")
    if not part:
        raise ValueError("a whole checkpoint is not a part")
    out = {**first, "shards": [], "tensors": {}}
    held: set[int] = set()
    by_file: dict[str, dict] = {}
    for m in manifests:
        p = m.get("part") or {}
        if (m.get("step"), m.get("world_size"), p.get("of"), p.get("ranks_per_slot")) != (
                first["step"], first["world_size"], part["of"], part["ranks_per_slot"]):
            raise ValueError(f"parts of different checkpoints: step {m.get('step')} of {p.get('of')} machines, "
                             f"step {first['step']} of {part['of']}")
        for shard in m["shards"]:
            if by_file.setdefault(shard["file"], shard) != shard:
                raise ValueError(f"{shard['file']} differs between two parts of step {first['step']}")
        out["tensors"].update(m["tensors"])
        held |= {int(s) for s in p["slots"]}
    out["shards"] = sorted(by_file.values(), key=lambda s: s["file"])
    if held == set(range(int(part["of"]))):
        out.pop("part")
    else:
        out["part"] = {**part, "slots": sorted(held)}
    return out
