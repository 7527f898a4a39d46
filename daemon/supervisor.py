"""The supervisor: runs this node's ranks as generations, watches them, and brings them back.

The main loop of `llm-pretrain run`, shaped like torch elastic's `_invoke_run`: start a generation
(processes.generation) → monitor it (judging.watch: a pure state machine fed events, exits, control
requests and the time) → branch on its typed outcome → recover (acting.decisions: the policy's decision,
on disk before it is carried out) → the next generation, with the config resolved at the daemon's
start plus the policy's changes (`<run.dir>/config.resolved.toml`). Never imports MindSpore; the
worker command is an argument (tests use a fake).
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Mapping, Sequence

from contracts.config import Config, with_changes
from contracts.errors import ConfigError
from contracts.protocol import ExitCode
from daemon.acting import decisions, effects_of_watch, peers
from daemon.judging import watch
from daemon.judging.health import HealthMonitor
from daemon.judging.incidents import Halt, Incident, Kind
from daemon.machines.nodes import Nodes
from daemon.processes import control, memcg, standby
from daemon.processes.generation import Generation, end_previous_daemons_leftovers, socket_path
from daemon.processes.lock import LockHeldError, LockUnusableError, RunLock
from daemon.processes.run_files import RunFiles
from daemon.records.eventlog import EventLog
from daemon.records.ledger import Ledger
from daemon.records.metrics import Metrics, MetricsPortError
from daemon.records.notify import Notifier

TICK_S = 0.1


class Supervisor:
    def __init__(self, cfg: Config, *, worker_cmd: Sequence[str], scheduler_cmd: Sequence[str] | None,
                 env: Mapping[str, str] = os.environ, stream=None):
        self.base_cfg = self.cfg = cfg          # cfg: base_cfg with the policy's config changes
        self.worker_cmd, self.scheduler_cmd = list(worker_cmd), scheduler_cmd
        self.env, self.stream = dict(env), stream
        self.files = RunFiles(cfg, self.env)
        self.signals = 0                        # SIGTERM/SIGINT received
        self.stop_reason: str | None = None     # a stop asked for by a signal or the control directory
        self.stop_code = ExitCode.OK            # the exit code of that stop (75: etcd gone too long)
        self.control = control.ControlDir(self.files.node_dir / "control")
        self.monitor = HealthMonitor(cfg.health, precision=cfg.train.precision, loss_scale_min=cfg.train.loss_scale_min)
        self.memcg_parent: tuple[int, Path] | None = None
        self.ledger: Ledger | None = None       # made once the lock is held: it writes into the run
        self.backoff = decisions.Backoff(cfg.health)
        self.peers: peers.Peers = Nodes(cfg) if cfg.run.nodes > 1 else peers.Alone(self.env)
        self.spare = standby.Keeper(self.files, self.env, worker_cmd=worker_cmd, scheduler_cmd=scheduler_cmd)

    @property
    def state(self):
        return self.ledger.state

    # Entry point -------------------------------------------------------------------------------
    def run(self) -> int:
        """Takes the run's lock before anything is written into the run directory."""
        lock, stream = RunLock(self.files.node_dir), {"stream": self.stream} if self.stream else {}
        try:
            lock.acquire()
        except (LockHeldError, LockUnusableError) as e:    # not a word into the run's log
            held = isinstance(e, LockHeldError)
            EventLog(None, self.cfg.run.name, **stream).emit("locked" if held else "daemon_exit", level="error",
                                                            detail=str(e), **({} if held else {"code": 78}))
            return ExitCode.LOCKED if held else ExitCode.CONFIG_ERROR
        log = EventLog(self.files.log_dir / "events.jsonl", self.cfg.run.name, **stream,
                       max_bytes=self.cfg.run.log_max_bytes, backups=self.cfg.run.log_backups)
        self.ledger = Ledger(self.files.node_dir, log, Metrics(self.cfg.run.name), Notifier(self.env),
                             self.cfg.train.steps)
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
            signal.signal(signal.SIGHUP, lambda *_: setattr(self.ledger, "reopen_requested", True))
            code = self._start() or self._loop()      # _start returns an exit code only to end at once
            self.peers.finish(code, self.state.status, self.ledger.exit_reason)
            self.ledger.notify.stopping(f"exiting with {int(code)} ({self.state.status})")
            return code
        finally:
            self.spare.retire()
            self.peers.close()
            self.ledger.metrics.close()
            self.control.close()
            self.ledger.notify.close()
            if self.memcg_parent is not None:
                memcg.remove_tree(self.memcg_parent[1] / self.files.cgroup_dir)
            lock.release()
            log.close()

    def _start(self) -> int | None:
        ledger = self.ledger
        try:
            control.ensure(self.control.path)
            watcher = self.control.watch()
            metrics_url = ledger.metrics.start(self.cfg, self.state, self.files.ckpt_root)
            self.cfg = with_changes(self.base_cfg, self.state.config_changes)
            self.memcg_parent = memcg.locate() if self.cfg.run.worker_memory_limit_bytes else None
            self.peers.start(ledger, self.files)
        except (control.ControlDirError, memcg.CgroupError, ConfigError, MetricsPortError,
                peers.PeersUnavailableError) as e:
            code = getattr(e, "code", ExitCode.CONFIG_ERROR)
            ledger.emit("daemon_exit", level="error", code=int(code), reason="config", detail=str(e))
            return code
        if killed := end_previous_daemons_leftovers(self.state.processes, self.cfg.run.kill_grace_s):
            ledger.emit("orphans_killed", level="warning", pids=[r["pid"] for r in killed],
                        detail="workers of a previous daemon were still running")
        ledger.begin(total_steps=self.cfg.train.steps, log_dir=self.files.log_dir.resolve())
        if self.state.pending_rollback is not None and self.peers.is_leader:   # recorded by a daemon that died
            decisions.finish_rollback(ledger, self.files, detail="finishing the rollback a killed daemon had recorded")
        committed = self.files.committed_step()
        ledger.emit("daemon_start", pid=os.getpid(), run_dir=str(self.files.run_dir), control_watcher=watcher,
                    last_committed_step=committed, metrics=metrics_url)
        ledger.notify.ready(f"starting; last committed step {committed}")
        return None

    def _on_signal(self, signum, frame) -> None:
        self.signals += 1
        self.stop_reason = self.stop_reason or f"signal {signal.Signals(signum).name}"

    # Generations -------------------------------------------------------------------------------
    def _loop(self) -> int:
        self.ledger.note_committed(self.files.resume_step())      # either tier's: what a restart's progress is judged by
        undecided = self.peers.unfinished(self.ledger)          # multi-node: ended while this daemon was away
        while True:
            try:
                outcome = watch.Failed(undecided) if undecided else self._generation()
                undecided = None
                if isinstance(outcome, (watch.Finished, watch.Stopped, watch.WorkerFailed, watch.Ended)):
                    return decisions.end_as(outcome, self.ledger, stop_code=self.stop_code,
                                            stop_reason=self.stop_reason)
                if isinstance(outcome, watch.Regroup):        # a lost node, or a quarantined device, is back
                    continue
                code = self._wait_for_resume() if isinstance(outcome, watch.Released) else self._recover(outcome.incident)
            except peers.PeersUnavailableError as e:     # too few nodes, or etcd gone too long
                return self.ledger.exit(e.code, "failed", "nodes", "error", detail=str(e))
            if code is not None:
                return code

    def _generation(self) -> watch.Outcome:
        cfg, ledger = self.cfg, self.ledger
        try:
            opened = self.peers.open(ledger, self.files, self.base_cfg, stopping=lambda: self._sleep(0) == "stop")
        except OSError as e:              # a full or read-only run directory: a crash, with backoff
            return watch.Failed(Incident(kind=Kind.CRASH, first_step=0, last_step=0, detail=(
                f"cannot write the generation's files under {self.files.run_dir}: {e.strerror or e}")))
        if opened is None:
            return self.peers.ended_run() or watch.Stopped(self.files.committed_step())
        if isinstance(opened, watch.Failed):           # multi-node: a lost decider's undecided incident
            return opened
        n, port, resume, ranks = opened.number, opened.port, opened.resume_step, list(opened.ranks)
        self.cfg = cfg = opened.cfg
        self.monitor.rewind(resume)
        gen = Generation(cfg, number=n, sock_path=socket_path(cfg, self.files.node_dir, self.env),
                         log_dir=self.files.log_dir, memcg_parent=self.memcg_parent, cgroup_dir=self.files.cgroup_dir)
        outcome: watch.Outcome | None = None
        try:
            with gen:
                port = gen.launch(self.files, self.env, worker_cmd=self.worker_cmd, port=port, ranks=ranks,
                                  scheduler_cmd=self.scheduler_cmd if opened.scheduler else None,
                                  standby=self.spare.claim(opened, gen.sock_path, ledger))
                self.ledger.note_processes([w.record() for w in gen.workers])
                tier = ledger.running_from(resume, self.files.tier_of(resume))   # a RAM tier's step, or the disk's
                ledger.emit("generation_start", ranks=ranks, port=port, pids={w.rank: w.pid for w in gen.workers},
                            resume_step=resume, resume_tier=tier, memory_limit_bytes=cfg.run.worker_memory_limit_bytes or None,
                            config_changes=self.state.config_changes or None, standby=gen.from_standby)
                w = watch.Watch(cfg, generation=n, ranks=ranks, monitor=self.monitor, now=time.monotonic(), homes=opened.homes,
                                rerun=self.state.rerun, drills=self.files.faulty_devices(),
                                log_paths={r.rank: str(r.log_path) for r in gen.ranks}, stop_reason=self.stop_reason)
                outcome = self._watch(gen, w, n)
                if isinstance(outcome, watch.Failed) and outcome.incident.evidence.get("cut_off"):   # multi-node
                    ledger.emit("cut_off", level="warning", detail=outcome.incident.detail)
                outcome = self.peers.conclude(n, outcome, requested=w.stop_sent_at is not None or bool(self.stop_reason))
                ledger.generation_over(getattr(outcome, "incident", None))
                gen.grace_s, gen.writers_grace_s = watch.teardown_graces(outcome, cfg.run.kill_grace_s, saving=w.saving)
        finally:
            self.ledger.note_processes(self.spare.records())     # a standby waits on through recovery
            ledger.save()
            if gen.final_memory:
                ledger.emit("generation_end", outcome=type(outcome).__name__.lower(), **gen.final_memory)
        return outcome

    def _watch(self, gen: Generation, w: watch.Watch, n: int) -> watch.Outcome:
        while True:
            now = time.monotonic()
            ended = gen.new_exits()          # before the events: a rank's last datagram precedes its exit
            for event in self.spare.sift(gen.events(), now, self.ledger):    # a standby's own go no further
                w.on_event(event, now)
            self._apply(w.drain(), gen)
            self.ledger.tick(now)
            for request in [*self.control.intake(self.ledger), *self.peers.requests()]:
                if not self.peers.forward(request):        # the decider writes the ranks' commands for all
                    w.on_control(request, now)
            if (elsewhere := self.peers.hear(n, now, idle_s=w.stalled_s(now))) is not None:
                return elsewhere
            if self.peers.cut_off(now) and not self.stop_reason:
                self.stop_reason, self.stop_code = "etcd unreachable past run.coordinator_timeout_s", ExitCode.TEMP_FAIL
            if self.stop_reason:
                w.request_stop(self.stop_reason, now, force=self.signals > 1)
            for e in ended:
                w.on_exit(e.rank, e.code, now, oom_kills=e.oom_kills, peak_bytes=e.peak_bytes,
                          device_oom_line=e.device_oom_line, refusal=e.refusal, error_line=e.error_line, hccl=e.hccl)
            outcome = w.tick(now, phases=gen.phases(), stopped=gen.stopped())
            self._apply(w.drain(), gen)
            if outcome is not None:
                return outcome
            self.spare.tick(self.cfg, gen, w, self.ledger, self.memcg_parent)
            gen.wait(TICK_S)

    def _apply(self, effects: list[watch.Effect], gen: Generation) -> None:
        effects_of_watch.carry_out(effects, ledger=self.ledger, gen=gen, peers=self.peers, files=self.files, cfg=self.cfg)

    # Between generations -----------------------------------------------------------------------
    def _recover(self, incident: Incident) -> int | None:
        """An incident ended the generation: decide, record, carry out. An exit code ends the daemon."""
        decision = self.peers.recover(incident, ledger=self.ledger, files=self.files, cfg=self.cfg,
                                      base_cfg=self.base_cfg, stopping=lambda: self._sleep(0) == "stop")
        if decision is None:          # a stop here, or (multi-node) the run ended by its decider
            if (ended := self.peers.ended_run()) is not None and not isinstance(ended, watch.Stopped):
                return decisions.end_as(ended, self.ledger, stop_code=self.stop_code, stop_reason=None)
            return self.ledger.exit(ExitCode.OK, "stopped", "stopped", detail="stop requested awaiting the decision")
        if isinstance(decision.action, Halt):
            return decisions.give_up(decision, self.ledger, self.files)
        self.cfg = decision.cfg
        delay = self.backoff.after(decision, self.state) if self.peers.is_leader else 0
        decisions.count_restart(decision, self.ledger, backoff_s=delay)
        if self._sleep(delay) == "stop":
            return self.ledger.exit(ExitCode.OK, "stopped", "stopped", detail="stop requested during backoff")
        return None

    def _wait_for_resume(self) -> int | None:
        """The ranks were released while paused: hold until a resume (None) or a stop (exit 0)."""
        step = self.files.committed_step()
        self.spare.retire()                      # released to free the machine: the standby too
        self.ledger.set_status("paused", f"paused at step {step}; ranks released")
        self.ledger.emit("released", step=step,
                         detail="paused past run.pause_release_after_s: ranks stopped; `resume` restarts them")
        while (woken := self._sleep(1.0, paused=True)) is None:
            pass
        if woken == "resume":
            self.ledger.emit("resuming", step=step)
            return None
        return self.ledger.exit(ExitCode.OK, "stopped", "stopped", detail="stop requested while paused")

    def _sleep(self, seconds: float, *, paused: bool = False) -> str | None:
        """Waits (at least one look at the control directory), handling control requests while no ranks
        run: "stop" at once if a stop is asked for, "resume" if one comes while `paused`, None when
        the time is up. On a node that does not decide the requests go to the decider."""
        deadline = time.monotonic() + seconds
        while True:
            self.ledger.tick()
            for request in self.control.intake(self.ledger):
                if self.peers.forward(request):
                    continue
                decision = watch.idle_control(request, paused=paused)
                self.stop_reason = self.stop_reason or decision.stop_reason
                if decision.note:
                    self.ledger.emit(decision.note.event, level=decision.note.level, **decision.note.fields)
                if decision.resume and not self.stop_reason:
                    return "resume"
            if self.stop_reason:
                return "stop"
            if (left := deadline - time.monotonic()) <= 0:
                return None
            time.sleep(min(TICK_S, left))
