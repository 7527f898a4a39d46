"""The one definition of what passes between worker and supervisor: exit codes and events.

Stdlib only, and imports nothing else of the project: the worker, the supervisor
and the fake worker of the integration tests all import it.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import sys
import time
from typing import Any

from contracts import strict_json


class ExitCode(enum.IntEnum):
    """Every exit status the project's processes use; systemd's unit lists the final ones."""

    OK = 0                  # finished, or stopped on request
    SOAK_FAILED = 1         # chaos: a fault was not recovered from, the run did not finish, or not bit-exact
    USAGE = 2               # command-line usage error (argparse's own code)
    GAVE_UP_CRASH_LOOP = 3  # restarts made no progress
    GAVE_UP_NUMERICS = 4    # numerical incidents beyond the policy's limits
    LOCKED = 5              # another daemon holds this run's lock
    DATA_ERROR = 65         # bad data (EX_DATAERR)
    NO_DAEMON = 69          # a request for a run no daemon is running (EX_UNAVAILABLE)
    INTERNAL_ERROR = 70     # internal error (EX_SOFTWARE): the one code systemd restarts on
    CANT_CREATE = 73        # an output file or directory cannot be created (EX_CANTCREAT)
    TEMP_FAIL = 75          # multi-node: etcd unreachable (at the start, or past run.coordinator_timeout_s) (EX_TEMPFAIL)
    CONFIG_ERROR = 78       # bad configuration (EX_CONFIG)


# Codes after which restarting cannot help: the unit's RestartPreventExitStatus=.
# Codes only the CLI's other commands use: never the daemon's.
CLI_ONLY_EXIT_CODES = (ExitCode.SOAK_FAILED, ExitCode.NO_DAEMON, ExitCode.CANT_CREATE)
# 70 and 75 are worth a restart (systemd's Restart=on-failure): a bug's one-off, an etcd that comes back.
FINAL_EXIT_CODES = tuple(c for c in ExitCode if c not in (ExitCode.INTERNAL_ERROR, ExitCode.TEMP_FAIL)
                         and c not in CLI_ONLY_EXIT_CODES)

# A rank that exits with one of these refused to run (usage, data, config): restarting cannot help, and
# its last `llm-pretrain: …` line says why.
FINAL_WORKER_CODES = frozenset({ExitCode.USAGE, ExitCode.DATA_ERROR, ExitCode.CONFIG_ERROR})

# Events a worker must not lose (all but the per-step ones) wait this long for room on a full socket.
DELIVER_WAIT_S = 5.0
DATAGRAM_RETRY_S = 0.005


class _Event:
    """JSON encoding shared by every event record (non-finite floats travel as 'nan'/'inf': contracts.strict_json;
    read back into the fields declared as floats)."""

    def to_json(self) -> str:
        return json.dumps(strict_json.encode(dataclasses.asdict(self)), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        numeric = {f.name for f in dataclasses.fields(cls) if "float" in str(f.type)}
        return cls(**{k: strict_json.decode(v) if k in numeric else v for k, v in data.items()})


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepEvent(_Event):
    """One optimizer step, as every rank saw it (loss and grad norm are global)."""

    rank: int
    generation: int
    step: int                 # 1-based: the number of optimizer steps completed
    loss: float               # mean over the global batch, unscaled
    grad_norm: float          # global L2 norm of the unscaled, unclipped gradients
    loss_scale: float         # the scale this step ran with (1.0 outside fp16)
    lr: float                 # the learning rate applied at this step
    lr_multiplier: float      # product of the lr overrides in force (1.0 when none)
    skipped: bool             # the update was not applied (non-finite gradients)
    sample_start: int         # global sample-index range [sample_start, sample_end)
    sample_end: int
    tokens: int               # tokens this step consumed, all ranks together
    step_s: float             # wall time of the step
    data_wait_s: float        # of which waiting for the input pipeline
    tokens_per_s: float       # tokens / step_s
    # this rank's own time split (the straggler detector compares the ranks):
    host_s: float = 0.0       # from the previous step's end to this step's compiled work: data, drills, saves
    sync_s: float = 0.0       # in the compiled graph holding the step's collectives: the rank the others
                              # wait for spends the least time there
    # the goodput ledger's split of host_s: the loop's own work between the steps (events, commands, the
    # feed's hand-off: part of training's pace) and the RAM tier's saves (a checkpoint's cost); a disk save's
    # staging, a validation and a pause are said by their own events and in neither
    loop_s: float = 0.0
    memory_save_s: float = 0.0
    # data parallel (up to 64 ranks): every rank's own loss and own gradient norm before the sum, by rank —
    # which rank a non-finite or outlying gradient came from (daemon.judging.triage)
    rank_losses: list[float] | None = None
    rank_grad_norms: list[float] | None = None
    kind: str = "step"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FingerprintEvent(_Event):
    """After step `step` (every health.fingerprint_interval_steps): this replica's parameters reduced to a
    few integers (engine.rank.fingerprint), to be compared with the other replicas' — equal when healthy."""

    rank: int
    generation: int
    step: int
    groups: list[int]         # one value per contiguous group of parameters
    names: list[str]          # the first parameter of each group
    seconds: float = 0.0      # what computing it took
    kind: str = "fingerprint"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExitEvent(_Event):
    """A worker's last word: why it ends, at which step, and a digest of its parameters."""

    rank: int
    generation: int
    step: int
    reason: str               # "finished", "stopped", …
    params_sha256: str = ""   # over every parameter's name and bytes: equal digests, equal weights
    kind: str = "exit"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointEvent(_Event):
    """A checkpoint's progress: staged (host copy done; the step resumes), written (this rank's shard
    is durable), committed (the checkpoint exists), restored, waited (a save had to wait for the
    previous one), exists, retired (old ones deleted), corrupt (failed verification: set aside as
    step-N.corrupt), failed."""

    rank: int
    generation: int
    step: int
    stage: str
    seconds: float = 0.0
    detail: str = ""          # error text, why a checkpoint is corrupt, deleted steps
    kind: str = "checkpoint"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhaseEvent(_Event):
    """A worker entering a phase; the supervisor's hang timeouts depend on it."""

    rank: int
    generation: int
    phase: str                # one of PHASES
    step: int = 0
    startup_s: dict | None = None   # on "compile": seconds per start-up stage (engine/rank/startup.py)
    reports: list[str] | None = None   # a script's rank (llm_pretrain_client), in its first event: what it reports
                                       # of REPORTS; None: everything (this project's engine)
    kind: str = "phase"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalEvent(_Event):
    """The validation loss after a step: the mean next-token loss over the same held-out sequences each
    time (train.eval_batches of train.micro_batch), forward only; the same on every rank (rank 0 says it)."""

    rank: int
    generation: int
    step: int
    loss: float
    perplexity: float         # exp(loss)
    sequences: int
    tokens: int               # targets scored: sequences x seq_len
    seconds: float            # wall time of the evaluation (the first one compiles its graph)
    kind: str = "eval"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataFaultEvent(_Event):
    """A rank read corpus blocks that fail their checksums, before training on them; it exits 65 next."""

    rank: int
    generation: int
    step: int                 # the step that would have trained on them
    corpus: str
    blocks: list              # [{file, block, offset, expected, actual}], every bad block of that shard
    corpus_blocks: int = 0    # blocks in the whole corpus (the policy's quarantine limit is a fraction)
    detail: str = ""
    kind: str = "data_fault"


