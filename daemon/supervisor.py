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

Health: the first local rank's step events (the loss and grad norm are
global) feed daemon.health's detectors; warnings are logged and recorded, an
incident that needs action ends the generation at once. Every incident —
crash, hang, out of memory, loss spike, non-finite, overflow storm — goes
through daemon.policy.decide; the decision is recorded in state.json before it
is carried out and logged as one `incident` event with its evidence. A
rollback renames the checkpoints after its target `step-N.rolledback` and
writes the recovery directive (skip ranges, lr overrides, loss scale) that
every later generation's ranks apply after their restore; a restart with
config changes passes them to the ranks as `--set`.

The worker and scheduler commands are constructor arguments, so the
integration tests run the real supervisor against a stdlib fake worker.
Never imports MindSpore.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Mapping, Sequence

import tenacity

from checkpointing import layout
from durable import write_atomically
from daemon import actions, cluster, control, device_oom, hang, memcg, policy, processes
from daemon.eventlog import EventLog
from daemon.health import HealthMonitor
from daemon.lock import RunLock
from daemon.metrics import Metrics
from daemon.notify import Notifier
from daemon.protocol import (ENV_COMMANDS, ENV_EVENT_SOCKET, ENV_GENERATION, ENV_MEMORY_LIMIT, ENV_RECOVERY, FAULTS,
                             MAX_SOCKET_PATH_BYTES, Command, ExitCode, Recovery, decode_event)
from daemon.state import RunState
from engine.config import Config, ConfigError

