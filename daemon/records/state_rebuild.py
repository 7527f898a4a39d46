"""Rebuilding a corrupt state.json from the daemon's event log.

Owns the fold from the log's events to a RunState — pure, tested with literal
events — and the reading of `events.jsonl` with its rotated backups, oldest
first. What the log gives back: the incident history (each `incident` and
`health_warning` event carries an IncidentRecord's fields), the generation
count (the highest `generation` seen), the restarts, the config changes and
the recovery directive and the lemon list's quarantines (recomputed from the incidents' actions by
RunState.apply_incident, the method the live daemon records them with; the transient faults from the
`triage` and `quarantined` events), a
rollback decided but not carried out, where the last generation resumed from, the last control request,
the last progress and the goodput ledger (the last `goodput` event's, whole) — each through the RunState method
the live daemon calls for it.
What it does not hold stays empty: the processes of the last generation (a
dead daemon's leftover ranks are then not killed by pid), the tokens per
step (no ETA until the next progress) and a checkpoint failure in progress
(said again at the next failed save). Reads files, writes none, starts
nothing: setting the bad file aside and saving the result is the Ledger's.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

from contracts import strict_json
from daemon.judging import script_reports
from daemon.judging.goodput import Goodput
from daemon.judging.incidents import IncidentRecord
from daemon.judging.triage import VERDICTS
from daemon.records.eventlog import ts_unix_s
from daemon.records.state import RunState

COUNTS = ("events", "incidents", "warnings", "rollbacks", "restarts", "unreadable")


def state_from_events(events: Iterable[Mapping[str, Any]]) -> tuple[RunState, dict[str, int]]:
    """The state the daemon had saved after these events (in the log's order), and how much of it was
    found: events read, incidents, warnings, rollbacks, restarts, incident events that did not parse."""
    state, counts = RunState(), dict.fromkeys(COUNTS, 0)
    restarts_total = 0          # the running total the last `restart` event says (older files may be gone)
    without_progress = 0        # the restarts without progress the last `restart` event says
    decided_in = 0              # the generation whose incident decided the pending rollback
    for e in events:
        counts["events"] += 1
        generation = _int(e.get("generation"), 0)
        if generation > state.generation:
            state.next_generation(generation)
        if generation > decided_in and state.pending_rollback is not None:
            state.rollback_done()           # a later generation ran: the rollback was done (its event lost)
        name = e.get("event")
        if name in ("incident", "health_warning"):
            try:
                record = IncidentRecord.from_dict({**e, "evidence": strict_json.decode(e.get("evidence") or {}),
                                                   "unix_s": _unix_s(e.get("ts"))})
            except (KeyError, TypeError, ValueError):
                counts["unreadable"] += 1
                continue
            state.apply_incident(record)
            counts["incidents" if name == "incident" else "warnings"] += 1
            if record.is_rollback:
                counts["rollbacks"] += 1
                decided_in = record.generation
        elif name == "triage" and e.get("verdict") in VERDICTS:     # a rerun's verdict: the rerun is settled
            state.triaged(e["verdict"], _int(e.get("first_step"), 0),
                          [r for r in e.get("suspects") or () if isinstance(r, int)])
            if e["verdict"] == "transient":        # counted on the lemon list against where its suspects ran
                for node, device in {tuple(v) for v in (e.get("homes") or {}).values() if len(v) == 2}:
                    state.note_fault(node, device, kind="transient", step=_int(e.get("first_step"), 0),
                                     unix_s=_unix_s(e.get("ts")))
        elif name == "quarantined" and isinstance(e.get("node"), int):   # transient faults past the threshold
            at = _unix_s(e.get("ts"))
            state.quarantine(e["node"], e.get("device"), kind="transient", step=0, unix_s=at,
                             for_s=float(e.get("until_unix_s") or at) - at, reason=str(e.get("detail") or ""),
                             counted=True)
        elif name == "rollback":            # the renames of the recorded rollback were done
            state.rollback_done()
        elif name == "restart":
            counts["restarts"] += 1
            restarts_total = _int(e.get("restarts"), restarts_total)
            without_progress = _int(e.get("restarts_without_progress"), 0)
        else:
            _note(state, name, e, generation)
    state.restore_restarts(restarts=max(counts["restarts"], restarts_total), without_progress=without_progress)
    return state, counts


def _note(state: RunState, name: Any, e: Mapping[str, Any], generation: int) -> None:
    """The events that set one field of the state each: where a generation resumed from, the last control
    request, progress, what a script reports, the last validation, the goodput ledger (whole)."""
    if name == "generation_start" and isinstance(e.get("resume_step"), int):   # where it resumes from ...
        state.note_resumed(step=e["resume_step"], tier=str(e.get("resume_tier") or ""), generation=generation,
                           restored=False)
    elif name == "checkpoint_restored" and isinstance(e.get("step"), int):      # ... as its ranks restored it
        state.note_resumed(step=e["step"], tier=str(e.get("tier") or ""), generation=generation, restored=True)
    elif name == "control":
        body = e.get("body") if isinstance(e.get("body"), dict) else {}
        state.take_control(name=e.get("name"), file=e.get("file"), unix_s=_unix_s(e.get("ts")),
                           reason=body.get("reason"))
    elif name == "progress":
        state.note_progress(strict_json.decode({**{k: e.get(k) for k in ("step", "loss", "lr", "tokens_per_s")},
                                               "unix_s": _unix_s(e.get("ts"))}))
    elif name == "script_reports" and isinstance(e.get("reports"), list):
        state.note_script_reports(script_reports.describe([r for r in e["reports"] if isinstance(r, str)]))
    elif name == "validation":
        state.note_validation(strict_json.decode({**{k: e.get(k) for k in ("step", "loss", "perplexity")},
                                                 "unix_s": _unix_s(e.get("ts"))}))
    elif name == "goodput":
        state.note_goodput(Goodput.from_dict(e).to_dict())


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _unix_s(ts: Any) -> float:
    """An event's `ts` in unix seconds; 0.0 if unreadable."""
    return ts_unix_s(ts) or 0.0


def read_events(log_path: Path) -> list[dict[str, Any]]:
    """Every event of `events.jsonl` and its rotated backups (`.N` … `.1`, then the file: oldest first).
    A line that is not a JSON object (a write torn by a crash) is passed over."""
    rotated = sorted((p for p in log_path.parent.glob(f"{log_path.name}.*") if p.suffix[1:].isdigit()),
                     key=lambda p: int(p.suffix[1:]), reverse=True)
    events = []
    for path in [*rotated, log_path]:
        if not path.is_file():
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    events.append(event)
    return events
