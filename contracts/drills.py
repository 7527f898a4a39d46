"""Fault drills: what an `inject` command does inside a rank, so operators can rehearse recovery — the engine's
ranks and a supervised script's (llm_pretrain_client) alike, so both sides share it here. Stdlib only.

Owns: turning agreed `inject` commands into faults at chosen steps of this
generation (a drill is one-shot: a restarted generation does not repeat it, but for a data drill
in a generation that reruns its steps).
Honoured only with `health.allow_fault_injection = true`.

    nan    the step's scaled loss × NaN on this rank: non-finite gradients, a skipped step
           (fp16: an overflow, so N of them in a row are an overflow storm); not in the data: a rerun
           of the step does not repeat it
    bitflip  one bit flips once: the top exponent bit of this rank's loss-scale multiplier (1.0 → inf),
           so every gradient it computes overflows — what a flipped exponent bit in one gradient does
           once the all-reduce and the norm sum it: a non-finite step a rerun does not repeat (a
           transient device fault)
    faulty-rank  the device this rank runs on turns faulty and stays so: its gradients ×32 every step (a broken
           unit, deterministic, so a rerun repeats it), in every generation whose rank runs on that device
           (`<run.dir>/drills/faulty-node<N>-device<D>` marks it) until the device is left out (quarantine);
           its own gradient norm stands out of the others' (health.rank_outlier_steps)
    spike  this rank's batches of the window are replaced by uniformly random token ids, as from
           a corrupt shard: bad data the model cannot predict, a real loss spike, not a faked number;
           in the data, so a rerun of its steps (contracts.protocol.RerunDirective) reads it again
    corrupt-weight  one bit of one weight flips on this rank, once (a low mantissa bit of the first
           parameter's first element): silent — no loss or gradient shows it — until the replicas'
           fingerprints are compared (health.fingerprint_interval_steps)
    hang   the rank stops inside a step's compute for `seconds` (default: an hour)
    crash  the rank SIGKILLs itself
    slow   `seconds` (default 0.5) of sleep before each step of the window
    oom    the rank allocates memory until its memory cgroup's limit kills it (only when it
           runs under a limit; otherwise the drill is refused: it would eat the host's memory)

args: fault, rank (default 0), at_step (default: the next step), steps (window length; nan 1,
spike 8, slow 100), seconds.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import struct
import sys
import time

from pathlib import Path

from contracts.protocol import DATA_FAULTS, ENV_DEVICE, ENV_MEMORY_LIMIT, ENV_NODE, InjectRequest, RerunDirective

# 1.0f with bit 30 (the exponent's top bit) flipped: 0x3F800000 ^ 0x40000000 = 0x7F800000, +inf
FLIPPED_ONE = struct.unpack("<f", struct.pack("<I", 0x3F800000 ^ (1 << 30)))[0]
FAULTY = 32.0      # a faulty device's gradients, this many times what they should be (faulty-rank)


@dataclasses.dataclass(frozen=True)
class Drill:
    fault: str
    first_step: int
    steps: int
    seconds: float

    def covers(self, step: int) -> bool:
        return self.first_step <= step < self.first_step + self.steps


class Drills:
    def __init__(self, *, rank: int, allowed: bool, env=os.environ, log=None, dp: int = 1,
                 marks: Path | None = None, rerun: RerunDirective | None = None):
        """`rerun`: this generation's rerun directive (contracts.protocol.RerunDirective), if it reruns."""
        self.rank, self.allowed, self.env, self.dp = rank, allowed, env, dp
        self.pending: list[Drill] = []
        self.log = log or (lambda msg: print(f"llm-pretrain: {msg}", file=sys.stderr, flush=True))
        device = env.get(ENV_DEVICE, str(rank))
        self.mark = marks / f"faulty-node{env.get(ENV_NODE, '0')}-device{device}" if marks else None
        self.faulty = bool(allowed and self.mark and self.mark.exists())
        if self.faulty:
            self.log(f"drill: device {device} of this machine is faulty (faulty-rank): rank {rank}'s gradients "
                     f"x{FAULTY:g} every step")
        self._read_again(rerun if allowed else None)

    def _read_again(self, rerun: RerunDirective | None) -> None:
        """A generation that reruns an incident's steps reads the data drills among them again (bad data is
        bad every time it is read); at the step they began, or the incident's first step. A rotated rerun
        trains each rank on another's share: the drill's data is then where its share is."""
        if rerun is None:
            return
        for args in rerun.drills:
            req = InjectRequest.from_dict(args)
            holder = (req.rank - rerun.rotate) % self.dp if rerun.rotate else req.rank
            if req.fault in DATA_FAULTS and holder == self.rank:
                first = req.at_step or rerun.first_step
                self.pending.append(Drill(req.fault, first, req.steps_or_default, req.seconds_or_default))
                self.log(f"rerun of steps {rerun.first_step}-{rerun.last_step}: the {req.fault} drill's data (rank "
                         f"{req.rank}'s share) is read again at step {first} for {req.steps_or_default} step(s) on "
                         f"rank {self.rank}")

    def add(self, seq: int, args: dict, applied_after_step: int) -> None:
        """An agreed inject command, applied after step `applied_after_step` on every rank."""
        if not self.allowed:
            self.log(f"ignoring inject command {seq}: health.allow_fault_injection = false")
            return
        try:
            req = InjectRequest.from_dict(args)
        except ValueError as e:
            self.log(f"ignoring inject command {seq}: {e}")
            return
        if req.rank != self.rank:
            return
        first = max(req.at_step or 0, applied_after_step + 1)
        steps = req.steps_or_default
        self.pending.append(Drill(req.fault, first, steps, req.seconds_or_default))
        self.log(f"inject command {seq}: {req.fault} at step {first} for {steps} step(s) on rank {self.rank}")

    def corrupts_weight(self, step: int) -> bool:
        """A corrupt-weight drill is due before `step` (the caller flips the bit)."""
        due = any(d.fault == "corrupt-weight" and d.first_step == step for d in self.pending)
        if due:
            self.log(f"drill: flipping one bit of one weight before step {step}")
        return due

    def before_step(self, step: int, entering=None) -> tuple[float, bool]:
        """Runs the process-level faults due before `step`; returns (poison, corrupt) for the step.
        `entering(phase)`: where the rank says it is (its phase board): a hang is inside the step's compute."""
        for d in self.pending:
            if d.fault == "faulty-rank" and step >= d.first_step and not self.faulty:
                self._turn_faulty(step)
        poison, corrupt = (FAULTY if self.faulty else 1.0), False
        for d in self.pending:
            if not d.covers(step):
                continue
            if d.fault == "nan":
                poison = float("nan")
            elif d.fault == "bitflip":
                poison = FLIPPED_ONE
            elif d.fault == "spike":
                corrupt = True
            elif d.fault == "slow":
                time.sleep(d.seconds)
            elif d.fault == "hang" and step == d.first_step:
                self.log(f"drill: hanging for {d.seconds:g} s in step {step}'s compute")
                if entering is not None:
                    entering("compute")         # as a kernel that never returns would leave it
                time.sleep(d.seconds)
            elif d.fault == "crash" and step == d.first_step:
                self.log(f"drill: SIGKILL before step {step}")
                os.kill(os.getpid(), signal.SIGKILL)
            elif d.fault == "oom" and step == d.first_step:
                self._exhaust_memory(step)
        self.pending = [d for d in self.pending if d.first_step + d.steps > step]
        return poison, corrupt

    def _turn_faulty(self, step: int) -> None:
        """faulty-rank: this rank's device turns faulty for good (marked for the generations after this one)."""
        if self.mark is not None:
            self.mark.parent.mkdir(parents=True, exist_ok=True)
            self.mark.touch()
        self.faulty = True
        self.log(f"drill: the device of rank {self.rank} turns faulty at step {step} (gradients x{FAULTY:g} every "
                 "step, in this and later generations on it)")

    def _exhaust_memory(self, step: int) -> None:
        limit = int(self.env.get(ENV_MEMORY_LIMIT, "0") or 0)
        if limit <= 0:
            self.log("ignoring the oom drill: this rank runs without a memory limit "
                     "(set run.worker_memory_limit_bytes)")
            return
        self.log(f"drill: allocating past the {limit} byte limit before step {step}")
        hoard, chunk = [], 64 << 20
        for _ in range(2 * limit // chunk + 2):
            block = bytearray(chunk)
            block[::4096] = b"\x01" * len(block[::4096])     # touch every page: resident, not just reserved
            hoard.append(block)
        self.log("the oom drill allocated twice the limit and was not killed: the limit is not enforced")
        hoard.clear()
