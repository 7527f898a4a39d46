"""A stdlib-only stand-in for `llm-pretrain train`, for the supervisor's integration tests.

Speaks the real protocol (contracts.protocol): phase, step, checkpoint and exit
events as datagrams; the commands file (pause holds until resume, release or stop);
SIGTERM; faulthandler on SIGUSR1. Its
"checkpoints" are directories `step-N/` under <run-dir>/checkpoints, from
which it resumes. Faults on cue, in chosen generations:

    --crash-at STEP      exit 1 after STEP          --signal-at STEP   SIGKILL itself after STEP
    --crash-when PATH    exit 1 after the first step that finds PATH empty or holding this generation's number
    --hang-at STEP       stop stepping after STEP   --die-at-start     raise (exit 1) before any event
    --first-step-s S     the first step of a generation takes S seconds, the others --step-s
    --spike-at STEP      report a loss 4x higher for --spike-steps steps from STEP: bad data, so a
                         generation that reruns those steps (ENV_RERUN) spikes again, in any generation;
                         with --spike-device, a device's fault: only where faulty, never in a rerun
    --hog-at STEP        allocate memory until killed after STEP (an out-of-memory drill)
    --save-s S           a save blocks S seconds and says so (a `staged` event: what "auto" intervals time)
    --fingerprint-every N   a fingerprint event every N steps (the same on every rank ...)
    --corrupt-at STEP    ... but, from STEP on, not on a faulty rank (a weight corrupted silently)
    --ignore-term        ignore SIGTERM (a rank stuck where no handler runs)
    --linger-s S         stay S seconds after the exit event (a framework's slow teardown)
    --rank-faults R      only rank R misbehaves (default: all)
    --gate-at STEP --gate PATH   from STEP on, wait before each step until PATH exists or a
                         SIGTERM comes (a test's cue that what must happen first has happened)
    --fault-generations G[,G...]   only in these generations (default: all)
    --reports R[,R...]   say what it reports, as a supervised script's client does (PhaseEvent.reports)

It honours `interval` commands (the daemon's checkpoint interval when it is "auto") and the recovery
directive (skip ranges move its sample ranges; lr overrides set the reported lr multiplier) and reads
nothing from the config
file the daemon hands it (`--config`, or LLM_PRETRAIN_CONFIG run as a script) but prints its [train], [optim] and [parallel]
keys, so tests can see the config each generation was started with.
"""
import argparse
import faulthandler
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import tomllib

from contracts.protocol import (
    ENV_COMMANDS,
    ENV_CONFIG,
    ENV_EVENT_SOCKET,
    ENV_GENERATION,
    ENV_GROUP_HUB,
    ENV_LOCAL_GROUP,
    ENV_LOCAL_RANK,
    ENV_RECOVERY,
    ENV_RERUN,
    ENV_STANDBY_FD,
    CheckpointEvent,
    Command,
    ExitEvent,
    FingerprintEvent,
    PhaseEvent,
    RecoveryDirective,
    RerunDirective,
    StepEvent,
    await_activation,
    send_datagram,
    take_environment,
)


INTERVAL = {}     # the last `interval` command's args (checkpoint.interval_steps = "auto")


def _new_commands(path: str | None, seen: int) -> tuple[int, list[str]]:
    """The commands after seq `seen`: (the newest seq, their names); an `interval` command's args into INTERVAL."""
    names = []
    if path and os.path.exists(path):
        for line in Path(path).read_text().splitlines():
            cmd = Command.from_json(line)
            if cmd.seq > seen:
                seen = cmd.seq
                names.append(cmd.name)
                if cmd.name == "interval":
                    INTERVAL.update(cmd.args)
    return seen, names


def _cued(path: str | None, generation: int) -> bool:
    """A test's cue: `path` exists, empty or holding `generation`'s number."""
    try:
        return path is not None and Path(path).read_text().strip() in ("", str(generation))
    except OSError:
        return False


