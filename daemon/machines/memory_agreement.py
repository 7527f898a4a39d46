"""Which RAM-tier step a multi-node run resumes from, and which machines take it from a peer first.

Each machine keeps its own ranks' RAM checkpoints (checkpoint.memory_interval_steps; each a whole checkpoint,
since every data-parallel machine holds a replica) and, once its ranks are gone, says which it holds in etcd
(`held/<node>`, daemon.machines.etcd_keys). The decider resumes the next generation from the newest step newer
than the disk's that every member holds. Where none is held by all — a machine rebooted (its tmpfs empty),
replaced, or back after the run went on without it — but some hold one, the others take the newest of those from
a peer that holds it (daemon.machines.ram_peers) before the generation opens, so nobody rolls back for a machine
coming back.

Only the steps of a machine that ran the last generation are its run's history. A machine that did not may hold
steps of the same numbers from another (trained before a rollback, or before the run went on without it): they
count for nothing, but for those it took from a peer since (`taken`). With checkpoint.memory_placement = "buddy"
each machine holds its own part of every step and a copy of a buddy's (checkpointing.parts): a step counts as
held where the parts the members hold make it whole, and each member takes the parts it lacks before the
generation opens. Pure: no etcd, no files.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Collection, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Agreement:
    heard: bool                      # every member has said what it holds since its ranks last ran
    steps: tuple[int, ...]           # the RAM steps every member holds (of those heard, when not all were)
    unheard: tuple[int, ...] = ()    # members not heard from (yet)
    fetching: tuple[int, ...] = ()   # of those, members taking a step from a peer
    take: int | None = None          # none newer than the disk's held by all: the newest some hold, for the rest
    sources: tuple[str, ...] = ()    # where it is served (the addresses of the members holding it)
    lacking: tuple[int, ...] = ()    # the members that should take it

    @property
    def newest(self) -> int:
        return max(self.steps, default=0)


def record(after: int, steps: Sequence[int], *, url: str = "", taken: Sequence[int] = (),
           fetching: int | None = None, failed: int | None = None,
           parts: Mapping[int, tuple[Collection[int], int]] | None = None) -> dict[str, Any]:
    """A machine's `held/<node>` value: the RAM steps it holds once the ranks of generation `after` are gone, where
    its daemon serves them (`url`), those of them it took from a peer (`taken`), and the step it is taking now
    (`fetching`: not heard until it says what it holds after) or failed to take (`failed`: not asked again).
    `parts`: the steps it holds in part (checkpoint.memory_placement = "buddy"), {step: (slots, of how many)}."""
    value: dict[str, Any] = {"after": int(after), "steps": sorted(int(s) for s in steps), "url": url,
                             "taken": sorted(int(s) for s in taken)}
    if parts:
        value["parts"] = {str(int(s)): {"slots": sorted(int(x) for x in held), "of": int(of)}
                          for s, (held, of) in parts.items()}
    if fetching is not None:
        value["fetching"] = int(fetching)
    if failed is not None:
        value["failed"] = int(failed)
    return value


def _usable(value: Any) -> bool:
    return isinstance(value, Mapping) and isinstance(value.get("steps"), list)


def _parts(value: Mapping[str, Any]) -> dict[int, tuple[frozenset[int], int]]:
    try:
        return {int(s): (frozenset(int(x) for x in p["slots"]), int(p["of"]))
                for s, p in (value.get("parts") or {}).items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        return {}


def _whole_from_parts(parts_by_node: Mapping[int, Mapping[int, tuple[frozenset[int], int]]]) -> set[int]:
    """The steps whose parts the members hold together make whole (each machine's part somewhere)."""
    slots: dict[tuple[int, int], set[int]] = {}
    for held in parts_by_node.values():
        for step, (got, of) in held.items():
            slots.setdefault((step, of), set()).update(got)
    return {step for (step, of), got in slots.items() if got >= set(range(of))}


def agree(members: Collection[int], held: Mapping[int, Any], *, last_generation: int,
          last_members: Collection[int], own: int, own_steps: Sequence[int], disk_step: int = 0,
          own_parts: Mapping[int, tuple[Collection[int], int]] | None = None) -> Agreement:
    """What `members` resume from. `held`: each machine's record (`record`); `own`, `own_steps`: the decider and
    what its own RAM tier holds now (read from its tmpfs; its record's `taken` and `url` still count). A member
    that was in `last_generation` (`last_members`) is heard once its record is of that generation or later: until
    then its ranks may still be committing, or its record may name steps a rollback has retired since. Until every
    member is heard the steps are those of the members heard (the caller waits, then decides with `unheard`
    counted as holding nothing: the disk's step). With checkpoint.memory_placement = "buddy" a machine holds its
    own part of each step and a copy of a buddy's (`own_parts`, a record's `parts`): a step the members' parts make
    whole is taken by each (daemon.machines.ram_parts.take: the parts it lacks, from those that hold them)."""
    trusted: dict[int, set[int]] = {}
    in_parts: dict[int, dict[int, tuple[frozenset[int], int]]] = {}
    urls: dict[int, str] = {}
    unheard, fetching, failed = [], [], set()
    for node in sorted(members):
        value = held.get(node)
        if node == own:
            value = {**(value if _usable(value) else {}), "after": last_generation, "steps": list(own_steps)}
            value.pop("fetching", None)
            value["parts"] = record(0, (), parts=own_parts).get("parts", {})
        fresh = _usable(value) and (node not in last_members or int(value.get("after", -1)) >= last_generation)
        if not fresh or "fetching" in value:
            unheard.append(node)
            if fresh:
                fetching.append(node)
            continue
        steps = {int(s) for s in value["steps"]}
        trusted[node] = steps if node in last_members else steps & {int(s) for s in value.get("taken") or ()}
        in_parts[node] = _parts(value) if node in last_members else {}
        urls[node] = str(value.get("url") or "")
        if value.get("failed") is not None:
            failed.add(int(value["failed"]))
    common = set.intersection(*trusted.values()) if trusted else set()
    if unheard:
        return Agreement(heard=False, steps=tuple(sorted(common)), unheard=tuple(unheard), fetching=tuple(fetching))
    done = Agreement(heard=True, steps=tuple(sorted(common)))
    anywhere = {s for steps in trusted.values() for s in steps} | _whole_from_parts(in_parts)
    if any(in_parts.values()):
        # buddy placement: the parts members write are newer than what they hold whole (a buddy's copy, a step
        # taken), and every recovery takes anyway: the newest step whole anywhere, or made whole by the parts
        newest = max((s for s in anywhere - failed if s > disk_step), default=None)
        if newest is None or newest in common:
            return done
    else:
        # replica: the newest step all hold, where one is newer than the disk's (a take costs a whole replica's
        # transfer: more than the step it would save)
        if any(s > disk_step for s in common):
            return done
        newest = max((s for s in anywhere if s > disk_step), default=None)
        if newest is None or newest in failed:
            return done
    holders = [n for n in trusted if newest in trusted[n]] + [n for n in trusted if newest in in_parts[n]]
    sources = tuple(urls[n] for n in holders if urls[n])
    if not sources:
        return done
    return dataclasses.replace(done, take=newest, sources=sources,
                               lacking=tuple(n for n in trusted if newest not in trusted[n]))
