"""Reading the supervisor's commands file between steps, cheaply, and agreeing on what to apply.

Owns: tailing `commands.jsonl` (a size check per step; new complete lines parsed when it grew), and the
encoding of "the highest command this rank has read" as slots to be summed over the ranks: a one-hot window
of WINDOW slots relative to the last applied sequence number, so the sum tells every rank the highest
sequence number any rank has read, and every rank applies the same commands after the same step. Stdlib
only: the engine's ranks (engine.rank.commands: the sum in the step's graph) and a supervised script's
(llm_pretrain_client) share it."""
from __future__ import annotations

import os
import sys
import time

from typing import Sequence

from contracts.protocol import Command

WINDOW = 8   # commands agreed per step at most; more arrive over the following steps


class CommandTail:
    def __init__(self, path: str | None, *, generation: int = 0):
        self.path = path
        self.generation = generation       # commands stamped for another generation are not this rank's
        self._offset = 0
        self._partial = b""
        self.commands: dict[int, Command] = {}

    @property
    def newest(self) -> int:
        return max(self.commands, default=0)

    def poll(self) -> int:
        """Reads any new complete lines; returns the highest sequence number read."""
        if not self.path:
            return 0
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return self.newest
        if size < self._offset:                    # replaced by a new generation's file
            self._offset, self._partial, self.commands = 0, b"", {}
        if size > self._offset:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(size - self._offset)
            self._offset = size
            *lines, self._partial = (self._partial + chunk).split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                try:
                    cmd = Command.from_json(line.decode())
                except (ValueError, UnicodeDecodeError) as e:
                    print(f"llm-pretrain: ignoring a malformed command line: {e}", file=sys.stderr)
                    continue
                if cmd.generation and cmd.generation != self.generation:
                    continue          # a deposed decider's, written after the run moved on without it
                self.commands[cmd.seq] = cmd
        return self.newest

    def slots(self, applied: int) -> list[int]:
        """This rank's one-hot slot: how far past `applied` it has read (capped at WINDOW - 1)."""
        out = [0] * WINDOW
        out[min(max(self.newest - applied, 0), WINDOW - 1)] = 1
        return out

    def agreed(self, applied: int, summed: Sequence[int]) -> list[Command]:
        """The commands after `applied` that some rank had read, in order (re-reading the file if needed)."""
        reach = max((i for i, count in enumerate(summed) if count > 0), default=0)
        if reach and self.newest < applied + reach:
            self.poll()
        return [self.commands[s] for s in range(applied + 1, applied + reach + 1) if s in self.commands]


def hold(commands: CommandTail, applied: int, stop, poll_s: float = 0.1) -> tuple[str, int]:
    """Paused: no steps, no collectives (`stop.requested`: a stop signal came). Every rank reads the same commands file, so every rank
    leaves on the same command: resume (train on), stop, or release (the supervisor frees the
    devices; the run resumes from the pause checkpoint in a later generation)."""
    while True:
        if stop.requested:
            return "stop", applied
        commands.poll()
        for seq in sorted(s for s in commands.commands if s > applied):
            applied = seq
            if commands.commands[seq].name in ("resume", "stop", "release"):
                return commands.commands[seq].name, applied
        time.sleep(poll_s)