# What a step event of a supervised script may lack (PhaseEvent.reports): without "grad_norm" its grad_norm is NaN
# and the detectors that need it are off; without "skip_data" a rollback cannot skip a data window.
REPORTS = ("loss", "grad_norm", "loss_scale", "lr", "data_position", "skip_data")

# standby: formed, waiting; eval: the validation loss after a step (its first one compiles a graph)
PHASES = ("restore", "compile", "train", "checkpoint", "paused", "exiting", "standby", "eval")

@dataclasses.dataclass(frozen=True, kw_only=True)
class LrOverride:
    """A temporary lr cut: `factor` from `start_step` for `hold_steps`, then a linear ramp back to 1."""

    start_step: int
    factor: float
    hold_steps: int
    ramp_steps: int

    def __post_init__(self) -> None:
        if not 0.0 < self.factor <= 1.0 or self.start_step < 1 or self.hold_steps < 0 or self.ramp_steps < 0:
            raise ValueError(f"invalid lr override {self}: needs 0 < factor <= 1, start_step >= 1, "
                             "hold_steps >= 0, ramp_steps >= 0")

    def multiplier(self, step: int) -> float:
        held_until = self.start_step + self.hold_steps
        if step < self.start_step:
            return 1.0
        if step < held_until:
            return self.factor
        if step < held_until + self.ramp_steps:
            return self.factor + (1.0 - self.factor) * (step - held_until) / self.ramp_steps
        return 1.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LrOverride":
        return cls(**data)



