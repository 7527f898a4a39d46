"""`llm-pretrain status RUN` and `llm-pretrain logs RUN`: what an operator reads.

status: one table (or --json) from state.json, the checkpoint directory and
the daemon's lock — state, step, loss, tokens/s, ETA, generation, restarts,
last incident and its action, last checkpoint, goodput so far and its largest losses. logs: events.jsonl pretty-
printed, filtered by level, event and rank, optionally followed across
rotations. Reads only; never needs the daemon to answer.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, TextIO

from checkpointing import layout
from daemon.records.state import RunState

LEVELS = ("debug", "info", "warning", "error", "critical")


def _daemon_alive(state: RunState) -> bool:
    if not state.daemon_pid:
        return False
    try:
        os.kill(state.daemon_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unsupervised(state: RunState) -> list[int]:
    """Recorded processes of the run still alive (same pid and start time) although its daemon is not."""
    from daemon.processes.generation import is_running

    return [p["pid"] for p in state.processes if is_running(p)]


def _eta_s(state: RunState, alive: bool) -> float | None:
    """The mean time of the last steps (never a compiling first step) times the steps left."""
    p = state.last_progress or {}
    mean = p.get("mean_step_s")
    if not alive or state.status != "running" or not mean or not state.total_steps or p.get("step") is None:
        return None
    return max(0, state.total_steps - p["step"]) * mean


def _in_force(state: RunState) -> dict[str, Any] | None:
    """What recovery changed for the steps to come: lr cuts, the loss-scale cap, skipped and quarantined data."""
    r = state.recovery
    if r is None:
        return None
    out = {"lr_overrides": [o.to_dict() for o in r.lr_overrides], "skip_ranges": len(r.skip_ranges),
           "quarantined_blocks": len(r.quarantined_blocks)}
    if r.loss_scale_cap is not None:
        out["loss_scale_cap"] = {"scale": r.loss_scale_cap, "until_step": r.loss_scale_cap_until_step}
    return out


ENDED_STATUSES = ("finished", "stopped", "gave_up", "failed")     # the daemon's last word: it exited


def _node_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """One row a machine of a multi-node run: its state, its daemon (or that it was lost, or ended), whether
    it decides, what it waits for."""
    rows = []
    for n in s.get("nodes") or []:
        # a daemon that ended the run holds no lease: it ended, it was not lost
        ended = n["lease"] is False and n["status"] in ENDED_STATUSES
        lease = {None: "", True: f", daemon {n['daemon']}", False: ", daemon LOST (no etcd lease)"}[n["lease"]]
        lease = ", daemon ended" if ended else lease
        decides = ", decides" if n["node"] == s.get("decider") else ""
        waiting = f"; {n['waiting']}" if n.get("waiting") and n["lease"] is not False else ""
        rows.append((f"node {n['node']}", f"{n['status']}, generation {n['generation']}, step "
                                          f"{'-' if n['step'] is None else n['step']}{lease}{decides}{waiting}"))
    return rows


def node_dirs(run_dir: Path) -> list[Path]:
    """A multi-node run's per-node directories (state, lock, control), node 0 first; [] on one machine."""
    nodes = run_dir / "nodes"
    if not nodes.is_dir() or (run_dir / "state.json").exists():
        return []
    found = [p for p in nodes.glob("node-*") if p.name[5:].isdigit() and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def summary(run_dir: Path, now: float | None = None) -> dict[str, Any]:
    """The run as its state says; for a multi-node run, the decider's view (else the first live
    node's, else node 0's) and every node's."""
    dirs = node_dirs(run_dir)
    if not dirs:
        return _summary(run_dir, run_dir, now)
    live, decider = _live_nodes(run_dir)
    by_node = {int(d.name[5:]): d for d in dirs}
    view = decider if decider in by_node else next((n for n in sorted(by_node) if live and n in live), min(by_node))
    out = _summary(by_node[view], run_dir, now, alive=None if live is None else view in live)
    out["decider"] = decider
    out["nodes"] = []
    for n, d in sorted(by_node.items()):
        st = RunState.load(d)
        daemon = None if live is None else live.get(n)
        out["nodes"].append({"node": n, "status": st.status, "generation": st.generation,
                             "step": (st.last_progress or {}).get("step"), "waiting": st.waiting or None,
                             "daemon": daemon, "lease": None if live is None else daemon is not None})
    out["coordinator"] = "unreachable" if live is None else "ok"
    return out


def _live_nodes(run_dir: Path) -> tuple[dict[int, str] | None, int | None]:
    """node → "host pid N" of every node whose daemon holds its etcd lease, and the node that decides
    (from the run's resolved config: its coordinator and key prefix); (None, None) when that cannot
    be read or etcd does not answer."""
    from contracts.config import load_config
    from contracts.errors import ConfigError
    from daemon.machines.etcd_client import Etcd, EtcdError

    try:
        cfg = load_config(run_dir / "config.resolved.toml", [])
        kvs, _ = Etcd.for_run(cfg.run, timeout_s=1.0).get_prefix(cfg.run.key_prefix)
    except (ConfigError, EtcdError, OSError, ValueError):
        return None, None
    out, decider = {}, None
    for kv in kvs:
        name = kv.key.decode()[len(cfg.run.key_prefix):]
        try:
            v = json.loads(kv.value)
            if name == "leader":
                decider = int(v["node"])
            elif name.startswith("nodes/"):
                out[int(v["node"])] = f"{v.get('host', '?')} pid {v.get('pid', '?')}"
        except (ValueError, KeyError, TypeError):
            continue
    return out, decider


def _summary(state_dir: Path, run_dir: Path, now: float | None = None, alive: bool | None = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    state = RunState.load(state_dir)
    alive = _daemon_alive(state) if alive is None else alive
    status = state.status if alive or state.status not in ("running", "restarting", "paused", "pausing") else \
        f"{state.status} (daemon not running)"
    status += f"; {state.waiting}" if alive and state.waiting else ""
    p = state.last_progress or {}
    eta_s = _eta_s(state, alive)
    steps = layout.committed_steps(run_dir / "checkpoints")
    last_ckpt = None
    if steps:
        path = layout.step_dir(run_dir / "checkpoints", steps[-1])
        last_ckpt = {"step": steps[-1], "age_s": round(now - path.stat().st_mtime, 1)}
    acted, warnings = state.acted_on(), state.warnings()
    incident = acted[-1] if acted else None       # a warning is no incident: it never hides the last one
    warning = warnings[-1] if warnings else None
    step = p.get("step")
    if last_ckpt and (step is None or last_ckpt["step"] > step):
        step = last_ckpt["step"]        # a committed checkpoint was trained to: never shown behind it
    # the run's time: to now while its daemon runs, else to the daemon's last word (it does not count on)
    until = now if alive else max(state.updated_unix_s, state.started_unix_s)
    return {"run_dir": str(run_dir), "status": status, "daemon_pid": state.daemon_pid if alive else None,
            "step": step, "total_steps": state.total_steps or None, "loss": p.get("loss"),
            "validation": dict(state.last_validation) or None,
            "tokens_per_s": p.get("tokens_per_s"), "eta_s": eta_s,
            "progress_age_s": round(now - p["unix_s"], 1) if p.get("unix_s") else None,
            "generation": state.generation, "restarts": state.restarts,
            "resumed_from": dict(state.resumed) or None,
            "last_incident": None if incident is None else {
                "kind": incident.kind.value, "first_step": incident.incident.first_step,
                "action": incident.action.to_dict()["type"] if incident.action else None,
                "reason": incident.action.reason if incident.action else incident.incident.detail,
                "drill": "drill" in incident.incident.evidence},
            "incidents": len(acted), "warnings": len(warnings),
            "last_warning": None if warning is None else {
                "kind": warning.kind.value, "first_step": warning.incident.first_step,
                "detail": warning.incident.detail},
            "last_checkpoint": last_ckpt,
            "checkpoint_intervals": {k: v for k, v in state.cadence.items() if k.endswith("interval_steps")} or None,
            "triage": dict(state.triage), "transient_by_rank": dict(state.transient_by_rank),
            "lemons": _lemons(state, now),
            "rerun_pending": None if not state.rerun else {
                k: state.rerun[k] for k in ("kind", "first_step", "last_step", "checkpoint_step")},
            "config_changes": state.config_changes or None,
            "last_request": None if not state.last_control else {
                "name": state.last_control["name"], "age_s": round(now - state.last_control["unix_s"], 1),
                "reason": state.last_control.get("reason")},
            "checkpoints_failing_since_step": state.checkpoints_failing_since,
            "recovery": state.recovery.to_dict() if state.recovery else None,
            "in_force": _in_force(state),
            "elapsed_s": round(until - state.started_unix_s, 1) if state.started_unix_s else None,
            "mean_step_s": p.get("mean_step_s"),
            "script_reports": dict(state.script_reports) or None,
            "goodput": _goodput(state, now),
            "unsupervised_pids": [] if alive else _unsupervised(state)}


def _goodput(state: RunState, now: float) -> dict[str, Any] | None:
    """The goodput ledger as the daemon last saved it (daemon.judging.goodput), its three largest losses and
    how old it is; None before the run has any."""
    from daemon.judging.goodput import Goodput

    if not state.goodput:
        return None
    g = Goodput.from_dict(state.goodput)
    # the ratio the daemon saved and exported, not one re-derived from the rounded seconds (72.8 % beside 72.9 %)
    saved = state.goodput.get("ratio")
    ratio = {"ratio": saved} if isinstance(saved, float) and 0 <= saved <= 1 else {}
    return {**g.to_dict(), **ratio,
            "largest_losses": [{"cause": c, "seconds": round(s, 1)} for c, s in g.largest_losses(3)],
            "restart_s": round(g.restart_s(), 3),
            "age_s": round(now - g.at_unix_s, 1) if g.at_unix_s else None}


def _lemons(state: RunState, now: float) -> dict[str, Any] | None:
    """The devices and machines judged faulty: faults, quarantines, how long one is still left out, why."""
    return {k: {"faults": len(e.get("faults") or ()), "quarantines": e.get("quarantines", 0),
                "quarantined_for_s": max(0.0, round(e["quarantined_until_unix_s"] - now, 1))
                if e.get("quarantined_until_unix_s") else 0.0, "reason": e.get("reason")}
            for k, e in state.lemons.items()} or None


def _duration(seconds: float | None) -> str:
    from cli.console import duration

    return duration(seconds)


def _validation(v: dict[str, Any] | None) -> str:
    if not v or not isinstance(v.get("loss"), (int, float)):
        return "none yet (a validation split or data.validation_path, every train.eval_interval_steps)"
    return f"loss {v['loss']:.4f}, perplexity {v.get('perplexity', float('nan')):.2f} (after step {v.get('step')})"


def _resumed(r: dict[str, Any] | None) -> str:
    """Where the last generation resumed from: the step the ranks restored (a RAM tier's or the disk's), or the
    one the daemon expects them to until they say so."""
    if not r:
        return "-"
    tier = {"ram": " (RAM tier)", "disk": " (disk)", "none": " (from scratch)"}.get(r.get("tier"), "")
    said = "" if r.get("restored") or r.get("tier") == "none" else ", not yet restored"
    return f"step {r['step']}{tier}, generation {r.get('generation')}{said}"


def render(s: dict[str, Any]) -> str:
    step = "-" if s["step"] is None else f"{s['step']}" + (f" / {s['total_steps']}" if s["total_steps"] else "")
    if s["progress_age_s"] is not None:
        step += f"  ({_duration(s['progress_age_s'])} ago)"
    inc = s["last_incident"]
    ckpt = s["last_checkpoint"]
    rows = [("run", s["run_dir"]),
            ("state", s["status"] + (f" (pid {s['daemon_pid']})" if s["daemon_pid"] else "")),
            ("step", step),
            ("loss", "-" if s["loss"] is None else f"{s['loss']:.4f}"),
            ("validation", _validation(s.get("validation"))),
            ("tokens/s", "-" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:,.0f}"),
            ("ETA", "paused" if s["status"] == "paused" else _duration(s["eta_s"])
             + (f"  ({s['mean_step_s']:.3f} s/step, recent mean)" if s["eta_s"] is not None else "")),
            ("elapsed", _duration(s["elapsed_s"])),
            ("generation", str(s["generation"])),
            ("restarts", str(s["restarts"])),
            ("resumed from", _resumed(s.get("resumed_from"))),
            ("last incident", "none" if inc is None else
             f"{inc['kind']}{' (drill)' if inc.get('drill') else ''} at step {inc['first_step']} -> "
             f"{inc['action']}: {inc['reason'] or ''}"),
            ("last checkpoint", "none" if ckpt is None else f"step {ckpt['step']} ({_duration(ckpt['age_s'])} ago)")]
    if s.get("last_warning"):
        w = s["last_warning"]
        rows.insert(rows.index(next(r for r in rows if r[0] == "last incident")) + 1,
                    ("last warning", f"{w['kind']} at step {w['first_step']}" + (f": {w['detail']}" if w["detail"] else "")
                     + (f"  ({s['warnings']} warnings in all)" if s["warnings"] > 1 else "")))
    if s.get("goodput"):
        rows.insert(rows.index(next(r for r in rows if r[0] == "elapsed")) + 1, ("goodput", _goodput_text(s["goodput"])))
    rows += _condition_rows(s)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _goodput_text(g: dict[str, Any]) -> str:
    """e.g. "81.2% of 1h02m (productive 50m31s); largest losses: compile 3m10s, teardown 1m02s, retrained 40s"."""
    if g.get("ratio") is None:
        return "none yet"
    def short(seconds: float) -> str:          # a short run's losses are seconds, not 0m00s
        return f"{seconds:.1f}s" if seconds < 10 else f"{seconds:.0f}s" if seconds < 60 else _duration(seconds)

    text = f"{100 * g['ratio']:.1f}% of {short(g['wall_s'])} (productive {short(g['productive_s'])})"
    losses = ", ".join(f"{x['cause'].replace('_', ' ')} {short(x['seconds'])}" for x in g["largest_losses"])
    return text + (f"; largest losses: {losses}" if losses else "")


def _condition_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The rows shown only when there is something to say: what is off, reruns, quarantines, requests, failures,
    what is in force, the machines."""
    rows = []
    if (said := s.get("script_reports")) and said.get("missing"):
        rows.append(("detectors off", "the script reports no " + ", no ".join(said["missing"])
                     + " (`llm-pretrain logs --event script_reports` says what each turns off)"))
    if s.get("checkpoint_intervals"):
        rows.append(("checkpoint every", ", ".join(f"{v} steps ({'RAM' if k.startswith('memory') else 'disk'}, auto)"
                                                   for k, v in s["checkpoint_intervals"].items())))
    if s.get("triage") or s.get("rerun_pending"):
        verdicts = ", ".join(f"{n} {v}" for v, n in sorted(s.get("triage", {}).items())) or "none yet"
        if s.get("transient_by_rank"):
            verdicts += " (transient faults by rank: " + ", ".join(
                f"{r}: {n}" for r, n in sorted(s["transient_by_rank"].items(), key=lambda x: int(x[0]))) + ")"
        pending = s.get("rerun_pending")
        rows.append(("reruns", verdicts + (f"; rerunning {pending['kind']} steps {pending['first_step']}-"
                                           f"{pending['last_step']} from step {pending['checkpoint_step']}"
                                           if pending else "")))
    for name, lemon in sorted((s.get("lemons") or {}).items()):
        held = lemon["quarantined_for_s"]
        rows.append((name, f"{lemon['faults']} fault(s), quarantined {lemon['quarantines']}x" +
                     (f"; left out for {_duration(held)} more ({lemon['reason']})" if held > 0 else "; in the run")))
    req = s["last_request"]
    if req:
        rows.append(("last request", f"{req['name']} ({_duration(req['age_s'])} ago)" +
                     (f": {req['reason']}" if req["reason"] else "")))
    if s["checkpoints_failing_since_step"] is not None:
        rows.append(("checkpoints", f"FAILING since step {s['checkpoints_failing_since_step']} (see checkpoint_failed "
                                    "events: a full or read-only disk?)"))
    if s["config_changes"]:
        rows.append(("config changes", ", ".join(f"{k}={v}" for k, v in s["config_changes"].items())))
    rows += _in_force_rows(s["in_force"])
    if s["unsupervised_pids"]:
        rows.append(("WARNING", f"the daemon is not running but processes of this run are: pids "
                                f"{', '.join(map(str, s['unsupervised_pids']))} (start the daemon: it reaps them)"))
    rows += _node_rows(s)
    if s.get("coordinator") == "unreachable":
        rows.append(("coordinator", "etcd unreachable (node liveness unknown)"))
    return rows


def _in_force_rows(f: dict[str, Any] | None) -> list[tuple[str, str]]:
    if not f:
        return []
    rows = [("lr override", f"x{o['factor']:g} from step {o['start_step']}, held {o['hold_steps']}, ramped back over "
                            f"{o['ramp_steps']}") for o in f["lr_overrides"]]
    if f.get("loss_scale_cap"):
        rows.append(("loss scale cap", f"{f['loss_scale_cap']['scale']:g} until step {f['loss_scale_cap']['until_step']}"))
    if f["skip_ranges"] or f["quarantined_blocks"]:
        rows.append(("data", f"{f['skip_ranges']} skipped sample window(s), {f['quarantined_blocks']} quarantined "
                             "corpus block(s)"))
    return rows


# logs ---------------------------------------------------------------------
class RankFilter:
    """The events that concern one rank: its own (`rank`), those naming it among others (a triage verdict's
    `suspects`, an incident's `homes`), and, once an event said where it ran, the quarantine of that device
    (`quarantined`: its node and device; `devices_quarantined`: the devices left out)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.homes: set[tuple[int, Any]] = set()        # (node, device) it ran on, as the log said

    def __call__(self, record: dict) -> bool:
        r = self.rank
        homes = record.get("homes") if isinstance(record.get("homes"), dict) else {}
        evidence = record.get("evidence") if isinstance(record.get("evidence"), dict) else {}
        homes = {**(evidence.get("homes") or {}), **homes}
        if isinstance(homes.get(str(r)), (list, tuple)) and len(homes[str(r)]) == 2:
            self.homes.add(tuple(homes[str(r)]))
        if record.get("rank") == r or str(r) in homes:
            return True
        if r in (record.get("suspects") or ()) or r in (evidence.get("suspects") or ()):
            return True
        if record.get("event") == "quarantined":
            return (record.get("node"), record.get("device")) in self.homes
        if record.get("event") == "devices_quarantined":
            return any(device in (record.get("left_out") or ()) for _, device in self.homes)
        return False


def _matches(record: dict, *, level: str | None, events: list[str], rank: RankFilter | None) -> bool:
    concerns = rank is None or rank(record)        # called on every record: it learns where the rank ran
    if level and LEVELS.index(record.get("level", "info")) < LEVELS.index(level):
        return False
    if events and record.get("event") not in events:
        return False
    return concerns


def pretty(record: dict) -> str:
    """One line: floats rounded, long values (evidence) folded; `--json` gives the record whole."""
    from cli.console import human

    return human(record, full_time=True)


def _lines(path: Path, follow: bool, poll_s: float = 0.25) -> Iterator[str]:
    """Lines of events.jsonl (rotated files first, oldest first), then — following — new ones, across
    rotations (a new inode or a smaller file means the file was rotated)."""
    for i in range(1000, 0, -1):
        rotated = path.with_name(f"{path.name}.{i}")
        if rotated.exists() and not follow:
            yield from rotated.read_text().splitlines()
    f = open(path)
    inode = os.fstat(f.fileno()).st_ino
    partial = ""
    while True:
        chunk = f.read()
        if chunk:
            *complete, partial = (partial + chunk).split("\n")
            yield from complete
            continue
        if not follow:
            if partial:
                yield partial
            return
        time.sleep(poll_s)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        if st.st_ino != inode or st.st_size < f.tell():
            f.close()
            f = open(path)
            inode = os.fstat(f.fileno()).st_ino


def logs(log_path: Path, *, follow: bool, level: str | None, events: list[str], rank: int | None,
         as_json: bool, out: TextIO | None = None) -> None:
    out = out or sys.stdout           # looked up now: bound at import it would outlive a replaced stdout
    concerns = None if rank is None else RankFilter(rank)
    for line in _lines(log_path, follow):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if _matches(record, level=level, events=events, rank=concerns):
            print(line if as_json else pretty(record), file=out, flush=True)
