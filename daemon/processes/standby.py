"""A warm standby: the next generation's processes, started while this one trains, waiting to be its ranks.

Owns: when a standby may be used, starting it, handing it its generation, and
retiring it (the worker's half is engine/rank/standby.py). A restart that finds one
skips the ranks' interpreter start, MindSpore's import and the dynamic
cluster's formation — on CPU most of the time between a crash and the next
generation's first step (bench/recovery.py; the figures are in the README).

Where it is safe only: the CPU device (on Ascend a standby would claim the
devices and HCCL of the generation that still trains); on one node, an automatic
master port (a fixed one is held by the training generation). On several nodes
no daemon knows the next generation's scheduler (its address, its port) before
the decider publishes it in etcd: there the standby is *late* — its ranks start
the interpreter and import MindSpore and the engine, then wait, and form the
cluster once activated with the generation's environment (on the decider's
machine a scheduler likewise imports and waits). A standby is used only for a generation with the config
and ranks it started with and the MindSpore environment it read (all of it once its cluster formed);
a late one has read no config yet (the rank reads the generation's once activated) and no cluster
variable, so it fits any generation that gives this machine the same ranks, under the same memory
limit, with the same MindSpore environment but for the cluster's address and membership and the
compile cache's path (read at the first compile: measured): a run shrunk or regrown around this
machine uses it. Otherwise it is retired and the generation starts cold.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

from contracts.config import Config
from contracts.protocol import ENV_LOG_PATH, ENV_STANDBY_FD, ENV_STANDBY_LATE, PhaseEvent, activation_line
from daemon.processes import mindspore_env
from daemon.processes.generation import Worker, spawn, spawn_rank, stop_all

RETIRE_GRACE_S = 0.5      # a retired standby exits on its own when its pipe closes
FORM_TIMEOUT_S = 60.0     # a standby not formed by then is stuck (it takes ~5 s on CPU): not used
PIPE_BYTES = 60_000       # an activation must fit the pipe's buffer (64 KiB on Linux): the write never blocks


SCHEDULER = -1            # the scheduler's key among the standby's processes and pipes
# what a late standby's ranks read only when activated: the cluster's address and membership
CLUSTER_VARIABLES = ("MS_ROLE", "MS_SCHED_HOST", "MS_SCHED_PORT", "MS_WORKER_NUM", "MS_LOCAL_WORKER_NUM", "MS_NODE_ID")
# what MindSpore reads only once it compiles or forms its cluster: a late standby has read none of it
READ_AFTER_ACTIVATION = (*CLUSTER_VARIABLES, "MS_COMPILER_CACHE_PATH")


def wanted(cfg: Config) -> bool:
    """Whether this run keeps a standby (run.standby, where it is safe: see the module's docstring)."""
    return (cfg.run.standby and cfg.train.device == "cpu" and not cfg.script.command   # a script starts cold
            and (cfg.run.nodes > 1 or cfg.run.master_port == 0 or cfg.parallel.world_size == 1))


def _mindspore_env(env: Mapping[str, str], *, late: bool = False) -> dict[str, str]:
    """What a process's MindSpore has read by the time its cluster formed (a late standby: before)."""
    return {k: v for k, v in env.items() if k.startswith(("MS_", "GLOG_")) and not (late and k in READ_AFTER_ACTIVATION)}


@dataclasses.dataclass
class Standby:
    cfg: Config
    port: int
    ranks: tuple[int, ...]
    envs: dict[int, dict[str, str]]        # each rank's environment as started
    workers: list[Worker]                  # the scheduler (with more than one rank) and the ranks
    pipes: dict[int, int]                  # rank → the write end of its activation pipe
    late: bool = False                     # forms its cluster once activated (several nodes)
    started_at: float = dataclasses.field(default_factory=time.monotonic)
    ready_s: float | None = None           # seconds from start until every rank had formed its cluster
    _ready: set[int] = dataclasses.field(default_factory=set)

    @classmethod
    def none(cls, cfg: Config) -> "Standby":
        """No processes: what a generation keeps after a standby failed to start (it is not retried)."""
        return cls(cfg, 0, (), {}, [], {})

    @classmethod
    def start(cls, cfg: Config, files, env: Mapping[str, str], *, number: int, ranks: Sequence[int],
              worker_cmd: Sequence[str], scheduler_cmd: Sequence[str] | None, sock_path: Path,
              memcg_parent: tuple[int, Path] | None, cgroup_dir: str) -> "Standby":
        """Starts the processes of generation `number` (as far as anyone can tell now) with `files`'
        environments (a daemon.processes.run_files.RunFiles); they form their cluster (a late standby: not yet)
        and wait."""
        late = cfg.run.nodes > 1
        if late:
            port = cfg.run.master_port           # a placeholder: the generation's is told at activation
        else:
            port = mindspore_env.free_port(cfg.run.master_addr) if cfg.parallel.world_size > 1 else 0
        standby = cls(cfg, port, tuple(ranks), {}, [], {}, late=late)
        try:
            if cfg.parallel.world_size > 1 and scheduler_cmd and not mindspore_env.is_local_group(cfg):
                sched_env, fds = files.scheduler_env(env, cfg, port=port, generation=number), ()
                if late:                 # imports, then waits for the generation's port like the ranks
                    read_end, standby.pipes[SCHEDULER] = os.pipe()
                    sched_env, fds = {**sched_env, ENV_STANDBY_FD: str(read_end)}, (read_end,)
                try:
                    standby.workers.append(spawn(scheduler_cmd, env=sched_env, role="scheduler", rank=SCHEDULER,
                                                 log_path=files.log_dir / "scheduler.log",
                                                 parent_death_signal=signal.SIGTERM,   # no ranks may come to end it
                                                 pass_fds=fds))
                finally:
                    for fd in fds:
                        os.close(fd)
            for rank in ranks:
                standby.envs[rank] = files.rank_env(env, cfg, rank=rank, port=port, generation=number, sock=sock_path)
                read_end, standby.pipes[rank] = os.pipe()
                try:
                    standby.workers.append(spawn_rank(
                        cfg, rank, [*worker_cmd, "--config", str(files.resolved_config)],
                        {**standby.envs[rank], ENV_STANDBY_FD: str(read_end), **({ENV_STANDBY_LATE: "1"} if late else {})},
                        log_dir=files.log_dir,
                        memcg_parent=memcg_parent, cgroup_name=f"{cgroup_dir}/standby-g{number}-rank-{rank}",
                        pass_fds=(read_end,)))
                finally:
                    os.close(read_end)
        except BaseException:
            standby.retire()
            raise
        return standby

    def ready(self, rank: int, now: float) -> bool:
        """Rank `rank` reported its cluster formed; True when that makes every rank ready."""
        if rank not in self.ranks or self.ready_s is not None:
            return False
        self._ready.add(rank)
        if self._ready == set(self.ranks):
            self.ready_s = round(now - self.started_at, 2)
            return True
        return False

    def unusable(self, cfg: Config, ranks: Sequence[int], envs: Mapping[int, Mapping[str, str]],
                 now: float) -> str | None:
        """Why this standby cannot be the generation of `cfg` and `ranks` whose ranks would get `envs`
        (computed with this standby's port; with SCHEDULER, a late one's scheduler's, when this node
        runs the generation's scheduler); None when it can."""
        if cfg != self.cfg and not self.late:
            return "the config changed since it started"
        if cfg.run.worker_memory_limit_bytes != self.cfg.run.worker_memory_limit_bytes:
            return "the ranks' memory limit changed since it started"
        if tuple(ranks) != self.ranks and not (self.late and len(ranks) == len(self.ranks)):
            return f"this node's ranks are now {list(ranks)}, not {list(self.ranks)}"
        renamed = dict(zip(self.ranks, ranks))      # a late one becomes whichever ranks this node has now
        if ended := [w for w in self.workers if w.popen.poll() is not None]:
            return "its " + ", ".join(f"{w.role} {w.rank if w.rank >= 0 else ''}".strip() + f" ended ({w.popen.returncode})"
                                      for w in ended)
        if any(_mindspore_env(envs[renamed[r]], late=self.late) != _mindspore_env(self.envs[r], late=self.late)
               for r in self.ranks):
            return "the MindSpore environment changed since it started"
        if any(len(activation_line(dict(envs[r]))) > PIPE_BYTES for r in ranks):
            return f"an environment larger than a pipe holds ({PIPE_BYTES} bytes)"
        if SCHEDULER in self.pipes and SCHEDULER not in envs:
            return "this node no longer runs the scheduler"
        if self.ready_s is None and now - self.started_at > FORM_TIMEOUT_S:
            return f"its cluster has not formed in {FORM_TIMEOUT_S:.0f} s"
        return None

    def activate(self, envs: Mapping[int, Mapping[str, str]], ranks: Sequence[int] | None = None) -> list[Worker]:
        """Hands each rank its generation's environment; returns the processes, now that generation's.
        A late standby started as other ranks than `ranks` (a lower machine left the run) takes them in
        order, each writing to its new rank's log from here on. Raises OSError if a rank cannot be told
        (it died since `unusable` looked): then retire it."""
        renamed = dict(zip(self.ranks, ranks if ranks is not None else self.ranks))
        started_as = {w.rank: w for w in self.workers}
        for rank in list(self.pipes):
            env = dict(envs[renamed.get(rank, rank)])
            worker = started_as[rank]
            if renamed.get(rank, rank) != rank:
                worker.rank = renamed[rank]
                worker.log_path = worker.log_path.with_name(f"rank-{worker.rank}.log")
                env[ENV_LOG_PATH] = str(worker.log_path)
            os.write(self.pipes[rank], activation_line(env))     # fits the pipe: never blocks
            os.close(self.pipes.pop(rank))
        self.ranks = tuple(renamed[r] for r in self.ranks)
        return self.workers

    def retire(self) -> None:
        """Closes the pipes (the ranks exit by themselves), then ends what is left."""
        for fd in self.pipes.values():
            os.close(fd)
        self.pipes = {}
        stop_all(self.workers, grace_s=RETIRE_GRACE_S)
        for w in self.workers:
            if w.group is not None:
                w.group.remove()

    def records(self) -> list[dict]:
        """For state.json: a daemon that was killed ends them at its next start, like its ranks."""
        return [{**w.record(), "standby": True} for w in self.workers]


class Keeper:
    """The supervisor's standby, one at a time: started once a generation's ranks all step (not
    while they compile), handed to the next generation if it fits, retired otherwise. On several
    nodes each node's daemon keeps one for its own ranks."""

    def __init__(self, files, env: Mapping[str, str], *, worker_cmd: Sequence[str],
                 scheduler_cmd: Sequence[str] | None):
        self.files, self.env = files, env
        self.worker_cmd, self.scheduler_cmd = list(worker_cmd), scheduler_cmd
        self.standby: Standby | None = None

    def tick(self, cfg: Config, gen, watch, ledger, memcg_parent: tuple[int, Path] | None) -> None:
        """Starts the standby of the generation after `gen` when it is time (a failed start is not retried
        in this generation: it trains on, and restarts cold)."""
        if self.standby is not None or not watch.stepping or not wanted(cfg):
            return
        try:
            runs_scheduler = any(w.role == "scheduler" for w in gen.workers)     # and likely will again
            self.standby = Standby.start(cfg, self.files, self.env, number=gen.number + 1,
                                         ranks=[r.rank for r in gen.ranks], worker_cmd=self.worker_cmd,
                                         scheduler_cmd=self.scheduler_cmd if runs_scheduler else None,
                                         sock_path=gen.sock_path,
                                         memcg_parent=memcg_parent, cgroup_dir=self.files.cgroup_dir)
        except Exception as e:        # no processes, pipes or cgroups left: an optional feature ends nothing
            ledger.emit("standby_failed", level="warning", detail=f"cannot start a standby: {e}")
            self.standby = Standby.none(cfg)
            return
        ledger.note_processes([w.record() for w in gen.workers] + self.standby.records())
        ledger.save()
        ledger.emit("standby_started", pids={w.rank: w.pid for w in self.standby.workers}, port=self.standby.port)

    def sift(self, events: Iterable, now: float, ledger) -> Iterator:
        """`events` less the standby ranks' "cluster formed" reports (logged once every rank has one)."""
        for event in events:
            if not (isinstance(event, PhaseEvent) and event.phase == "standby"):
                yield event
            elif self.standby is not None and self.standby.ready(event.rank, now):
                ledger.emit("standby_ready", next_generation=event.generation, seconds=self.standby.ready_s)

    def claim(self, opened, sock_path: Path, ledger) -> Standby | None:
        """The standby, activated as the generation `opened` (a daemon.acting.peers.Opened); None when there is
        none or it does not fit (then it is retired, and the generation starts cold). A late standby's
        processes are told the generation's scheduler port (another's scheduler has its own); its
        scheduler is used where this node runs the generation's (else a cold one starts)."""
        cfg, number, ranks, port, scheduler = opened.cfg, opened.number, opened.ranks, opened.port, opened.scheduler
        standby, self.standby = self.standby, None
        if standby is None or not standby.workers:
            return None
        port = port if standby.late else standby.port
        envs = {r: self.files.rank_env(self.env, cfg, rank=r, port=port, generation=number, sock=sock_path)
                for r in ranks}
        if scheduler and SCHEDULER in standby.pipes:
            envs[SCHEDULER] = self.files.scheduler_env(self.env, cfg, port=port, generation=number)
        why = standby.unusable(cfg, ranks, envs, time.monotonic())
        if why is None:
            try:
                standby.activate(envs, ranks)
                return standby
            except OSError as e:
                why = f"activating it failed ({e})"
        ledger.emit("standby_retired", detail=f"not used for generation {number}: {why}; starting it cold")
        standby.retire()
        return None

    def records(self) -> list[dict]:
        """The standby's processes, for state.json (a killed daemon's successor ends them)."""
        return self.standby.records() if self.standby is not None else []

    def retire(self) -> None:
        if self.standby is not None:
            self.standby.retire()
            self.standby = None
