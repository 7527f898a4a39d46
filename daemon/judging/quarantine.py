"""Quarantine: devices and machines judged faulty, left out of the generations for a while (the lemon list).

Owns: which devices a machine's ranks run on (`run.devices`, else the visible-devices variable, else
0..ranks-1), where each rank of a generation runs (`homes`: rank -> [node, device]), the lemon list's
entries and what they exclude now, and the shape of a machine's generation without its excluded
devices. The faults come from the triage (a device verdict, transient faults counted against a rank),
the replicas' fingerprints and the straggler score; the state (daemon.records.state, `lemons`) keeps them, so a
restarted daemon keeps them too. One machine leaves out a device (its ranks run on the rest, the same
global batch, more accumulation); several leave out the machine (the elastic shrink). Past
`health.quarantine_probation_s` an entry stops excluding: the device or machine is back on probation,
its faults still on record (the next one quarantines it again). Pure: no clocks or files.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from contracts.config import Config, device_ids, with_changes
from contracts.elastic import shape_on

VISIBLE = "ASCEND_RT_VISIBLE_DEVICES"


def machine_devices(cfg: Config, env: Mapping[str, str]) -> tuple[int, ...]:
    """The devices of this machine's ranks, in rank order: run.devices; else the first of the
    visible-devices variable's; else 0..ranks-1."""
    per_node = cfg.parallel.world_size // cfg.run.nodes
    if cfg.run.devices:
        return device_ids(cfg.run.devices)
    visible = env.get(VISIBLE, "")
    try:
        ids = tuple(int(x) for x in visible.split(",")) if visible else ()
    except ValueError:
        ids = ()
    return ids[:per_node] if len(ids) >= per_node else tuple(range(per_node))


def as_device(device: int | None) -> int | None:
    """A device id, or None for the whole machine (homes name another machine's ranks' device -1)."""
    return None if device is None or device < 0 else int(device)


def key(node: int, device: int | None) -> str:
    device = as_device(device)
    return f"node {node}" if device is None else f"node {node} device {device}"


def homes(cfg: Config, devices: Sequence[int], members: Sequence[int] = ()) -> dict[str, list[int]]:
    """Where each rank of a generation runs: {rank: [node, device]}. One machine (no `members`): node 0
    and its device; several: the member machine, device -1 (a machine is quarantined whole)."""
    per_node = cfg.parallel.world_size // cfg.run.nodes
    out = {}
    for rank in range(cfg.parallel.world_size):
        slot, local = divmod(rank, per_node)
        if members:
            out[str(rank)] = [int(members[slot]) if slot < len(members) else slot, -1]
        else:
            out[str(rank)] = [0, int(devices[local]) if local < len(devices) else local]
    return out


def entry_excludes(entry: Mapping[str, Any], now_unix_s: float) -> bool:
    until = entry.get("quarantined_until_unix_s")
    return until is not None and now_unix_s < float(until)


def excluded_devices(lemons: Mapping[str, Mapping[str, Any]], node: int, now_unix_s: float) -> set[int]:
    return {int(e["device"]) for e in lemons.values()
            if e.get("device") is not None and int(e["node"]) == node and entry_excludes(e, now_unix_s)}


def excluded_nodes(lemons: Mapping[str, Mapping[str, Any]], now_unix_s: float) -> set[int]:
    return {int(e["node"]) for e in lemons.values() if e.get("device") is None and entry_excludes(e, now_unix_s)}


def recent_faults(entry: Mapping[str, Any], kind: str, now_unix_s: float, window_s: float) -> int:
    return sum(1 for f in entry.get("faults", ()) if f.get("kind") == kind and now_unix_s - f["unix_s"] <= window_s)


def without_devices(base: Config, changes: Mapping[str, Any], devices: Sequence[int],
                    left_out: set[int]) -> tuple[Config, tuple[int, ...]] | str:
    """One machine's generation on `devices` less `left_out`: its config (data parallel over what is
    left, the same global batch: contracts.elastic) and the devices; a reason when none can be made."""
    left = tuple(d for d in devices if d not in left_out)
    cfg = with_changes(base, changes)
    if len(left) == len(devices):
        return cfg, left
    p, t = cfg.parallel, cfg.train
    shape = None
    for n in range(len(left), 0, -1):        # the most of them that keep the global batch (the rest wait idle)
        shape = shape_on(1, ranks_per_node=n, model_parallel=p.tp * p.pp, global_batch=t.global_batch,
                         micro_batch=t.micro_batch)
        if shape is not None:
            left = left[:n]
            break
    if shape is None:
        return (f"devices {sorted(left_out)} are quarantined and the {len(left)} left ({list(left)}) cannot train "
                f"this run (tp x pp = {p.tp * p.pp}, train.global_batch = {t.global_batch}); replace them, or "
                "take them back by removing their entries from the lemon list (state.json `lemons`)")
    return with_changes(base, {**changes, "parallel.dp": shape.dp, "train.micro_batch": shape.micro_batch,
                               "train.grad_accum_steps": shape.grad_accum_steps,
                               "run.devices": ",".join(map(str, left))}), left