def _rank() -> int:
    return int(os.environ.get(ENV_LOCAL_RANK, os.environ.get("MS_NODE_ID", "0")))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--step-s", type=float, default=0.02)
    ap.add_argument("--first-step-s", type=float)          # the first step of a generation (default: --step-s)
    ap.add_argument("--interval", type=int, default=5)
    ap.add_argument("--start-delay-s", type=float, default=0.0)
    ap.add_argument("--crash-at", type=int)
    ap.add_argument("--crash-when")
    ap.add_argument("--signal-at", type=int)
    ap.add_argument("--hang-at", type=int)
    ap.add_argument("--die-at-start", action="store_true")
    ap.add_argument("--spike-at", type=int)
    ap.add_argument("--spike-steps", type=int, default=6)
    ap.add_argument("--spike-device", action="store_true")
    ap.add_argument("--hog-at", type=int)
    ap.add_argument("--fingerprint-every", type=int)
    ap.add_argument("--save-s", type=float, default=0.0)
    ap.add_argument("--corrupt-at", type=int)
    ap.add_argument("--config", default=os.environ.get(ENV_CONFIG))   # run as a user's script: the daemon's env says
    ap.add_argument("--reports")                  # a script's rank: what it reports (PhaseEvent.reports), comma-separated
    ap.add_argument("--ignore-term", action="store_true")
    ap.add_argument("--linger-s", type=float, default=0.0)     # after the exit event (a framework's teardown)
    ap.add_argument("--rank-faults", type=int)
    ap.add_argument("--fault-generations", default="")
    ap.add_argument("--gate-at", type=int)
    ap.add_argument("--gate")
    ap.add_argument("--lockstep")                 # a directory: step with the other ranks, as collectives make them
    ap.add_argument("--lockstep-world", type=int, default=1)
    a = ap.parse_args()
    if os.environ.get(ENV_STANDBY_FD):          # a warm standby: wait to be made a rank (engine/rank/standby.py)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as ready:
            ready.setblocking(False)
            send_datagram(ready, os.environ[ENV_EVENT_SOCKET], PhaseEvent(
                rank=_rank(), generation=int(os.environ[ENV_GENERATION]),
                phase="standby"))
        env = await_activation(int(os.environ[ENV_STANDBY_FD]))
        if env is None:
            return 0
        take_environment(env, set(os.environ))

    rank = _rank()
    generation = int(os.environ.get(ENV_GENERATION, "0"))
    if os.environ.get(ENV_LOCAL_GROUP) and not os.environ.get(ENV_GROUP_HUB):   # one machine's: its shared memory
        open(os.environ[ENV_LOCAL_GROUP] + ".seg", "ab").close()
        print(f"local group {os.environ[ENV_LOCAL_GROUP]}", flush=True)
    gens = {int(g) for g in a.fault_generations.split(",") if g}
    faulty = (not gens or generation in gens) and (a.rank_faults is None or a.rank_faults == rank)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    stop = {"requested": False}
    signal.signal(signal.SIGTERM, signal.SIG_IGN if a.ignore_term else lambda *_: stop.update(requested=True))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    path = os.environ.get(ENV_EVENT_SOCKET, "")
    emit = lambda e: (send_datagram(sock, path, e), print(e.to_json(), flush=True))
    print(f"fake worker rank {rank} generation {generation} pid {os.getpid()}", flush=True)
    if a.config:
        with open(a.config, "rb") as f:
            cfg = tomllib.load(f)
        keys = [f"{s}.{k}={json.dumps(v)}" for s in ("train", "optim", "parallel") for k, v in sorted(cfg[s].items())]
        print(f"config {a.config}: {' '.join(keys)}", flush=True)
    recovery = None
    if os.environ.get(ENV_RECOVERY) and os.path.exists(os.environ[ENV_RECOVERY]):
        recovery = RecoveryDirective.from_json(Path(os.environ[ENV_RECOVERY]).read_text())
    rerun = None
    if os.environ.get(ENV_RERUN) and os.path.exists(os.environ[ENV_RERUN]):
        rerun = RerunDirective.from_json(Path(os.environ[ENV_RERUN]).read_text())
    # bad data is read again by a rerun of its steps (and only by one: a rollback skips it or shifts it away)
    data_again = rerun is not None and not a.spike_device and (a.rank_faults is None or a.rank_faults == rank)
    if faulty and a.die_at_start:             # as a real rank fails: a traceback, exit 1
        print("dying at start, as asked", flush=True)
        raise RuntimeError("the model's safetensors header is not JSON (dying at start, as asked)")
    time.sleep(a.start_delay_s)
    ckpts = Path(a.run_dir) / "checkpoints"
    done = [int(p.name[5:]) for p in ckpts.glob("step-*") if p.name[5:].isdigit() and (p / "manifest.json").exists()] \
        if ckpts.is_dir() else []
    step = max(done, default=0)
    emit(PhaseEvent(rank=rank, generation=generation, phase="restore", step=step))
    emit(PhaseEvent(rank=rank, generation=generation, phase="compile", step=step,
                    reports=None if a.reports is None else [r for r in a.reports.split(",") if r]))

    def save():
        if a.save_s:       # the save blocks the step this long (said as its `staged` cost)
            time.sleep(a.save_s)
            emit(CheckpointEvent(rank=rank, generation=generation, step=step, stage="staged", seconds=a.save_s))
        if rank == 0:      # a manifest with no shards: complete, as far as the daemon checks
            tmp = ckpts / f"step-{step:08d}.tmp"
            tmp.mkdir(parents=True, exist_ok=True)
            (tmp / "manifest.json").write_text(json.dumps({"format": "llm-pretrain-checkpoint", "version": 1,
                                                           "step": step, "shards": [], "tensors": {}}))
            if not (ckpts / f"step-{step:08d}").exists():
                tmp.rename(ckpts / f"step-{step:08d}")
            else:
                (tmp / "manifest.json").unlink()
                tmp.rmdir()
            emit(CheckpointEvent(rank=rank, generation=generation, step=step, stage="committed"))

    commands_path = os.environ.get(ENV_COMMANDS)
    seen = 0
    reason = "finished"
    skips = sorted(recovery.skip_ranges) if recovery else []
    overrides = recovery.lr_overrides if recovery else ()

    def sample_range(n):
        # 8 samples per step; skipped ranges are stepped over (a stand-in for engine.data.order)
        start = 8 * (n - 1)
        for a_, b_ in skips:
            if start >= a_:
                start += b_ - a_
        return start, start + 8

    def lockstep(done: int) -> None:
        """Says this rank finished step `done`, then waits until every rank of the generation has (a real
        cluster's all-reduce), or for a SIGTERM: under load no rank runs far ahead of a failing one."""
        if not a.lockstep:
            return
        folder = Path(a.lockstep)
        folder.mkdir(parents=True, exist_ok=True)
        mine = folder / f"g{generation}-r{rank}"
        mine.with_suffix(".tmp").write_text(str(done))
        mine.with_suffix(".tmp").replace(mine)
        peers = [folder / f"g{generation}-r{r}" for r in range(a.lockstep_world)]
        while not stop["requested"] and not all(p.exists() and int(p.read_text() or 0) >= done for p in peers):
            time.sleep(0.01)

    lockstep(step)
    stepped = False
    while step < a.steps:
        while a.gate_at is not None and step + 1 >= a.gate_at and not os.path.exists(a.gate) \
                and not stop["requested"]:
            time.sleep(0.02)
        time.sleep(a.step_s if a.first_step_s is None or stepped else a.first_step_s)
        stepped = True
        step += 1
        multiplier = 1.0
        for o in overrides:
            multiplier *= o.multiplier(step)
        spiking = (faulty or data_again) and a.spike_at is not None and a.spike_at <= step < a.spike_at + a.spike_steps
        loss = (3.0 + 0.01 * (step % 7)) * (4.0 if spiking else 1.0)
        start, end = sample_range(step)
        emit(StepEvent(rank=rank, generation=generation, step=step, loss=loss, grad_norm=1.0, loss_scale=1.0,
                       lr=1e-3 * multiplier, lr_multiplier=multiplier, skipped=False, sample_start=start,
                       sample_end=end, tokens=512, step_s=a.step_s, data_wait_s=0.0, tokens_per_s=512 / a.step_s))
        if a.fingerprint_every and step % a.fingerprint_every == 0:
            corrupt = faulty and a.corrupt_at is not None and step >= a.corrupt_at
            emit(FingerprintEvent(rank=rank, generation=generation, step=step, groups=[step, 1 << 10 if corrupt else 0],
                                  names=["embed", "layers.0"], seconds=0.001))
        seen, names = _new_commands(commands_path, seen)
        if "pause" in names:             # hold (as the engine does) until resumed, released or stopped
            emit(PhaseEvent(rank=rank, generation=generation, phase="paused", step=step))
            while not ({"resume", "release", "stop"} & set(names)) and not stop["requested"]:
                time.sleep(0.02)
                seen, names = _new_commands(commands_path, seen)
            if "release" in names:
                reason = "released"
                break
        if step % INTERVAL.get("interval_steps", a.interval) == 0 or step == a.steps or "checkpoint" in names or "stop" in names \
                or stop["requested"]:
            save()
        if "stop" in names or stop["requested"]:
            reason = "stopped"
            break
        if faulty and (a.crash_at == step or _cued(a.crash_when, generation)):
            print(f"crashing, as asked, at unix time {time.time():.3f}", flush=True)
            return 1
        if faulty and a.signal_at == step:
            os.kill(os.getpid(), signal.SIGKILL)
        if faulty and a.hog_at == step:
            print("allocating until killed, as asked", flush=True)
            hoard = []
            for _ in range(16):           # 1 GiB at most: far past the tests' limits
                block = bytearray(64 << 20)
                block[::4096] = b"\x01" * len(block[::4096])
                hoard.append(block)
            print("not killed: no memory limit?", flush=True)
            return 1
        if faulty and a.hang_at == step:
            print("hanging, as asked", flush=True)
            while True:
                time.sleep(1)
        lockstep(step)                 # a failed rank above never says it finished: its peers wait for it
    emit(PhaseEvent(rank=rank, generation=generation, phase="exiting", step=step))
    emit(ExitEvent(rank=rank, generation=generation, step=step, reason=reason))
    time.sleep(a.linger_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