TICK_S = 0.1
CONTROL_EVERY_S = 2.0      # the control directory is scanned when watchdog flags it, and at least this often
FAILED_GRACE_S = 2.0       # teardown grace after a crash or hang: blocked ranks never handle SIGTERM
SAMPLE_RANGES_KEPT = 20000  # recent steps whose sample ranges are remembered (a skip window's source)
_PROCESS_FAULTS = ("crash", "hang", "oom")
_SYSTEMD_ONLY = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")
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
        self.base_cfg = self.cfg = cfg          # cfg: base_cfg with the policy's config changes
        self.worker_cmd, self.scheduler_cmd = list(worker_cmd), scheduler_cmd
        self.env = dict(env)
        self.run_dir = cfg.run.resolved_dir(env)
        self.log_dir = cfg.run.resolved_log_dir(env)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log = EventLog(self.log_dir / "events.jsonl", cfg.run.name, **({"stream": stream} if stream else {}),
                            max_bytes=cfg.run.log_max_bytes, backups=cfg.run.log_backups)
        self.commands_path = self.run_dir / "commands.jsonl"
        self.ckpt_root = self.run_dir / "checkpoints"
        self.world = cfg.parallel.world_size
        self.local_ranks = self.world // cfg.run.nodes    # ranks this node runs
        self.state = RunState()
        self.signals = 0               # SIGTERM/SIGINT received
        self.stop_reason: str | None = None   # a stop asked for by a signal or the control directory
        self.control = control.ControlDir(self.run_dir / "control")
        self.monitor = HealthMonitor(cfg.health, precision=cfg.train.precision,
                                     loss_scale_min=cfg.train.loss_scale_min)
        self.sample_ranges: dict[int, tuple[int, int]] = {}   # step -> global sample range (rank 0's view)
        self.memcg_parent: tuple[int, Path] | None = None
        self.notify = Notifier(self.env)
        self.metrics = Metrics(cfg.run.name)
        self.pause: str | None = None        # None, "pausing", "paused", "releasing" (this generation)
        self.paused_at = 0.0
        self.resume_requested = False        # a resume request while the ranks are released
        self._status_at = 0.0
        self._control_at = 0.0
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
            try:
                control.ensure(self.control.path)
                watcher = self.control.watch()
                metrics_port = self._start_metrics()
                self.cfg = actions.with_changes(self.base_cfg, self.state.config_changes)
                if self.cfg.run.worker_memory_limit_bytes:
                    self.memcg_parent = memcg.locate()
            except (control.ControlDirError, memcg.CgroupError, ConfigError, MetricsPortError) as e:
                self.log.emit("daemon_exit", level="error", code=int(ExitCode.CONFIG_ERROR), reason="config",
                              detail=str(e))
                return ExitCode.CONFIG_ERROR
            self._clean_orphans()
            self.state.daemon_pid = os.getpid()
            self.state.total_steps = self.cfg.train.steps
            self.state.log_dir = str(self.log_dir.resolve())
            self.state.save(self.run_dir)
            self.log.emit("daemon_start", pid=os.getpid(), run_dir=str(self.run_dir.resolve()),
                          control_watcher=watcher, last_committed_step=self._committed_step(),
                          metrics=f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else None)
            self.notify.ready(f"starting; last committed step {self._committed_step()}")
            code = self._loop()
            self.notify.stopping(f"exiting with {int(code)} ({self.state.status})")
            return code
        finally:
            self.metrics.close()
            self.control.close()
            self.notify.close()
            if self.memcg_parent is not None:
                memcg.remove_tree(self.memcg_parent[1] / self._cgroup_dir)
            lock.release()
            self.log.close()

    def _start_metrics(self) -> int | None:
        run = self.cfg.run
        steps = layout.committed_steps(self.ckpt_root)
        if steps:
            self.metrics.update(last_checkpoint_unix_s=layout.step_dir(self.ckpt_root, steps[-1]).stat().st_mtime,
                                step=steps[-1])
        self.metrics.update(restarts=self.state.restarts, generation=self.state.generation)
        for incident in self.state.incidents:
            self.metrics.count_incident(incident["kind"])
        if run.metrics_textfile:
            self.metrics.textfile(Path(run.metrics_textfile))
            self.metrics.flush(force=True)
        if not run.metrics_port:
            return None
        try:
            return self.metrics.serve(run.metrics_port)
        except OSError as e:
            raise MetricsPortError(f"run.metrics_port = {run.metrics_port}: cannot listen on 127.0.0.1: "
                                   f"{e.strerror or e}") from e

    def _on_signal(self, signum, frame) -> None:
        self.signals += 1
        self.stop_reason = self.stop_reason or f"signal {signal.Signals(signum).name}"

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
            if kind == "released":
                code = self._wait_for_resume()
                if code is not None:
                    return code
                continue
            if kind == "final_error":
                self.state.status = "failed"
                self.state.save(self.run_dir)
                self.log.emit("daemon_exit", level="error", code=outcome["code"], reason="worker_error",
                              detail=outcome["detail"])
                return outcome["code"]
            code = self._recover(outcome)
            if code is not None:
                return code

    def _recover(self, outcome: dict) -> int | None:
        """An incident ended the generation: record it, decide, persist the decision, carry it out.
        Returns an exit code when the daemon ends, None to start the next generation."""
        committed = self._committed_step()
        incident = dict(outcome["incident"])
        if incident["kind"] in _PROCESS_FAULTS:
            progressed = committed > self.state.last_committed_step
            self.state.restarts_without_progress = 0 if progressed else self.state.restarts_without_progress + 1
        self.state.last_committed_step = committed
        self.metrics.count_incident(incident["kind"])
        action = policy.decide(incident, self._history(), self.cfg)
        record = {**incident, "generation": self.state.generation, "committed_step": committed,
                  "unix_s": time.time(), "action": actions.describe(action)}
        self.state.incidents.append(record)
        if isinstance(action, policy.Halt):
            self.state.status = "gave_up"
            self.state.save(self.run_dir)                   # the decision is on disk before anything else
            self.log.emit("incident", level="error", **_log_fields(record))
            self.log.emit("gave_up", level="error", code=int(action.code), reason=action.reason,
                          restarts_without_progress=self.state.restarts_without_progress,
                          committed_step=committed, last_incident=record)
            self.log.emit("daemon_exit", level="error", code=int(action.code),
                          reason="crash_loop" if action.code == ExitCode.GAVE_UP_CRASH_LOOP else "numerics")
            return action.code
        self.state.status = "restarting"
        if isinstance(action, policy.Restart) and action.config_changes:
            self.state.config_changes.update(action.config_changes)
        if isinstance(action, policy.Rollback):
            previous = Recovery.from_dict(self.state.recovery) if self.state.recovery else None
            self.state.recovery = actions.merge_recovery(previous, action).to_dict()
        self.state.save(self.run_dir)                       # the decision is on disk before it is acted on
        self.log.emit("incident", level="error", **_log_fields(record))
        if isinstance(action, policy.Restart) and action.config_changes:
            self.cfg = actions.with_changes(self.base_cfg, self.state.config_changes)
        resume = committed
        if isinstance(action, policy.Rollback):
            moved = layout.roll_back(self.ckpt_root, action.checkpoint_step)
            resume = self.state.last_committed_step = self._committed_step()
            self.log.emit("rollback", level="warning", cause=incident["kind"], checkpoint_step=resume,
                          rolled_back_steps=moved, skip=record["action"]["skip"],
                          lr_overrides=record["action"]["lr_overrides"], loss_scale=action.loss_scale,
                          loss_scale_cap_until_step=action.loss_scale_cap_until_step, reason=action.reason)
            delay = self.cfg.health.restart_backoff_initial_s
        else:
            delay = self._backoff(_Attempt(self.state.restarts_without_progress + 1))
        self.state.restarts += 1
        self.state.save(self.run_dir)
        self.metrics.update(restarts=self.state.restarts)
        self.notify.status(f"restarting after {incident['kind']} from step {resume} (restart {self.state.restarts})")
        self.log.emit("restart", level="warning", cause=incident["kind"], rank=incident.get("rank"),
                      detail=incident.get("detail") or record["action"]["reason"], resume_step=resume,
                      backoff_s=round(delay, 3), restarts=self.state.restarts,
                      restarts_without_progress=self.state.restarts_without_progress,
                      config_changes=self.state.config_changes or None)
        if self._sleep(delay):
            self.state.status = "stopped"
            self.state.save(self.run_dir)
            self.log.emit("daemon_exit", code=0, reason="stopped", detail="stop requested during backoff")
            return ExitCode.OK
        return None

    def _wait_for_resume(self) -> int | None:
        """The ranks were released while paused: hold until a resume (None: start the next generation)
        or a stop (exit 0)."""
        self.state.status = "paused"
        self.state.save(self.run_dir)
        self.notify.status(f"paused at step {self._committed_step()}; ranks released")
        self.log.emit("released", step=self._committed_step(),
                      detail="paused past run.pause_release_after_s: ranks stopped; `resume` restarts them")
        self.resume_requested = False
        while not self.resume_requested:
            if self._sleep(1.0):
                self.state.status = "stopped"
                self.state.save(self.run_dir)
                self.log.emit("daemon_exit", code=0, reason="stopped", detail="stop requested while paused")
                return ExitCode.OK
        self.log.emit("resuming", step=self._committed_step())
        return None

    def _history(self) -> policy.RunHistory:
        numeric = [i for i in self.state.incidents
                   if (i.get("action") or {}).get("type") == "rollback"]
        t = self.cfg.train
        return policy.RunHistory(incidents=numeric, committed_steps=layout.committed_steps(self.ckpt_root),
                                 restarts_without_progress=self.state.restarts_without_progress,
                                 recompute=t.recompute, micro_batch=t.micro_batch,
                                 grad_accum_steps=t.grad_accum_steps, sample_ranges=self.sample_ranges)

    def _sleep(self, seconds: float) -> bool:
        """Waits, but returns True at once if a stop is asked for (signal or control file)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.notify.tick()
            self._take_control(None)
            if self.stop_reason:
                return True
            time.sleep(max(0.0, min(TICK_S, deadline - time.monotonic())))
        return bool(self.stop_reason)

    def _append_command(self, name: str, **args) -> None:
        self._seq += 1
        with open(self.commands_path, "a") as f:
            f.write(Command(seq=self._seq, name=name, args=args).to_json() + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.log.emit("command_sent", name=name, seq=self._seq, args=args)

    def _worker_env(self, rank: int, port: int, sock: Path) -> dict[str, str]:
        cfg, world = self.cfg, self.world
        base = {k: v for k, v in self.env.items() if k not in _SYSTEMD_ONLY}   # the daemon speaks for them
        base.update({ENV_EVENT_SOCKET: str(sock), ENV_COMMANDS: str(self.commands_path.resolve())})
        if self.state.recovery:
            base[ENV_RECOVERY] = str(self.recovery_path.resolve())
        if cfg.run.worker_memory_limit_bytes:
            base[ENV_MEMORY_LIMIT] = str(cfg.run.worker_memory_limit_bytes)
        if cfg.run.compile_cache:
            base.update(MS_COMPILER_CACHE_ENABLE="1", MS_COMPILER_CACHE_PATH=str(self._compile_cache_dir()))
        if world == 1:
            base[ENV_GENERATION] = str(self.state.generation)
            return base
        return cluster.process_env(base, role=cluster.WORKER, sched_host=cfg.run.master_addr, sched_port=port,
                                   worker_num=world, local_worker_num=self.local_ranks, node_id=rank,
                                   generation=self.state.generation)

    def _compile_cache_dir(self) -> Path:
        """One cache per graph-shaping config: MindSpore reuses a cached graph of another shape (say,
        before the policy halved the micro-batch) and then fails with "Parameter[N] has no default
        param". Keyed by every section but the daemon's own."""
        shaping = {k: v for k, v in self.cfg.to_dict().items() if k not in ("run", "health", "checkpoint")}
        key = hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]
        return (self.run_dir / "compile_cache" / key).resolve()

    @property
    def _cgroup_dir(self) -> str:
        """The run's directory under the daemon's memory cgroup: one child per rank and generation."""
        return f"llm-pretrain-{self.cfg.run.name}"

    @property
    def recovery_path(self) -> Path:
        return self.run_dir / "recovery.json"

    def _prepare_generation(self) -> int:
        """Commands file, recovery directive, detectors: ready for a generation; returns its resume step."""
        self._seq = 0
        self.commands_path.write_text("")               # commands are per generation
        if self.state.recovery:
            write_atomically(self.recovery_path, Recovery.from_dict(self.state.recovery).to_json())
        else:
            self.recovery_path.unlink(missing_ok=True)
        resume = self._committed_step()
        self.monitor.rewind(resume)
        return resume

    def _spawn_rank(self, rank: int, port: int, sock_path: Path) -> tuple[processes.Worker, memcg.MemoryCgroup | None]:
        group = None
        if self.memcg_parent is not None:
            group = memcg.MemoryCgroup.create(self.memcg_parent,
                                              f"{self._cgroup_dir}/g{self.state.generation}-rank-{rank}",
                                              self.cfg.run.worker_memory_limit_bytes)
        cmd = [*self.worker_cmd, *actions.set_args(self.state.config_changes)]
        worker = processes.spawn(cmd, env=self._worker_env(rank, port, sock_path), role="rank", rank=rank,
                                 log_path=self.log_dir / f"rank-{rank}.log",
                                 before_exec=group.join if group else None)
        return worker, group

    def _generation(self) -> dict:
        cfg = self.cfg
        self.state.generation += 1
        self.log.generation = self.state.generation
        self.pause = None
        self.metrics.update(generation=self.state.generation)
        resume = self._prepare_generation()
        world, local = self.world, self.local_ranks
        ranks = range(cfg.run.node_rank * local, (cfg.run.node_rank + 1) * local)
        port = cfg.run.master_port or cluster.free_port(cfg.run.master_addr)
        sock_path = socket_path(cfg, self.run_dir, self.env)
        sock_path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(sock_path))
        sock.setblocking(False)
        workers: list[processes.Worker] = []
        groups: dict[int, memcg.MemoryCgroup] = {}
        outcome: dict = {"outcome": "crash"}
        try:
            if world > 1 and cfg.run.node_rank == 0 and self.scheduler_cmd:
                sched_env = cluster.process_env(self.env, role=cluster.SCHEDULER, sched_host=cfg.run.master_addr,
                                                sched_port=port, worker_num=world, local_worker_num=local,
                                                generation=self.state.generation)
                workers.append(processes.spawn(self.scheduler_cmd, env=sched_env, role="scheduler", rank=-1,
                                               log_path=self.log_dir / "scheduler.log"))
            for rank in ranks:
                worker, group = self._spawn_rank(rank, port, sock_path)
                workers.append(worker)
                if group is not None:
                    groups[rank] = group
            self.state.processes = [w.record() for w in workers]
            self.state.status = "running"
            self.state.save(self.run_dir)
            self.log.emit("generation_start", ranks=list(ranks), port=port,
                          pids={w.rank: w.pid for w in workers}, resume_step=resume,
                          memory_limit_bytes=cfg.run.worker_memory_limit_bytes or None,
                          config_changes=self.state.config_changes or None)
            outcome = self._watch(workers, sock, groups)
            return outcome
        finally:
            # numerical incidents: the ranks' state is being thrown away, kill at once; crashes and
            # hangs: ranks blocked in a collective never run their SIGTERM handler, keep it short
            kind = outcome["outcome"]
            grace = cfg.run.kill_grace_s if kind in ("finished", "stopped", "final_error", "released") else \
                0.0 if kind == "incident" and outcome["incident"]["kind"] not in _PROCESS_FAULTS else \
                min(cfg.run.kill_grace_s, FAILED_GRACE_S)
            processes.stop_all(workers, grace_s=grace)
            self.state.processes = []
            self.state.save(self.run_dir)
            sock.close()
            sock_path.unlink(missing_ok=True)
            if groups:
                self.log.emit("generation_end", outcome=kind,
                              peak_memory_bytes={r: g.peak_bytes() for r, g in groups.items()},
                              oom_kills={r: g.oom_kills() for r, g in groups.items()})
                for g in groups.values():
                    g.remove()

    # The control directory ----------------------------------------------------
    def _take_control(self, now: float | None) -> None:
        """Consumes control files (at most every CONTROL_EVERY_S); `now` is None between generations,
        when there are no ranks to send commands to."""
        t = time.monotonic()
        if not self.control.changed() and t - self._control_at < CONTROL_EVERY_S:
            return
        self._control_at = t
        for req in self.control.take():
            if isinstance(req, control.Rejected):
                self.log.emit("control_rejected", level="warning", file=req.file, detail=req.reason)
                continue
            self.log.emit("control", name=req.name, file=req.file, body=req.body or None)
            self.state.last_control = {"name": req.name, "file": req.file, "unix_s": time.time(),
                                       "reason": req.body.get("reason")}
            self.state.save(self.run_dir)
            if req.name == "stop":
                self.stop_reason = self.stop_reason or f"control file {req.file}" + (
                    f": {req.body['reason']}" if req.body.get("reason") else "")
            elif now is None:
                if req.name == "resume" and self.state.status == "paused":
                    self.resume_requested = True
                else:
                    self.log.emit("control_ignored", level="warning", name=req.name,
                                  detail="no ranks are running (between generations)")
            elif req.name == "checkpoint":
                self._append_command("checkpoint")
            elif req.name == "inject":
                self._forward_inject(req)
            elif req.name == "pause":
                if self.pause is None:
                    self.pause = "pausing"
                    self.state.status = "pausing"
                    self.state.save(self.run_dir)
                    self._append_command("pause")
                else:
                    self.log.emit("control_ignored", level="warning", name="pause", detail=f"already {self.pause}")
            elif req.name == "resume":
                if self.pause in ("pausing", "paused"):
                    self.pause = None
                    self.state.status = "running"
                    self.state.save(self.run_dir)
                    self._append_command("resume")
                else:
                    self.log.emit("control_ignored", level="warning", name="resume", detail="not paused")

    def _forward_inject(self, req: control.Request) -> None:
        body, h = req.body, self.cfg.health
        if not h.allow_fault_injection:
            self.log.emit("control_rejected", level="warning", file=req.file,
                          detail="fault drills are off: set health.allow_fault_injection = true")
            return
        fault, rank = body.get("fault"), body.get("rank", 0)
        problem = None
        if fault not in FAULTS:
            problem = f"fault {fault!r} is not one of {', '.join(FAULTS)}"
        elif not isinstance(rank, int) or not 0 <= rank < self.world:
            problem = f"rank {rank!r} is not in [0, {self.world})"
        elif any(body.get(k) is not None and not isinstance(body[k], (int, float)) or
                 isinstance(body.get(k), bool) for k in ("at_step", "steps", "seconds")):
            problem = "at_step, steps and seconds must be numbers"
        if problem:
            self.log.emit("control_rejected", level="warning", file=req.file, detail=problem)
            return
        self._append_command("inject", **{k: body[k] for k in ("fault", "rank", "at_step", "steps", "seconds")
                                          if body.get(k) is not None})

    def _watch(self, workers: list[processes.Worker], sock: socket.socket,
               groups: Mapping[int, memcg.MemoryCgroup]) -> dict:
        cfg = self.cfg
        ranks = [w for w in workers if w.role == "rank"]
        watched = ranks[0].rank           # its step events feed the detectors (the metrics are global)
        started = time.monotonic()
        progress = {w.rank: hang.RankProgress(since_s=started) for w in ranks}
        steps = hang.StepTimes()
        first_step_seen: set[int] = set()
        exits: dict[int, dict] = {}
        stop_sent_at: float | None = None
        last_step_log = 0.0
        last_step = 0
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
                    p.phase, p.step = event.phase, event.step or p.step
                    if event.phase == "paused" and self.pause == "pausing" and \
                            all(q.phase == "paused" for q in progress.values()):
                        self.pause, self.paused_at = "paused", now
                        self.state.status = "paused"
                        self.state.save(self.run_dir)
                        steps_at = {r: q.step for r, q in progress.items()}
                        self.log.emit("paused", step=event.step, rank_steps=steps_at,
                                      release_after_s=cfg.run.pause_release_after_s)
                        self.notify.status(f"paused at step {event.step}")
                elif event.kind == "step":
                    p.phase, p.step = "train", event.step
                    if event.rank in first_step_seen:
                        steps.add(event.step_s)
                    first_step_seen.add(event.rank)
                    if event.rank != watched:
                        continue
                    last_step = event.step
                    if now - self._status_at >= 2.0:
                        self._status_at = now
                        self.notify.status(f"step {event.step}/{cfg.train.steps} loss {event.loss:.4f} "
                                           f"{event.tokens_per_s:.0f} tokens/s generation {self.state.generation}")
                    if now - last_step_log >= 10.0 or event.step == cfg.train.steps:
                        last_step_log = now
                        self.log.emit("progress", step=event.step, loss=event.loss, lr=event.lr,
                                      tokens_per_s=round(event.tokens_per_s, 1), skipped=event.skipped)
                        self.state.last_progress = {"step": event.step, "loss": event.loss, "lr": event.lr,
                                                    "tokens": event.tokens,
                                                    "tokens_per_s": event.tokens_per_s, "unix_s": time.time()}
                        self.state.save(self.run_dir)
                    self.metrics.update(step=event.step, loss=event.loss, tokens_per_s=event.tokens_per_s)
                    self.metrics.flush()
                    incident = self._observe(event)
                    if incident is not None:
                        incident["last_step"] = max(incident["last_step"], last_step)
                        return {"outcome": "incident", "incident": incident}
                elif event.kind == "checkpoint" and event.stage in ("committed", "failed", "quarantined"):
                    if event.stage == "committed":
                        self.metrics.update(last_checkpoint_unix_s=time.time())
                    self.log.emit(f"checkpoint_{event.stage}", level="info" if event.stage == "committed"
                                  else "error", rank=event.rank, step=event.step, detail=event.detail)
                elif event.kind == "exit":
                    exits[event.rank] = {"reason": event.reason, "step": event.step}
            # 2. control files and stop requests
            self.notify.tick(now)
            self._take_control(now)
            if self.stop_reason and stop_sent_at is None:
                stop_sent_at = now
                self.log.emit("stopping", detail=f"{self.stop_reason}: checkpoint at the next step, then exit",
                              timeout_s=cfg.run.stop_timeout_s)
                self._append_command("stop")
            if self.pause == "paused" and now - self.paused_at > cfg.run.pause_release_after_s:
                self.pause = "releasing"
                self._append_command("release")
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
                step = progress[w.rank].step
                oom = self._oom_evidence(w, code, groups.get(w.rank))
                if oom is not None:
                    self.log.emit("oom", level="error", rank=w.rank, step=step, log=str(w.log_path), **oom)
                    return {"outcome": "incident", "incident": {
                        "kind": "oom", "rank": w.rank, "exit_code": code, "step": step, "first_step": step,
                        "last_step": step, "detail": f"rank {w.rank} ran out of memory ({cause})",
                        "evidence": oom}}
                self.log.emit("crash", level="error", rank=w.rank, exit_code=code, cause=cause,
                              step=step, log=str(w.log_path))
                return {"outcome": "incident", "incident": {
                    "kind": "crash", "rank": w.rank, "exit_code": code, "step": step, "first_step": step,
                    "last_step": step, "detail": f"rank {w.rank}: {cause}"}}
            if all(w.popen.poll() == 0 for w in ranks):
                reasons = {e["reason"] for e in exits.values()}
                kind = "stopped" if stop_sent_at is not None or "stopped" in reasons else \
                    "released" if "released" in reasons else "finished"
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
                    step = progress[w.rank].step
                    self.log.emit("hang", level="error", rank=w.rank, phase=progress[w.rank].phase,
                                  step=step, waited_s=round(waited, 2), timeout_s=round(limit, 2),
                                  log=str(w.log_path))
                    return {"outcome": "incident", "incident": {
                        "kind": "hang", "rank": w.rank, "phase": progress[w.rank].phase, "step": step,
                        "first_step": step, "last_step": step, "waited_s": round(waited, 2),
                        "timeout_s": round(limit, 2), "detail": f"rank {w.rank} made no progress in "
                        f"{waited:.1f} s ({progress[w.rank].phase}, limit {limit:.1f} s)"}}
            time.sleep(TICK_S)

    def _oom_evidence(self, worker: processes.Worker, code: int,
                      group: memcg.MemoryCgroup | None) -> dict | None:
        """Out of memory, not another crash: a SIGKILL the rank's cgroup counted as an OOM kill, or
        (Ascend) the device allocator's error in the rank's log."""
        if code in (-signal.SIGKILL, 128 + signal.SIGKILL) and group is not None and group.oom_kills():
            return {"signal": "cgroup oom_kill", "limit_bytes": self.cfg.run.worker_memory_limit_bytes,
                    "oom_kills": group.oom_kills(), "peak_bytes": group.peak_bytes()}
        if code > 0 and (line := device_oom.oom_line(worker.log_path, worker.log_start)) is not None:
            return {"signal": "device out of memory in the rank's log", "line": line}
        return None

    def _observe(self, event) -> dict | None:
        """One step of the watched rank through the detectors: warnings are logged and recorded; the
        first incident that needs action is returned."""
        # re-inserted (a replayed step moves to the end), so the first key is always the oldest seen
        self.sample_ranges.pop(event.step, None)
        self.sample_ranges[event.step] = (event.sample_start, event.sample_end)
        if len(self.sample_ranges) > SAMPLE_RANGES_KEPT:
            del self.sample_ranges[next(iter(self.sample_ranges))]
        for incident in self.monitor.observe({"step": event.step, "loss": event.loss,
                                              "grad_norm": event.grad_norm, "loss_scale": event.loss_scale,
                                              "skipped": event.skipped, "tokens_per_s": event.tokens_per_s}):
            record = incident.to_dict()
            if incident.action_needed:
                self.log.emit("incident_detected", level="error", kind=incident.kind, step=event.step,
                              first_step=incident.first_step, evidence=incident.evidence)
                return record
            self.metrics.count_incident(incident.kind)
            record.update(generation=self.state.generation, unix_s=time.time(), action=None)
            self.state.incidents.append(record)
            self.state.save(self.run_dir)
            self.log.emit("health_warning", level="warning", **_log_fields(record))
        return None

    def _dump_stacks(self, workers: Sequence[processes.Worker]) -> None:
        """faulthandler in each worker writes every thread's Python stack to its log on SIGUSR1."""
        for worker in workers:
            try:
                os.kill(worker.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(1.0)


class MetricsPortError(RuntimeError):
    """The metrics port cannot be listened on."""


def _log_fields(record: dict) -> dict:
    """An incident record as event fields (`kind` names the incident; `event` is the log's own)."""
    return {k: v for k, v in record.items() if k not in ("event", "level", "unix_s")}


class _Attempt:
    """The little of tenacity's RetryCallState that its wait strategies read."""

    def __init__(self, attempt_number: int):
        self.attempt_number = attempt_number
