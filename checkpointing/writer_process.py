"""A shard writer whose writing runs in a child process: the RAM tier's, off the trainer's GIL.

Owns: the child (`python -m checkpointing.writer_process`, started at the first save — or ahead of
it, `prestart()` — and again after it dies), the shared memory the caller's host copies go into (one memfd both processes
map, laid out once), and the JSON lines between them: the layout, then one line per save going
down; the writer's events and one "done" per save coming back.

Why a process: a ShardWriter's thread holds the GIL for its Python (the marker, the manifest,
the commit's file calls) and, at nice 19 on cores the step keeps busy, is descheduled while
holding it, so the training thread waited for it: the step after each RAM save ran slower, most
of the RAM tier's cost (copying the tensors, or pausing as long, cost the next step nothing;
bench/ram_tier.py). A child under SCHED_IDLE takes only cycles no other task wants and
can never hold the trainer's lock.

The files, their protocol and the events are ShardWriter's exactly (the child runs one). Its
events reach the caller's `emit` when the caller next saves, waits or calls `poll()`: the
supervisor only notes the RAM tier's commits, it does not act on them. A save handed to the child
lands even if the rank dies right after (a crash, SIGKILL, SIGTERM to its process group): its
tensors are already in the memory the child maps, so the child finishes that save, then sees its
input end and exits — a rank's crash loses the step in flight, not also the one being written
(the daemon's teardown waits for it: daemon.processes.generation.stop_all). It ignores SIGTERM
and SIGINT for that reason; once its parent is gone, a committer waits for the other ranks' shards
`ORPHAN_COMMIT_WAIT_S` at most (a rank that died before handing over its save never sends one).
A child that dies on its own fails its save ("failed", `last_error`) and is started again at the
next; a `.tmp` a killed one left is removed at the next start.
"""
from __future__ import annotations

import json
import mmap
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from checkpointing import CheckpointError, checksums
from checkpointing.writer import ShardWriter

Emit = Callable[..., None]
_ALIGN = 64                 # each tensor's offset in the shared memory (a cache line)
ORPHAN_COMMIT_WAIT_S = 1.0  # a committer whose rank died waits no longer for the other ranks' shards
_IGNORED = (signal.SIGTERM, signal.SIGINT)    # by the child: it finishes the save in flight first
_spare: tuple[int, subprocess.Popen] | None = None     # prestart()'s: (its memfd, still empty; the child)


def prestart() -> None:
    """Starts this process's writer child now, ahead of the first save, which takes it over: its
    interpreter and imports (~0.27 CPU s) then cost the save nothing. A warm standby calls it while it
    waits on idle CPU (the child inherits SCHED_IDLE): after a recovery, the first RAM saves waited
    ~60 ms for the child, whose start also slowed the steps beside it (two ranks on two cores). The
    child waits for its layout; the memory it maps is sized when the writer lays it out. Once only."""
    global _spare
    if _spare is None:
        fd = os.memfd_create("llm-pretrain-checkpoint-staging", os.MFD_CLOEXEC)
        _spare = (fd, _spawn(fd))


def _take_spare() -> tuple[int, subprocess.Popen] | None:
    """prestart()'s memfd and child, for the first writer that lays out its memory (a child that died
    meanwhile is dropped: the writer starts its own)."""
    global _spare
    spare, _spare = _spare, None
    if spare is not None and spare[1].poll() is not None:
        _end(spare[1])
        os.close(spare[0])
        return None
    return spare