@dataclasses.dataclass(frozen=True, kw_only=True)
class RecoveryDirective:
    """What the policy decided for the generations after a rollback, applied by each rank after its
    restore (the supervisor writes it as `<run.dir>/recovery.json` before each generation).

    Skip ranges and lr overrides are saved in later checkpoints too; applying them again is
    harmless (skip ranges merge; the override list is the complete list in force). `loss_scale`
    is set only when the rank restored `checkpoint_step` itself; the scale's growth is capped at
    `loss_scale_cap` until `loss_scale_cap_until_step`, and uncapped after."""

    checkpoint_step: int                                  # the rollback target (0: from scratch)
    skip_ranges: tuple[tuple[int, int], ...] = ()         # every global sample range decided so far
    lr_overrides: tuple[LrOverride, ...] = ()             # the complete list in force
    loss_scale: float | None = None                       # fp16: restart the target at this scale
    loss_scale_cap: float | None = None                   # fp16: and grow no higher than this ...
    loss_scale_cap_until_step: int = 0                    # ... before this step
    quarantined_blocks: tuple[tuple[str, int], ...] = ()  # corpus (shard file, block) pairs never read again

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoint_step": self.checkpoint_step, "skip_ranges": [list(r) for r in self.skip_ranges],
                "lr_overrides": [o.to_dict() for o in self.lr_overrides], "loss_scale": self.loss_scale,
                "loss_scale_cap": self.loss_scale_cap, "loss_scale_cap_until_step": self.loss_scale_cap_until_step,
                "quarantined_blocks": [list(b) for b in self.quarantined_blocks]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RecoveryDirective":
        return cls(checkpoint_step=int(d["checkpoint_step"]),
                   skip_ranges=tuple((int(a), int(b)) for a, b in d.get("skip_ranges", [])),
                   lr_overrides=tuple(LrOverride.from_dict(o) for o in d.get("lr_overrides", [])),
                   loss_scale=d.get("loss_scale"), loss_scale_cap=d.get("loss_scale_cap"),
                   loss_scale_cap_until_step=int(d.get("loss_scale_cap_until_step") or 0),
                   quarantined_blocks=tuple((str(f), int(b)) for f, b in d.get("quarantined_blocks", [])))

    @classmethod
    def from_json(cls, text: str) -> "RecoveryDirective":
        return cls.from_dict(json.loads(text))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RerunDirective:
    """A generation that re-runs an incident's steps before the policy acts on it (health.rerun): it
    resumes from `checkpoint_step` (the newest healthy checkpoint before `first_step`) with nothing else
    changed, and the daemon compares its steps `first_step`..`last_step` with the first run's. The
    ranks read it (`<run.dir>/rerun.json`) only for the drills that are in the data (`drills`: the
    `inject` arguments of a `spike` drill, read again as bad data would be); a device drill is not."""

    kind: str                        # the incident's kind
    first_step: int
    last_step: int
    checkpoint_step: int
    drills: tuple[dict[str, Any], ...] = ()
    rotate: int = 0                  # > 0 (data parallel): in steps first..last rank r trains on the share
                                     # of rank (r + rotate) % dp — does the fault follow the data or the rank?

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "first_step": self.first_step, "last_step": self.last_step,
                "checkpoint_step": self.checkpoint_step, "drills": [dict(d) for d in self.drills],
                "rotate": self.rotate}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RerunDirective":
        return cls(kind=str(d["kind"]), first_step=int(d["first_step"]), last_step=int(d["last_step"]),
                   checkpoint_step=int(d["checkpoint_step"]), drills=tuple(dict(x) for x in d.get("drills") or ()),
                   rotate=int(d.get("rotate") or 0))

    @classmethod
    def from_json(cls, text: str) -> "RerunDirective":
        return cls.from_dict(json.loads(text))


EVENT_TYPES = {"step": StepEvent, "exit": ExitEvent, "checkpoint": CheckpointEvent, "phase": PhaseEvent,
               "data_fault": DataFaultEvent, "eval": EvalEvent, "fingerprint": FingerprintEvent}


