"""The supervisor: runs this node's ranks as generations, watches them, and brings them back.

Owns the main loop of `llm-pretrain run`. Each generation: reset the commands
file, start MindSpore's scheduler (node 0, more than one rank) and this node's
workers — each its own process group and log — with a fresh scheduler port;
then, every tick, read the workers' event datagrams, reap exits, judge hangs
(daemon.hang), and forward stop requests as commands. A crash or a hang ends
the generation (SIGTERM, grace, SIGKILL per group), is recorded in state.json
before anything is done about it, and is followed — after an exponential,
jittered backoff — by the next generation, which resumes from the newest
committed checkpoint. K restarts in a row without a new committed checkpoint
end the daemon with exit 3.

The worker and scheduler commands are constructor arguments, so the
integration tests run the real supervisor against a stdlib fake worker.
Never imports MindSpore.
"""
from __future__ import annotations

import hashlib
import os
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

import tenacity

from checkpointing import layout
from daemon import cluster, hang, processes
from daemon.eventlog import EventLog
from daemon.lock import RunLock
from daemon.protocol import (ENV_COMMANDS, ENV_EVENT_SOCKET, ENV_GENERATION, MAX_SOCKET_PATH_BYTES, Command,
                             ExitCode, decode_event)
from daemon.state import RunState
from engine.config import Config

TICK_S = 0.1
# Exit codes after which restarting a worker cannot help: pass them on.
_FINAL_WORKER_CODES = {ExitCode.USAGE, ExitCode.DATA_ERROR, ExitCode.CONFIG_ERROR}


def socket_path(cfg: Config, run_dir: Path, env: Mapping[str, str]) -> Path:
    """$RUNTIME_DIRECTORY/<name>.sock under systemd, else <run.dir>/events.sock; a short temporary
    path when those exceed the 107-byte limit of a UNIX socket address."""
    candidates = []
    if env.get("RUNTIME_DIRECTORY"):
        candidates.append(Path(env["RUNTIME_DIRECTORY"].split(":")[0]) / f"{cfg.run.name}.sock")
    candidates.append(run_dir.resolve() / "events.sock")
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    candidates.append(Path(tempfile.gettempdir()) / f"llm-pretrain-{digest}.sock")
    return next(c for c in candidates if len(os.fsencode(c)) <= MAX_SOCKET_PATH_BYTES)