def _spawn(fd: int) -> subprocess.Popen:
    """The child, sharing memfd `fd`, its replies non-blocking."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    # started with SIGTERM and SIGINT blocked (the mask passes through exec), so one sent to the rank's process
    # group while the child's interpreter starts waits for it to ignore them (_finish_after)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _IGNORED)
    try:
        child = subprocess.Popen([sys.executable, "-m", "checkpointing.writer_process", str(fd), str(os.getpid())],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,), env=env)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    os.set_blocking(child.stdout.fileno(), False)
    return child


class ProcessShardWriter:
    def __init__(self, root: str | Path, *, rank: int, world: int, emit: Emit | None = None,
                 keep_last: int | None = None, keep_every: int = 0, commit_timeout_s: float = 300.0,
                 low_priority: bool = True, indent_manifest: bool = True, checksum: str = checksums.SHA256,
                 recycle: bool = False, latest_hint: bool = True, part: Mapping[str, int] | None = None):
        """The arguments are ShardWriter's (its `on_commit` hook cannot cross into the child)."""
        checksums.require(checksum)                      # said here, not by the child
        self.root = Path(root)
        self.rank, self.world = rank, world
        self.emit = emit or (lambda stage, **info: None)
        self._options = dict(rank=rank, world=world, keep_last=keep_last, keep_every=keep_every,
                             commit_timeout_s=commit_timeout_s, indent_manifest=indent_manifest,
                             checksum=checksum, recycle=recycle, latest_hint=latest_hint,
                             part=dict(part) if part else None)
        self._commits = ShardWriter.committer(rank, part)
        self.low_priority = low_priority
        self.last_error: BaseException | None = None     # of the latest save; None while it goes well
        self.last_committed: int | None = None
        self._memory: tuple[int, mmap.mmap] | None = None    # (memfd, its mapping)
        self._layout: list = []                              # [[name, dtype str, shape, offset]]
        self._views: dict[str, np.ndarray] = {}
        self._child: subprocess.Popen | None = None
        self._told = False                                   # the child has its first line (the layout)
        self._replies = b""
        self._pending: int | None = None                     # the step the child is writing

    @property
    def pid(self) -> int | None:
        """The writer process's, while it runs."""
        return self._child.pid if self._child is not None else None

    # The caller's side -----------------------------------------------------
    def staging(self, like: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Buffers of `like`'s names, shapes and dtypes in memory the writer process shares: the
        caller copies its tensors into them and passes them to save(), which then copies nothing.
        Made once; asking again for another layout makes new ones (and a new child)."""
        layout, at = [], 0
        for name, a in like.items():
            layout.append([name, np.dtype(a.dtype).str, list(a.shape), at])
            at += -(-int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize // _ALIGN) * _ALIGN
        if layout == self._layout and self._memory is not None:
            return self._views
        self.close()
        spare = _take_spare()
        if spare is not None:
            fd, self._child = spare
            self._replies, self._told = b"", False
        else:
            fd = os.memfd_create("llm-pretrain-checkpoint-staging", os.MFD_CLOEXEC)
        size = max(at, 1)                                    # mmap refuses a length of 0
        os.ftruncate(fd, size)
        self._memory = (fd, mmap.mmap(fd, size))
        self._layout = layout
        self._views = {name: np.ndarray(shape, dtype, buffer=self._memory[1], offset=offset)
                       for name, dtype, shape, offset in layout}
        return self._views

    def save(self, step: int, tensors: Mapping[str, np.ndarray], *, run_state: dict[str, Any] | None = None,
             versions: dict[str, str] | None = None) -> None:
        """Has the child write this rank's `tensors` for `step`; returns at once. Tensors that are not
        this writer's staging buffers are copied into them first."""
        if self._commits and run_state is None:
            raise ValueError("the committing rank must pass run_state")
        self.ready(step)
        if tensors is not self._views:
            views = self.staging(tensors)
            for name, a in tensors.items():
                if views[name] is not a:
                    np.copyto(views[name], a)
        self.last_error = None       # from here on it describes this save
        line = json.dumps({"step": step, "run_state": run_state, "versions": versions or {}}).encode() + b"\n"
        for attempt in (1, 2):       # a child found dead is started again once
            self._start_child()
            try:
                os.write(self._child.stdin.fileno(), line)
                break
            except BrokenPipeError:
                self._reap()
                if attempt == 2:
                    raise CheckpointError("the checkpoint writer process could not be started again") from None
        self._pending = step

    def ready(self, step: int) -> None:
        """Waits until this rank's previous save is done (reported as "waited"): after this, the
        staging buffers may be written again."""
        self.poll()
        if self._pending is not None:
            started = time.monotonic()
            self._drain(None)
            self.emit("waited", step=step, seconds=time.monotonic() - started)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Blocks until the save in flight is done and its events are passed on; True if none is left."""
        self._drain(timeout_s)
        return self._pending is None

    def poll(self) -> None:
        """Passes on the events the child has sent so far, without waiting."""
        self._drain(0.0)

    def close(self) -> None:
        """Ends the child (after the save in flight) and frees the shared memory."""
        if self._child is not None:
            self._drain(None)        # a child found dead here is reaped by it
        if self._child is not None:
            _end(self._child)
            self._child = None
        if self._memory is not None:
            self._views = {}
            self._memory[1].close()
            os.close(self._memory[0])
            self._memory, self._layout = None, []

    # The child, seen from here ---------------------------------------------
    def _start_child(self) -> None:
        if self._child is None:
            self._child, self._replies, self._told = _spawn(self._memory[0]), b"", False
        if self._told:
            return
        self._told = True
        first = {"root": str(self.root), "options": self._options, "low_priority": self.low_priority,
                 "size": len(self._memory[1]), "tensors": self._layout}
        try:
            os.write(self._child.stdin.fileno(), json.dumps(first).encode() + b"\n")
        except BrokenPipeError:
            pass                     # the caller's write fails too, and starts it again

    def _drain(self, timeout_s: float | None) -> None:
        """Reads the child's lines until its pending save is done (timeout_s None: however long that
        takes; 0: only what is there)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._child is not None:
            fd = self._child.stdout.fileno()
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                chunk = None
            if chunk == b"":
                self._reap()
                return
            if chunk:
                self._replies += chunk
                *lines, self._replies = self._replies.split(b"\n")
                for line in lines:
                    self._handle(json.loads(line))
                continue
            if self._pending is None:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            select.select([fd], [], [], left)

    def _handle(self, message: dict) -> None:
        if "emit" in message:
            stage = message.pop("emit")
            self.emit(stage, **message)
        elif "done" in message:
            if message["error"]:
                self.last_error = CheckpointError(message["error"])
            if message["committed"] is not None:
                self.last_committed = message["committed"]
            self._pending = None

    def _reap(self) -> None:
        """The child's output ended: it exited. A save it was writing failed."""
        child, self._child = self._child, None
        code = _end(child)
        if self._pending is not None:
            step, self._pending = self._pending, None
            self.last_error = CheckpointError(f"the checkpoint writer process exited (code {code}) while writing "
                                              f"step {step}; it is started again at the next save")
            self.emit("failed", step=step, seconds=0.0, error=str(self.last_error))