# Worker ⇄ supervisor plumbing: environment variables the supervisor sets for every rank.
ENV_EVENT_SOCKET = "LLM_PRETRAIN_EVENT_SOCKET"   # path of the supervisor's UNIX datagram socket
ENV_COMMANDS = "LLM_PRETRAIN_COMMANDS"           # path of the commands file
ENV_GENERATION = "LLM_PRETRAIN_GENERATION"       # restart count of this run, 0 first
ENV_RECOVERY = "LLM_PRETRAIN_RECOVERY"           # path of the recovery directive (JSON), when there is one
ENV_RERUN = "LLM_PRETRAIN_RERUN"                 # path of the rerun directive (JSON) of a generation that reruns
ENV_NODE = "LLM_PRETRAIN_NODE"                   # the machine's own index (run.node_rank of its daemon)
ENV_RESUME_STEP = "LLM_PRETRAIN_RESUME_STEP"     # several machines: the step their daemons agreed to resume from
ENV_DEVICE = "LLM_PRETRAIN_DEVICE"               # the device this rank runs on (of run.devices; the drills' device)
ENV_MEMORY_LIMIT = "LLM_PRETRAIN_MEMORY_LIMIT"   # bytes: the rank runs in a memory cgroup with this limit
ENV_STANDBY_FD = "LLM_PRETRAIN_STANDBY_FD"       # a warm standby rank: the pipe its activation arrives on
ENV_STANDBY_LATE = "LLM_PRETRAIN_STANDBY_LATE"   # "1": it forms its cluster once activated (several machines)
ENV_LOG_PATH = "LLM_PRETRAIN_LOG_PATH"           # an activated late standby: the log its output goes to now
# A local group (daemon/processes/mindspore_env.py): CPU ranks with no MindSpore cluster, summing through shared memory on
# one machine, through a TCP hub across several
ENV_LOCAL_GROUP = "LLM_PRETRAIN_LOCAL_GROUP"     # path prefix of the group's shared-memory files; across machines its name
ENV_LOCAL_RANK = "LLM_PRETRAIN_LOCAL_RANK"       # this rank, 0 .. world - 1
ENV_LOCAL_WORLD = "LLM_PRETRAIN_LOCAL_WORLD"     # the ranks in the group
ENV_GROUP_HUB = "LLM_PRETRAIN_GROUP_HUB"         # host:port of a group's TCP hub (ranks on several machines)
ENV_PHASE_BOARD = "LLM_PRETRAIN_PHASE_BOARD"     # path prefix of the generation's phase board (contracts.phase_board)
ENV_CONFIG = "LLM_PRETRAIN_CONFIG"               # the run's resolved config (TOML) the rank runs with


def activation_line(env: dict[str, str]) -> bytes:
    """What the supervisor writes to a standby rank's pipe to make it the rank of a generation: the
    rank's whole environment for that generation, as one JSON line."""
    return json.dumps({"env": env}, sort_keys=True).encode() + b"\n"


def await_activation(fd: int) -> dict[str, str] | None:
    """A standby rank blocks here until the supervisor activates it (returns the environment to take)
    or retires it by closing the pipe (returns None: exit quietly)."""
    with open(fd, "rb", closefd=True) as pipe:
        line = pipe.readline()
    if not line.endswith(b"\n"):
        return None
    env = json.loads(line)["env"]
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("a standby activation must carry an environment of strings")
    return env

# Longest path a UNIX socket address holds on Linux (108 bytes with the terminating NUL).
MAX_SOCKET_PATH_BYTES = 107

COMMANDS = ("checkpoint", "stop", "inject", "pause", "resume", "release", "interval")
# checkpoint.interval_steps = "auto": the interval the ranks start with, until the daemon's first `interval`
# command (args: interval_steps and/or memory_interval_steps) moves it (daemon/judging/cadence.py)
AUTO_FIRST_STEPS = 50
# Fault drills an `inject` command may ask for (args: fault, rank, at_step, steps, seconds).
FAULTS = ("nan", "spike", "bitflip", "faulty-rank", "corrupt-weight", "hang", "crash", "slow", "oom")


def take_environment(env: dict[str, str], spawned: set[str]) -> None:
    """Makes an activation's `env` this process's environment: of the variables the supervisor gave
    (`spawned`) those it lacks go; only what differs is set (a library's threads may be reading it).
    A late standby activated as another rank (ENV_LOG_PATH) writes to that rank's log from here on."""
    for name in [k for k in spawned if k not in env]:
        os.environ.pop(name, None)
    for name, value in env.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
    if log := os.environ.pop(ENV_LOG_PATH, None):     # started as another rank: its output goes to this one's log
        sys.stdout.flush(), sys.stderr.flush()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1), os.dup2(fd, 2)
        os.close(fd)


