"""What went wrong and what was decided about it: incidents, actions, and their record in state.json.

Owns the types every part of the daemon passes around — the detectors and
the watch make `Incident`s, the policy turns one into an `Action`, the
supervisor keeps an `IncidentRecord` of both — and their one JSON form (the
`incidents` list of state.json, the `incident` event). Adding a detector is
adding a `Kind` here and a branch in daemon.judging.policy.decide. Pure: no files,
no clocks.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping

from contracts.protocol import LrOverride


class Kind(str, enum.Enum):
    CRASH = "crash"                        # a rank exited non-zero or was killed
    HANG = "hang"                          # a rank made no progress within its phase's timeout
    OOM = "oom"                            # a rank ran out of memory (cgroup OOM kill, device allocator)
    LOSS_SPIKE = "loss_spike"
    LOSS_COLLAPSE = "loss_collapse"        # the loss far below its recent band (a shard of zeros, a broken label)
    GRAD_NORM_SPIKE = "grad_norm_spike"
    GRAD_NORM_BURST = "grad_norm_burst"    # one step's grad norm far beyond its window (a warning)
    NON_FINITE = "non_finite"              # fp32/bf16: a skipped (non-finite) step
    OVERFLOW_STORM = "overflow_storm"      # fp16: skipped steps in a row, or at the scale floor
    THROUGHPUT_REGRESSION = "throughput_regression"   # warnings only
    LOSS_STALLED = "loss_stalled"
    CHECKPOINT_FAILING = "checkpoint_failing"         # saves fail (a full or read-only disk): training goes on
    DISK_SPACE_LOW = "disk_space_low"      # room for fewer than two more checkpoints (a warning, before saves fail)
    STRAGGLER = "straggler"                # a rank the others wait for (a warning; acted on when configured)
    DATA_CORRUPT = "data_corrupt"          # corpus blocks fail their checksums, found before training on them
    NODE_LOST = "node_lost"                # multi-node: a node's daemon went silent (its lease expired) or restarted
    REPLICA_MISMATCH = "replica_mismatch"  # data-parallel replicas' weights differ: silent corruption
    RANK_OUTLIER = "rank_outlier"          # one data-parallel rank's own gradient norm far above the others'

    @property
    def is_process_fault(self) -> bool:
        """A fault of the processes, not of the numbers: restart from the latest checkpoint."""
        return self in (Kind.CRASH, Kind.HANG, Kind.OOM, Kind.STRAGGLER, Kind.NODE_LOST)

    @property
    def taints_checkpoints(self) -> bool:
        """Checkpoints inside or just before it are not healthy: the model trained on what went wrong.
        Corrupt data is found before any rank trains on it."""
        return not self.is_process_fault and self is not Kind.DATA_CORRUPT


@dataclasses.dataclass(frozen=True, kw_only=True)
class Incident:
    kind: Kind
    first_step: int                        # the steps it spans (a process fault: the step it happened at)
    last_step: int
    needs_action: bool = True              # False: a warning, reported and recorded, never acted on
    rank: int | None = None                # process faults: the rank
    exit_code: int | None = None           # crash, oom: the rank's exit status (negative: killed by signal)
    detail: str = ""                       # one line for people
    storm_start_scale: float | None = None  # overflow storm: the scale the storm began at (the policy cuts it)
    evidence: Mapping[str, Any] = dataclasses.field(default_factory=dict)   # reported (corrupt data: the blocks)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value, "first_step": self.first_step, "last_step": self.last_step,
                               "action_needed": self.needs_action, "evidence": dict(self.evidence)}
        if self.kind.is_process_fault:
            out.update(step=self.first_step, rank=self.rank, exit_code=self.exit_code)
        elif self.rank is not None:
            out["rank"] = self.rank              # `logs --rank R` finds it
        if self.detail:
            out["detail"] = self.detail
        if self.storm_start_scale is not None:
            out["evidence"]["storm_start_scale"] = self.storm_start_scale
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Incident":
        evidence = dict(d.get("evidence") or {})
        first = int(d.get("first_step", d.get("step", 0)) or 0)
        return cls(kind=Kind(d["kind"]), first_step=first, last_step=int(d.get("last_step", first) or first),
                   needs_action=bool(d.get("action_needed", True)), rank=d.get("rank"),
                   exit_code=d.get("exit_code"), detail=d.get("detail", ""),
                   storm_start_scale=evidence.get("storm_start_scale"), evidence=evidence)


# Actions: what the policy decides --------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Restart:
    reason: str
    config_changes: Mapping[str, Any] = dataclasses.field(default_factory=dict)   # "section.key" -> value

    def to_dict(self) -> dict[str, Any]:
        return {"type": "restart", "reason": self.reason, "config_changes": dict(self.config_changes)}


@dataclasses.dataclass(frozen=True)
class Rollback:
    reason: str
    checkpoint_step: int                      # resume from this committed step (0: from scratch)
    skip: tuple[int, int] | None              # global sample range [a, b) never to train on again
    lr_overrides: tuple[LrOverride, ...]      # the complete list in force after the rollback
    loss_scale: float | None = None           # fp16: restart at this scale ...
    loss_scale_cap_until_step: int | None = None   # ... and grow no higher until this step
    quarantine: tuple[tuple[str, int], ...] = ()   # corpus (shard file, block) pairs never to read again
    exclude: tuple[int, ...] = ()             # ranks whose device (several machines: machine) is judged faulty:
    exclude_for_s: float = 0.0                # ... left out of the generations this long (daemon.judging.quarantine)

    def to_dict(self) -> dict[str, Any]:
        out = {"type": "rollback", "reason": self.reason, "checkpoint_step": self.checkpoint_step,
               "skip": list(self.skip) if self.skip else None,
               "lr_overrides": [o.to_dict() for o in self.lr_overrides], "loss_scale": self.loss_scale,
               "loss_scale_cap_until_step": self.loss_scale_cap_until_step}
        if self.quarantine:
            out["quarantine"] = [list(b) for b in self.quarantine]
        if self.exclude:
            out.update(exclude=list(self.exclude), exclude_for_s=self.exclude_for_s)
        return out


@dataclasses.dataclass(frozen=True)
class Rerun:
    """Before acting on a numerical incident: re-run its steps from the checkpoint before them, nothing
    else changed; the watch of that generation compares them with the first run's (the triage)."""
    reason: str
    checkpoint_step: int                      # resume from this committed step (0: from scratch)
    first_step: int                           # the incident's steps, compared
    last_step: int
    rotate: int = 0                           # > 0: the second rerun, each rank on another's share (data or device?)

    def to_dict(self) -> dict[str, Any]:
        out = {"type": "rerun", "reason": self.reason, "checkpoint_step": self.checkpoint_step,
               "first_step": self.first_step, "last_step": self.last_step}
        return {**out, "rotate": self.rotate} if self.rotate else out


