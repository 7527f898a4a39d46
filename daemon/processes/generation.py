"""One generation's processes: the event socket, MindSpore's scheduler and this node's ranks, their
memory cgroups, signals and teardown; and the orphans a killed daemon left.

The effects half of the supervisor (daemon.judging.watch is the judging half): the
only module that forks or sends signals. Each process leads its own process
group (and session), its stdout and stderr appended to its log; teardown is
SIGTERM to every group, a grace (in which a crashed rank's RAM-tier writer finishes its save), SIGKILL to what
is left, and a reap.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Collection, Iterator, Mapping, Sequence

from contracts import phase_board
from contracts.config import Config
from contracts.phase_board import Slot
from contracts.protocol import FINAL_WORKER_CODES, MAX_SOCKET_PATH_BYTES, decode_event
from daemon.processes import memcg, mindspore_env, rank_log

STACK_DUMP_WAIT_S = 1.0     # for faulthandler in each rank to write its stacks


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


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with the pid,
    an identity that survives pid reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def is_running(record: dict) -> bool:
    """Whether the process of a record (pid, start_ticks) still runs: the same process, and not a
    zombie. An orphan that exited stays a zombie until PID 1 reaps it, which in a container may be
    never: waiting for its /proc entry to go waited out the whole grace (measured: 3 s)."""
    try:
        fields = Path(f"/proc/{record['pid']}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z" and int(fields[19]) == record.get("start_ticks")


@dataclasses.dataclass
class Worker:
    role: str                 # "scheduler" or "rank"
    rank: int                 # -1 for the scheduler
    popen: subprocess.Popen
    log_path: Path
    log_start: int = 0        # the log's size when this process started: its own output follows
    group: memcg.MemoryCgroup | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def record(self) -> dict:
        return {"role": self.role, "rank": self.rank, "pid": self.pid, "pgid": self.pid,
                "start_ticks": start_ticks(self.pid), "log": str(self.log_path), "log_start": self.log_start}


_PR_SET_PDEATHSIG = 1         # prctl(2)


def _with_parent_death_signal(sig: int | None, before_exec: Callable[[], None] | None) -> Callable[[], None] | None:
    """In the child, before exec: `before_exec`, then have the kernel send `sig` to the child when
    the daemon dies — however it dies, SIGKILL included — so no rank trains on unsupervised."""
    if sig is None:
        return before_exec
    prctl = ctypes.CDLL(None, use_errno=True).prctl       # looked up before the fork
    daemon_pid = os.getpid()

    def run() -> None:
        if before_exec is not None:
            before_exec()
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != daemon_pid:                    # the daemon died while this one forked
            os._exit(1)
    return run


def rank_command(cfg: Config, worker_cmd: Sequence[str], resolved_config: Path) -> list[str]:
    """What a rank runs: the engine's command told the run's resolved config, or a user's script (script.command)
    as it is (its client finds the config through LLM_PRETRAIN_CONFIG)."""
    if cfg.script.command:
        return list(worker_cmd)
    return [*worker_cmd, "--config", str(resolved_config)]


def spawn(cmd: Sequence[str], *, env: Mapping[str, str], log_path: Path, role: str, rank: int,
          before_exec: Callable[[], None] | None = None, parent_death_signal: int | None = None,
          pass_fds: Sequence[int] = (), cwd: str | None = None) -> Worker:
    """Starts `cmd` as the leader of a new process group (and session), in `cwd` (None: the daemon's), stdout and
    stderr to `log_path`; `before_exec` runs in the child before it execs (joining a memory cgroup);
    `parent_death_signal` is sent to it by the kernel if the daemon dies."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab", buffering=0) as log:
        start = log.seek(0, os.SEEK_END)
        popen = subprocess.Popen(list(cmd), env=dict(env), stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                 stdin=subprocess.DEVNULL, start_new_session=True, pass_fds=tuple(pass_fds),
                                 preexec_fn=_with_parent_death_signal(parent_death_signal, before_exec))
    return Worker(role=role, rank=rank, popen=popen, log_path=log_path, log_start=start)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(workers: Sequence[Worker], *, grace_s: float, writers_s: float | None = None,
             poll_s: float = 0.05) -> None:
    """SIGTERM to every group, up to `grace_s` for them to exit, then SIGKILL to what is left; reaps them all.
    A RAM-tier writer left in a group (checkpointing.writer_process: it ignores SIGTERM and finishes the save its
    rank handed it) is given up to `writers_s` more (None: `grace_s`; 0: killed with its rank) — a crashed rank's
    last save then lands — and is gone, landed or killed, when this returns."""
    for w in workers:
        if w.popen.poll() is None:
            _signal_group(w.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(w.popen.poll() is None for w in workers):
        time.sleep(poll_s)
    writers_s = grace_s if writers_s is None else writers_s
    for w in workers:
        if w.popen.poll() is None:           # the rank alone where its writer may finish, else its whole group
            w.popen.kill() if writers_s > 0 else _signal_group(w.pid, signal.SIGKILL)
    for w in workers:
        w.popen.wait()
    groups = {w.pid for w in workers}
    _wait_for_writers(groups, writers_s, orphaned_only=False)
    for pgid in _live_groups(groups):        # (a group left empty is not signalled: its id may be reused)
        _signal_group(pgid, signal.SIGKILL)
    _wait_for_writers(groups, KILLED_WRITERS_WAIT_S, orphaned_only=False)


KILLED_WRITERS_WAIT_S = 2.0      # for a SIGKILLed writer's last system call (a rename) to end
WRITER_MODULE = b"checkpointing.writer_process"


def _wait_for_writers(groups: Collection[int], seconds: float, *, orphaned_only: bool) -> None:
    """Until no RAM-tier writer is left in `groups` (or only ones whose rank still runs: `orphaned_only`), at most
    `seconds`. Polled every 5 ms: an idle writer ends within milliseconds of its rank."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and checkpoint_writers(groups, orphaned_only=orphaned_only):
        time.sleep(0.005)


def _live_groups(groups: Collection[int]) -> list[int]:
    """Those of `groups` with a process left in them (zombies included)."""
    live = []
    for pgid in groups:
        try:
            os.killpg(pgid, 0)
            live.append(pgid)
        except (ProcessLookupError, PermissionError):
            pass
    return live


def checkpoint_writers(groups: Collection[int], *, orphaned_only: bool = False,
                       proc: Path = Path("/proc")) -> list[int]:
    """The live (not zombie) RAM-tier writer processes in these process groups (`orphaned_only`: those whose rank,
    their parent and the group's leader, is gone). /proc is read only where a group still has a process."""
    groups = set(_live_groups(groups))
    found = []
    for entry in proc.iterdir() if groups else ():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            state, parent, group = fields[0], int(fields[1]), int(fields[2])
            if (state != "Z" and group in groups and not (orphaned_only and parent == group)
                    and WRITER_MODULE in (entry / "cmdline").read_bytes()):
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue                              # gone meanwhile
    return found


def kill_orphans(records: Sequence[dict], grace_s: float = 0.0) -> list[dict]:
    """Ends a previous daemon's workers that are still alive (same pid and start time as recorded):
    first `grace_s` for them to exit by themselves — the kernel sent them SIGTERM when their daemon
    died (parent-death signal), and they are saving a checkpoint at their next step — then SIGKILL
    to their process groups. Only training ranks save: a scheduler or a standby is not waited for
    (a scheduler outlives its ranks by MindSpore's heartbeat timeout), nor a rank that logged its
    exit event (its save is done; what is left is a second of MindSpore's and the interpreter's
    teardown) — but for its RAM-tier writer, given the same grace to land the save it was handed.
    Returns the records it had to kill: not those that had finished."""
    alive = lambda recs: [r for r in recs if is_running(r)]
    savers = [r for r in records if r.get("role") == "rank" and not r.get("standby")]
    deadline = time.monotonic() + grace_s
    groups = {r["pgid"] for r in savers}      # and the RAM-tier writers of ranks gone, landing what they were handed
    while (((saving := [r for r in alive(savers) if not _logged_exit(r)])
            or checkpoint_writers(groups, orphaned_only=True)) and time.monotonic() < deadline):
        time.sleep(0.05)
    left = alive(records)
    for pgid in {r["pgid"] for r in left} | set(_live_groups(groups)):
        _signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (alive(left) or checkpoint_writers(groups)):
        time.sleep(0.05)
    finished = {r["pid"] for r in savers if r not in saving}
    return [r for r in left if r["pid"] not in finished]


def _logged_exit(record: dict) -> bool:
    """Whether a rank logged its exit event since it started (its log from the recorded offset)."""
    try:
        with open(record["log"], "rb") as f:
            f.seek(record.get("log_start", 0))
            text = f.read().decode(errors="replace")
    except (KeyError, OSError):
        return False
    return any(line.startswith("{") and _kind(line) == "exit" for line in text.splitlines())


def _kind(line: str) -> str | None:
    try:
        return json.loads(line).get("kind")
    except (ValueError, AttributeError):
        return None


def end_previous_daemons_leftovers(records: Sequence[dict], grace_s: float) -> list[dict]:
    """At a daemon's start: the workers a killed daemon left (kill_orphans; returns those it had to
    kill) and the shared-memory files of local groups whose daemon is gone."""
    killed = kill_orphans(records, grace_s) if records else []
    mindspore_env.remove_dead_daemons_group_files()
    return killed


def spawn_rank(cfg: Config, rank: int, cmd: Sequence[str], env: Mapping[str, str], *, log_dir: Path,
               memcg_parent: tuple[int, Path] | None, cgroup_name: str, pass_fds: Sequence[int] = ()) -> Worker:
    """One rank, in its own memory cgroup when the run limits memory. If the daemon dies, the rank
    checkpoints at its next step and exits (its SIGTERM handler); the scheduler needs no such signal:
    it ends when the ranks have."""
    group = None
    if memcg_parent is not None:
        group = memcg.MemoryCgroup.create(memcg_parent, cgroup_name, cfg.run.worker_memory_limit_bytes)
    try:
        worker = spawn(cmd, env=env, role="rank", rank=rank, log_path=log_dir / f"rank-{rank}.log",
                       before_exec=group.join if group else None, parent_death_signal=signal.SIGTERM,
                       pass_fds=pass_fds, cwd=cfg.script.cwd or None)
    except BaseException:
        if group is not None:
            group.remove()
        raise
    worker.group = group
    return worker


@dataclasses.dataclass(frozen=True)
class RankExit:
    rank: int
    code: int
    oom_kills: int = 0
    peak_bytes: int = 0
    device_oom_line: str | None = None
    refusal: str | None = None            # its one-line reason, for a usage, data or config error
    error_line: str | None = None         # otherwise, the exception it ended with (its log's traceback)
    hccl: tuple[dict, ...] = ()           # Ascend: the faults HCCL located (daemon.judging.hccl_verdicts)


class Generation:
    """The processes of one generation; a context manager whose exit tears them down."""

    def __init__(self, cfg: Config, *, number: int, sock_path: Path, log_dir: Path,
                 memcg_parent: tuple[int, Path] | None, cgroup_dir: str):
        self.cfg, self.number = cfg, number
        self.sock_path, self.log_dir = sock_path, log_dir
        self.started_unix_s = time.time()        # a crashed rank's plog files written since count (HCCL's verdicts)
        self.memcg_parent, self.cgroup_dir = memcg_parent, cgroup_dir
        self.workers: list[Worker] = []
        self.final_memory: dict | None = None    # peak memory and OOM kills per rank, after teardown
        self.from_standby = False                # its processes were a warm standby's (daemon/processes/standby.py)
        self.port: int | None = None             # its scheduler's, or a local group's name (launch)
        self._reported: set[int] = set()
        self.grace_s = cfg.run.kill_grace_s
        self.writers_grace_s = cfg.run.kill_grace_s    # for RAM-tier writers left after their ranks (stop_all)
        sock_path.unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(sock_path))
        self.sock.setblocking(False)
        self._received: list[bytes] = []

    @property
    def ranks(self) -> list[Worker]:
        return [w for w in self.workers if w.role == "rank"]

    def launch(self, files, env: Mapping[str, str], *, worker_cmd: Sequence[str], scheduler_cmd: Sequence[str] | None,
               port: int, ranks: Sequence[int], standby=None) -> int:
        """MindSpore's scheduler (given `scheduler_cmd`, with more than one rank in all) and this node's
        ranks, with the environments and files of `files` (a daemon.processes.run_files.RunFiles); or the processes
        of an activated `standby` (daemon/processes/standby.py), already running (a late one's scheduler, on the
        node that runs it, starts now). Returns the scheduler's port."""
        cfg, n = self.cfg, self.number
        if standby is not None:
            self.adopt(standby.workers)
            self.from_standby = True
            if not standby.late:
                self.port = standby.port
                return standby.port
        self.port = port
        if cfg.parallel.world_size > 1 and scheduler_cmd and mindspore_env.needs_scheduler(cfg) \
                and not any(w.role == "scheduler" for w in self.workers):      # a late standby's is running
            self.start_scheduler(scheduler_cmd, files.scheduler_env(env, cfg, port=port, generation=n))
        if standby is None:
            for rank in ranks:
                self.start_rank(rank, rank_command(cfg, worker_cmd, files.resolved_config),
                                files.rank_env(env, cfg, rank=rank, port=port, generation=n, sock=self.sock_path))
        return port

    def start_scheduler(self, cmd: Sequence[str], env: Mapping[str, str]) -> None:
        self.workers.append(spawn(cmd, env=env, role="scheduler", rank=-1, log_path=self.log_dir / "scheduler.log",
                                  cwd=self.cfg.script.cwd or None))

    def start_rank(self, rank: int, cmd: Sequence[str], env: Mapping[str, str]) -> None:
        self.workers.append(spawn_rank(self.cfg, rank, cmd, env, log_dir=self.log_dir, memcg_parent=self.memcg_parent,
                                       cgroup_name=f"{self.cgroup_dir}/g{self.number}-rank-{rank}"))

    def adopt(self, workers: Sequence[Worker]) -> None:
        """Takes a warm standby's processes as this generation's (daemon/processes/standby.py): their output
        from here on is this generation's."""
        for w in workers:
            w.log_start = w.log_path.stat().st_size if w.log_path.exists() else 0
            self.workers.append(w)

    def events(self) -> Iterator:
        """The datagrams received, decoded (malformed ones dropped)."""
        self._receive()
        waiting, self._received = self._received, []
        for data in waiting:
            try:
                yield decode_event(data)
            except ValueError:
                continue

    def wait(self, seconds: float) -> None:
        """Sleeps `seconds`, taking datagrams in as they arrive: the kernel queues only a few per socket
        (net.unix.max_dgram_qlen), and a rank's sends wait while that queue is full."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if select.select([self.sock], [], [], left)[0]:
                self._receive()

    def _receive(self) -> None:
        while True:
            try:
                self._received.append(self.sock.recv(65536))
            except BlockingIOError:
                return

    def new_exits(self) -> list[RankExit]:
        """Ranks that ended since the last call, with what their cgroup and log say about memory."""
        out = []
        for w in self.ranks:
            code = w.popen.poll()
            if code is None or w.rank in self._reported:
                continue
            self._reported.add(w.rank)
            out.append(RankExit(w.rank, code, oom_kills=w.group.oom_kills() if w.group else 0,
                                peak_bytes=(w.group.peak_bytes() or 0) if w.group else 0,
                                device_oom_line=rank_log.oom_line(w.log_path, w.log_start) if code > 0 else None,
                                refusal=rank_log.refusal_line(w.log_path, w.log_start)
                                if code in FINAL_WORKER_CODES else None,
                                error_line=rank_log.error_line(w.log_path, w.log_start)
                                if code > 0 and code not in FINAL_WORKER_CODES else None,
                                hccl=self._hccl(w) if code != 0 else ()))
        return out

    def _hccl(self, w: Worker) -> tuple[dict, ...]:
        if self.cfg.train.device != "ascend":
            return ()
        return tuple(rank_log.hccl_verdicts(w.log_path, w.log_start, rank_log.plog_dir(self.log_dir, w.rank),
                                            since_unix_s=self.started_unix_s))

    def phases(self) -> dict[int, Slot]:
        """Where each rank is inside its step now (contracts.phase_board), for the watch's stall check."""
        if self.port is None:
            return {}
        return phase_board.read(phase_board_prefix(port=self.port, generation=self.number), [w.rank for w in self.ranks])

    def dump_stacks(self, ranks: Sequence[int]) -> None:
        """faulthandler in each worker writes every thread's Python stack to its log on SIGUSR1, in the
        order given (the culprit first)."""
        by_rank = {w.rank: w for w in self.ranks}
        for rank in ranks:
            if rank in by_rank:
                try:
                    os.kill(by_rank[rank].pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        time.sleep(STACK_DUMP_WAIT_S)

    def stopped(self) -> frozenset[int]:
        """Ranks whose process is stopped (state T or t in /proc/<pid>/stat: SIGSTOP, a tracer)."""
        out = set()
        for w in self.ranks:
            try:
                stat = Path(f"/proc/{w.pid}/stat").read_text()
            except OSError:
                continue
            if stat[stat.rfind(")") + 2:][:1] in ("T", "t"):
                out.add(w.rank)
        return frozenset(out)

    def native_state(self, rank: int) -> dict:
        """What the kernel says of a rank's process, which a stopped one cannot say itself: its state
        (`T (stopped)`), where each thread waits (wchan) and, where readable (root), its kernel stack."""
        w = next((w for w in self.ranks if w.rank == rank), None)
        if w is None:
            return {}
        out: dict = {"pid": w.pid}
        try:
            status = Path(f"/proc/{w.pid}/status").read_text()
            out["state"] = next((l.split(":", 1)[1].strip() for l in status.splitlines() if l.startswith("State:")), "")
            threads = {}
            for task in sorted(Path(f"/proc/{w.pid}/task").iterdir(), key=lambda p: int(p.name))[:16]:
                wchan = (task / "wchan").read_text().strip() if (task / "wchan").exists() else ""
                try:
                    kernel = [l.split(" ", 1)[-1] for l in (task / "stack").read_text().splitlines()[:4]]
                except OSError:
                    kernel = []
                threads[task.name] = {"wchan": wchan or "-", **({"kernel": kernel} if kernel else {})}
            out["threads"] = threads
        except OSError as e:                      # gone meanwhile, or not ours to read
            out["error"] = e.strerror or str(e)
        return out

    def memory_report(self) -> dict | None:
        groups = {w.rank: w.group for w in self.ranks if w.group is not None}
        if not groups:
            return None
        return {"peak_memory_bytes": {r: g.peak_bytes() for r, g in groups.items()},
                "oom_kills": {r: g.oom_kills() for r, g in groups.items()}}

    def __enter__(self) -> "Generation":
        return self

    def __exit__(self, *exc) -> None:
        stop_all(self.workers, grace_s=self.grace_s, writers_s=self.writers_grace_s)
        self.sock.close()
        self.sock_path.unlink(missing_ok=True)
        if self.port is not None:           # a local group's files, every generation's phase board
            mindspore_env.remove_group_files(mindspore_env.local_group_prefix(port=self.port, generation=self.number))
        self.final_memory = self.memory_report()
        for w in self.ranks:
            if w.group is not None:
                w.group.remove()


# HCCL's detection of a collective that cannot form or complete (CANN's HCCL_DFS_CONFIG): a link that cannot be set
# up is traced to its root node within 20 s, a collective that times out spreads the fault and logs the root node
# (cluster_heartbeat), a process stuck in a collective is reported (stuck_detection); the operator's own value wins
HCCL_DFS_CONFIG = "connection_fault_detection_time:20,cluster_heartbeat:on,stuck_detection:on"


def phase_board_prefix(*, port: int, generation: int) -> Path:
    """Where a generation's ranks say where they are inside each step (contracts.phase_board): beside the
    generation's shared-memory group files, removed with them."""
    prefix = mindspore_env.local_group_prefix(port=port, generation=generation)
    return prefix.with_name(prefix.name + ".phases")


def worker_env(base: Mapping[str, str], cfg: Config, *, rank: int, port: int, generation: int) -> dict[str, str]:
    """A rank's environment: `base` plus, with more than one rank, MindSpore's dynamic cluster's."""
    from contracts.protocol import ENV_DEVICE, ENV_GENERATION, ENV_PHASE_BOARD
    from daemon.judging.quarantine import VISIBLE, machine_devices

    world = cfg.parallel.world_size
    devices = machine_devices(cfg, base)          # this machine's, less any quarantined (daemon/judging/quarantine.py)
    placed = {**base, VISIBLE: ",".join(map(str, devices)), ENV_DEVICE: str(devices[rank % len(devices)]),
              ENV_PHASE_BOARD: str(phase_board_prefix(port=port, generation=generation))}
    if cfg.train.device == "ascend" and world > 1:     # HCCL's own fault detection, unless the operator set it
        placed.setdefault("HCCL_DFS_CONFIG", HCCL_DFS_CONFIG)
    if world == 1:
        return {**placed, ENV_GENERATION: str(generation)}
    if mindspore_env.is_local_group(cfg):
        return mindspore_env.local_group_env(placed, rank=rank, world=world, port=port, generation=generation,
                                             hub_host=cfg.run.master_addr if mindspore_env.has_hub(cfg) else None)
    return mindspore_env.process_env(placed, role=mindspore_env.WORKER, sched_host=cfg.run.master_addr,
                                     sched_port=port, worker_num=world, local_worker_num=world // cfg.run.nodes,
                                     node_id=rank, generation=generation)