DEFAULT_DRILL_STEPS = {"nan": 1, "spike": 8, "bitflip": 1, "faulty-rank": 1, "corrupt-weight": 1, "slow": 100}
DATA_FAULTS = ("spike",)   # drills that are in the data: a rerun of their steps reads them again
DEFAULT_DRILL_SECONDS = {"hang": 3600.0, "slow": 0.5}


@dataclasses.dataclass(frozen=True, kw_only=True)
class InjectRequest:
    """A fault drill, as the CLI writes it, the daemon forwards it and each rank applies it: validated
    here once, by `from_dict`, wherever it is read."""

    fault: str                       # one of FAULTS
    rank: int = 0                    # the rank that misbehaves
    at_step: int | None = None       # the first step affected (None: the next)
    steps: int | None = None         # steps affected (None: DEFAULT_DRILL_STEPS)
    seconds: float | None = None     # hang: how long; slow: per step (None: DEFAULT_DRILL_SECONDS)

    @classmethod
    def from_dict(cls, body: dict[str, Any], *, world: int | None = None, dp: int | None = None) -> "InjectRequest":
        """Raises ValueError naming what is wrong and what is allowed. `dp`, where known: a faulty device is
        told from its replicas, so faulty-rank needs two of them."""
        fault = body.get("fault")
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}: it must be one of {', '.join(FAULTS)}")
        if fault == "faulty-rank" and dp is not None and dp < 2:
            raise ValueError(f"faulty-rank needs at least two data-parallel replicas (parallel.dp = {dp}): a faulty "
                             "device is found by comparing its gradients with its replicas'; with one there is "
                             "nothing to compare, and no detector would see it")
        rank = body.get("rank", 0)
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0 or (world is not None and rank >= world):
            raise ValueError(f"rank {rank!r} is not in [0, {world if world is not None else 'world size'})")
        for key in ("at_step", "steps"):
            value = body.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{key} = {value!r} must be an integer >= 1")
        seconds = body.get("seconds")
        if seconds is not None and (not isinstance(seconds, (int, float)) or isinstance(seconds, bool)
                                    or not math.isfinite(seconds) or seconds < 0):
            raise ValueError(f"seconds = {seconds!r} must be a number >= 0")
        return cls(fault=fault, rank=rank, at_step=body.get("at_step"), steps=body.get("steps"),
                   seconds=None if seconds is None else float(seconds))

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @property
    def steps_or_default(self) -> int:
        return self.steps or DEFAULT_DRILL_STEPS.get(self.fault, 1)

    @property
    def seconds_or_default(self) -> float:
        return self.seconds if self.seconds is not None else DEFAULT_DRILL_SECONDS.get(self.fault, 0.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Command:
    """One line of the commands file: applied by every rank after the same step."""

    seq: int                  # 1, 2, 3, … in file order
    name: str                 # one of COMMANDS
    args: dict = dataclasses.field(default_factory=dict)
    generation: int = 0       # several machines: only this generation's ranks apply it (0: any)

    def to_json(self) -> str:
        line = {"seq": self.seq, "name": self.name, "args": self.args}
        if self.generation:
            line["generation"] = self.generation
        return json.dumps(line, sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> "Command":
        data = json.loads(line)
        if not isinstance(data, dict) or not isinstance(data.get("seq"), int) or data.get("name") not in COMMANDS:
            raise ValueError(f"not a command: {line[:80]!r}")
        generation = data.get("generation", 0)
        return cls(seq=data["seq"], name=data["name"], args=dict(data.get("args") or {}),
                   generation=generation if isinstance(generation, int) else -1)


def send_datagram(sock, path: str, event: _Event, wait_s: float = 0.0) -> bool:
    """Sends one event on a non-blocking socket; False if it was dropped. A full queue (the reader is
    alive but has not drained yet: Linux keeps only net.unix.max_dgram_qlen, often 10, datagrams) is
    retried for up to `wait_s`; no reader at all is never waited for."""
    data, deadline = event.to_json().encode(), time.monotonic() + wait_s
    while True:
        try:
            sock.sendto(data, path)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(DATAGRAM_RETRY_S)
        except OSError:            # no reader (refused, socket gone), or too large: dropped
            return False


def decode_event(line: str | bytes) -> _Event:
    """Parses one JSON event; raises ValueError on anything that is not a known event."""
    data = json.loads(line)
    if not isinstance(data, dict) or data.get("kind") not in EVENT_TYPES:
        raise ValueError(f"not an event: {str(line)[:80]!r}")
    return EVENT_TYPES[data["kind"]].from_dict(data)