@dataclasses.dataclass(frozen=True)
class Halt:
    reason: str
    code: int

    def to_dict(self) -> dict[str, Any]:
        return {"type": "halt", "reason": self.reason, "code": int(self.code)}


Action = Restart | Rollback | Rerun | Halt


def action_from_dict(d: Mapping[str, Any] | None) -> Action | None:
    if not d:
        return None
    if d["type"] == "restart":
        return Restart(d["reason"], dict(d.get("config_changes") or {}))
    if d["type"] == "rollback":
        return Rollback(d["reason"], checkpoint_step=int(d["checkpoint_step"]),
                        skip=tuple(d["skip"]) if d.get("skip") else None,
                        lr_overrides=tuple(LrOverride.from_dict(o) for o in d.get("lr_overrides") or ()),
                        loss_scale=d.get("loss_scale"), loss_scale_cap_until_step=d.get("loss_scale_cap_until_step"),
                        quarantine=tuple((str(f), int(b)) for f, b in d.get("quarantine") or ()),
                        exclude=tuple(int(r) for r in d.get("exclude") or ()),
                        exclude_for_s=float(d.get("exclude_for_s") or 0.0))
    if d["type"] == "rerun":
        return Rerun(d["reason"], checkpoint_step=int(d["checkpoint_step"]), first_step=int(d["first_step"]),
                     last_step=int(d["last_step"]), rotate=int(d.get("rotate") or 0))
    return Halt(d["reason"], int(d["code"]))


@dataclasses.dataclass(frozen=True, kw_only=True)
class IncidentRecord:
    """One entry of state.json's `incidents`: the incident, when, and what was done (None: a warning)."""

    incident: Incident
    generation: int
    unix_s: float
    committed_step: int | None = None         # the newest committed checkpoint when it was decided
    action: Action | None = None

    @property
    def kind(self) -> Kind:
        return self.incident.kind

    @property
    def is_rollback(self) -> bool:
        return isinstance(self.action, Rollback)

    def to_dict(self) -> dict[str, Any]:
        out = {**self.incident.to_dict(), "generation": self.generation, "unix_s": self.unix_s,
               "action": self.action.to_dict() if self.action else None}
        if self.committed_step is not None:
            out["committed_step"] = self.committed_step
        return out

    def log_fields(self) -> dict[str, Any]:
        """The fields of its `incident` / `health_warning` event (`kind` names the incident)."""
        return {k: v for k, v in self.to_dict().items() if k != "unix_s"}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "IncidentRecord":
        return cls(incident=Incident.from_dict(d), generation=int(d.get("generation", 0)),
                   unix_s=float(d.get("unix_s", 0.0)), committed_step=d.get("committed_step"),
                   action=action_from_dict(d.get("action")))