class Supervisor:
    def __init__(self, cfg: Config, *, worker_cmd: Sequence[str], scheduler_cmd: Sequence[str] | None,
                 env: Mapping[str, str] = os.environ, stream=None):
        self.cfg = cfg
        self.worker_cmd, self.scheduler_cmd = list(worker_cmd), scheduler_cmd
        self.env = dict(env)
        self.run_dir = cfg.run.resolved_dir(env)
        self.log_dir = cfg.run.resolved_log_dir(env)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = EventLog(self.log_dir / "events.jsonl", cfg.run.name, **({"stream": stream} if stream else {}))
        self.commands_path = self.run_dir / "commands.jsonl"
        self.ckpt_root = self.run_dir / "checkpoints"
        self.world = cfg.parallel.world_size
        self.local_ranks = self.world // cfg.run.nodes    # ranks this node runs
        self.state = RunState()
        self.signals = 0               # SIGTERM/SIGINT received
        self._seq = 0
        self._backoff = tenacity.wait_exponential_jitter(initial=cfg.health.restart_backoff_initial_s,
                                                         max=cfg.health.restart_backoff_max_s, jitter=1.0)

    # Entry point -------------------------------------------------------------
    def run(self) -> int:
        lock = RunLock(self.run_dir)
        try:
            lock.acquire()
        except Exception as e:          # LockHeldError: another live daemon owns this run
            self.log.emit("locked", level="error", detail=str(e))
            return ExitCode.LOCKED
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
            self.state = RunState.load(self.run_dir)
            self._clean_orphans()
            self.state.daemon_pid = os.getpid()
            self.state.save(self.run_dir)
            return self._loop()
        finally:
            lock.release()
            self.log.close()

    def _on_signal(self, signum, frame) -> None:
        self.signals += 1

    def _clean_orphans(self) -> None:
        if not self.state.processes:
            return
        killed = processes.kill_orphans(self.state.processes)
        if killed:
            self.log.emit("orphans_killed", level="warning", pids=[r["pid"] for r in killed],
                          detail="workers of a previous daemon were still running")
        self.state.processes = []

    def _committed_step(self) -> int:
        steps = layout.committed_steps(self.ckpt_root)
        return steps[-1] if steps else 0

    # Generations ---------------------------------------------------------------
    def _loop(self) -> int:
        self.state.last_committed_step = self._committed_step()
        while True:
            outcome = self._generation()
            kind = outcome["outcome"]
            if kind in ("finished", "stopped"):
                self.state.status = kind
                self.state.save(self.run_dir)
                self.log.emit("daemon_exit", code=0, reason=kind, step=outcome.get("step"))
                return ExitCode.OK
            if kind == "final_error":
                self.state.status = "failed"
                self.state.save(self.run_dir)
                self.log.emit("daemon_exit", level="error", code=outcome["code"], reason="worker_error",
                              detail=outcome["detail"])
                return outcome["code"]
            # A crash or a hang: record it, then decide.
            committed = self._committed_step()
            progressed = committed > self.state.last_committed_step
            self.state.restarts_without_progress = 0 if progressed else self.state.restarts_without_progress + 1
            self.state.last_committed_step = committed
            incident = {k: v for k, v in outcome.items() if k != "outcome"}
            incident.update(kind=kind, generation=self.state.generation, committed_step=committed,
                            unix_s=time.time())
            self.state.incidents.append(incident)
            limit = self.cfg.health.max_restarts_without_progress
            if self.state.restarts_without_progress >= limit:
                self.state.status = "gave_up"
                self.state.save(self.run_dir)
                self.log.emit("gave_up", level="error", code=int(ExitCode.GAVE_UP_CRASH_LOOP),
                              restarts_without_progress=self.state.restarts_without_progress,
                              committed_step=committed, last_incident=incident)
                self.log.emit("daemon_exit", level="error", code=int(ExitCode.GAVE_UP_CRASH_LOOP),
                              reason="crash_loop")
                return ExitCode.GAVE_UP_CRASH_LOOP
            delay = self._backoff(_Attempt(self.state.restarts_without_progress + 1))
            self.state.restarts += 1
            self.state.status = "restarting"
            self.state.save(self.run_dir)
            self.log.emit("restart", level="warning", cause=kind, rank=outcome.get("rank"),
                          detail=outcome.get("detail"), resume_step=committed, backoff_s=round(delay, 3),
                          restarts=self.state.restarts,
                          restarts_without_progress=self.state.restarts_without_progress)
            if self._sleep(delay):
                self.state.status = "stopped"
                self.state.save(self.run_dir)
                self.log.emit("daemon_exit", code=0, reason="stopped", detail="stop requested during backoff")
                return ExitCode.OK

    def _sleep(self, seconds: float) -> bool:
        """Waits, but returns True at once if a stop signal arrives."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.signals:
                return True
            time.sleep(min(TICK_S, deadline - time.monotonic()))
        return bool(self.signals)

    def _append_command(self, name: str, **args) -> None:
        self._seq += 1
        with open(self.commands_path, "a") as f:
            f.write(Command(seq=self._seq, name=name, args=args).to_json() + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.log.emit("command_sent", name=name, seq=self._seq, args=args)

    def _worker_env(self, rank: int, port: int, sock: Path) -> dict[str, str]:
        cfg, world = self.cfg, self.world
        base = dict(self.env, **{ENV_EVENT_SOCKET: str(sock), ENV_COMMANDS: str(self.commands_path.resolve())})
        if cfg.run.compile_cache:
            base.update(MS_COMPILER_CACHE_ENABLE="1",
                        MS_COMPILER_CACHE_PATH=str((self.run_dir / "compile_cache").resolve()))
        if world == 1:
            base[ENV_GENERATION] = str(self.state.generation)
            return base
        return cluster.process_env(base, role=cluster.WORKER, sched_host=cfg.run.master_addr, sched_port=port,
                                   worker_num=world, local_worker_num=self.local_ranks, node_id=rank,
                                   generation=self.state.generation)

    def _generation(self) -> dict:
        cfg = self.cfg
        self.state.generation += 1
        self.log.generation = self.state.generation
        self._seq = 0
        self.commands_path.write_text("")               # commands are per generation
        world, local = self.world, self.local_ranks
        ranks = range(cfg.run.node_rank * local, (cfg.run.node_rank + 1) * local)
        port = cfg.run.master_port or cluster.free_port(cfg.run.master_addr)
        sock_path = socket_path(cfg, self.run_dir, self.env)
        sock_path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(sock_path))
        sock.setblocking(False)
        workers: list[processes.Worker] = []
        try:
            if world > 1 and cfg.run.node_rank == 0 and self.scheduler_cmd:
                sched_env = cluster.process_env(self.env, role=cluster.SCHEDULER, sched_host=cfg.run.master_addr,
                                                sched_port=port, worker_num=world, local_worker_num=local,
                                                generation=self.state.generation)
                workers.append(processes.spawn(self.scheduler_cmd, env=sched_env, role="scheduler", rank=-1,
                                               log_path=self.log_dir / "scheduler.log"))
            for rank in ranks:
                workers.append(processes.spawn(self.worker_cmd, env=self._worker_env(rank, port, sock_path),
                                               role="rank", rank=rank, log_path=self.log_dir / f"rank-{rank}.log"))
            self.state.processes = [w.record() for w in workers]
            self.state.status = "running"
            self.state.save(self.run_dir)
            self.log.emit("generation_start", ranks=list(ranks), port=port,
                          pids={w.rank: w.pid for w in workers}, resume_step=self._committed_step())
            return self._watch(workers, sock)
        finally:
            processes.stop_all(workers, grace_s=cfg.run.kill_grace_s)
            self.state.processes = []
            self.state.save(self.run_dir)
            sock.close()
            sock_path.unlink(missing_ok=True)

    def _watch(self, workers: list[processes.Worker], sock: socket.socket) -> dict:
        cfg = self.cfg
        ranks = [w for w in workers if w.role == "rank"]
        started = time.monotonic()
        progress = {w.rank: hang.RankProgress(since_s=started) for w in ranks}
        steps = hang.StepTimes()
        first_step_seen: set[int] = set()
        exits: dict[int, dict] = {}
        stop_sent_at: float | None = None
        last_step_log = 0.0
        while True:
            now = time.monotonic()
            # 1. events
            while True:
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    break
                try:
                    event = decode_event(data)
                except ValueError:
                    continue
                p = progress.get(event.rank)
                if p is None or event.generation != self.state.generation:
                    continue
                p.since_s = now
                if event.kind == "phase":
                    p.phase = event.phase
                elif event.kind == "step":
                    p.phase, p.step = "train", event.step
                    if event.rank in first_step_seen:
                        steps.add(event.step_s)
                    first_step_seen.add(event.rank)
                    if event.rank == ranks[0].rank and now - last_step_log >= 10.0:
                        last_step_log = now
                        self.log.emit("progress", step=event.step, loss=event.loss, lr=event.lr,
                                      tokens_per_s=round(event.tokens_per_s, 1), skipped=event.skipped)
                elif event.kind == "checkpoint" and event.stage in ("committed", "failed", "quarantined"):
                    self.log.emit(f"checkpoint_{event.stage}", level="info" if event.stage == "committed"
                                  else "error", rank=event.rank, step=event.step, detail=event.detail)
                elif event.kind == "exit":
                    exits[event.rank] = {"reason": event.reason, "step": event.step}
            # 2. stop requests
            if self.signals and stop_sent_at is None:
                stop_sent_at = now
                self.log.emit("stopping", detail="signal received: checkpoint at the next step, then exit",
                              timeout_s=cfg.run.stop_timeout_s)
                self._append_command("stop")
            if stop_sent_at is not None and (self.signals > 1 or now - stop_sent_at > cfg.run.stop_timeout_s):
                self.log.emit("stop_forced", level="warning",
                              detail="second signal" if self.signals > 1 else "stop timeout passed")
                return {"outcome": "stopped"}
            # 3. exits
            for w in ranks:
                code = w.popen.poll()
                if code is None or code == 0:
                    continue
                cause = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                if code in _FINAL_WORKER_CODES:
                    return {"outcome": "final_error", "code": code, "rank": w.rank,
                            "detail": f"rank {w.rank} ended with {cause}; see {w.log_path}"}
                self.log.emit("crash", level="error", rank=w.rank, exit_code=code, cause=cause,
                              step=progress[w.rank].step, log=str(w.log_path))
                return {"outcome": "crash", "rank": w.rank, "exit_code": code, "step": progress[w.rank].step,
                        "detail": f"rank {w.rank}: {cause}"}
            if all(w.popen.poll() == 0 for w in ranks):
                reasons = {e["reason"] for e in exits.values()}
                kind = "stopped" if stop_sent_at is not None or "stopped" in reasons else "finished"
                return {"outcome": kind, "step": max((e["step"] for e in exits.values()), default=None)}
            # 4. hangs
            for w in ranks:
                if w.popen.poll() is not None:
                    continue
                hung, limit = hang.is_hung(progress[w.rank], now, cfg.health, steps)
                if hung:
                    waited = now - progress[w.rank].since_s
                    # the stuck rank and those blocked in a collective waiting for it look alike
                    # from here: dump every live rank's stacks
                    self._dump_stacks([r for r in ranks if r.popen.poll() is None])
                    self.log.emit("hang", level="error", rank=w.rank, phase=progress[w.rank].phase,
                                  step=progress[w.rank].step, waited_s=round(waited, 2), timeout_s=round(limit, 2),
                                  log=str(w.log_path))
                    return {"outcome": "hang", "rank": w.rank, "phase": progress[w.rank].phase,
                            "step": progress[w.rank].step, "waited_s": round(waited, 2),
                            "timeout_s": round(limit, 2), "detail": f"rank {w.rank} made no progress in "
                            f"{waited:.1f} s ({progress[w.rank].phase}, limit {limit:.1f} s)"}
            time.sleep(TICK_S)

    def _dump_stacks(self, workers: Sequence[processes.Worker]) -> None:
        """faulthandler in each worker writes every thread's Python stack to its log on SIGUSR1."""
        for worker in workers:
            try:
                os.kill(worker.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(1.0)


class _Attempt:
    """The little of tenacity's RetryCallState that its wait strategies read."""

    def __init__(self, attempt_number: int):
        self.attempt_number = attempt_number