def _end(child: subprocess.Popen) -> int:
    """Closes the child's input (it exits after the save in flight), waits for it (killed after 10 s)
    and closes its output; returns its exit code."""
    child.stdin.close()
    try:
        code = child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        code = child.wait()
    child.stdout.close()
    return code


# The child ----------------------------------------------------------------------
def _finish_after(parent: int) -> Callable[[], bool]:
    """The child outlives its rank only to finish the save in flight: SIGTERM (the daemon stopping the
    rank's process group) and SIGINT (a terminal's ^C to it) are ignored, the end of its input ends it.
    Returns whether the parent is gone."""
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)     # (one that came while it started, blocked till now, is dropped)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _IGNORED)
    return lambda: os.getppid() != parent


def _lines(fd: int, orphaned: Callable[[], bool], idle_check_s: float = 0.2) -> Iterator[bytes]:
    """The lines the rank sends, until its end of the pipe closes — or, once the rank is gone, until nothing
    more comes (a process it forked may hold that end open: the child must not wait on it)."""
    pending = b""
    while True:
        if not select.select([fd], [], [], idle_check_s)[0]:
            if orphaned():
                return
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return
        *complete, pending = (pending + chunk).split(b"\n")
        yield from complete


def _lowest_priority() -> None:
    """SCHED_IDLE: it runs only where no other task of the machine wants the core (nice 19 still took
    a share from the step: tiny's step after a RAM save ran ~1 ms slower, measured); where that is
    refused, nice 19. While the trainer waits for it (ready), the trainer's core is idle, so it runs."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 19)
        except OSError:
            pass


def main(argv: list[str]) -> None:
    fd, parent = int(argv[0]), int(argv[1])
    orphaned = _finish_after(parent)
    replies = os.dup(1)
    os.dup2(2, 1)               # whatever else prints goes to the rank's log, never into the replies

    def reply(message: dict) -> None:
        data = memoryview(json.dumps(message).encode() + b"\n")
        try:
            while data:
                data = data[os.write(replies, data):]
        except BrokenPipeError:  # the rank is gone: the save still lands, no one is told
            pass

    lines = _lines(sys.stdin.fileno(), orphaned)
    first = next(lines, None)
    if first is None:           # a prestarted child no writer took: its parent ended or closed it
        return
    first = json.loads(first)
    if first.get("low_priority"):
        _lowest_priority()
    memory = mmap.mmap(fd, first["size"])
    tensors = {name: np.ndarray(shape, dtype, buffer=memory, offset=offset)
               for name, dtype, shape, offset in first["tensors"]}
    writer = ShardWriter(first["root"], emit=lambda stage, **info: reply({"emit": stage, **info}),
                         low_priority=False, **first["options"])
    writer.orphaned, writer.orphan_wait_s = orphaned, ORPHAN_COMMIT_WAIT_S
    for line in lines:
        job = json.loads(line)
        writer.last_error = None
        writer.write_now(job["step"], tensors, job["run_state"], job["versions"])
        error = writer.last_error
        reply({"done": job["step"], "error": f"{type(error).__name__}: {error}" if error else None,
               "committed": writer.last_committed})


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)     # without the interpreter's teardown: a generation's teardown waits for this process to end
