"""The supervisor's commands as the engine's ranks agree on them: each rank's one-hot slots
(contracts.command_tail) in the step's summed control vector, so every rank applies the same commands after
the same step."""
from __future__ import annotations

import numpy as np

from contracts.command_tail import WINDOW, CommandTail

__all__ = ["WINDOW", "CommandReader"]



class CommandReader(CommandTail):
    """The file's tail and the agreement (contracts.command_tail), the slots as the step's control vector."""

    def encode(self, applied: int) -> np.ndarray:
        """This rank's one-hot slot: how far past `applied` it has read (capped at WINDOW - 1)."""
        return np.asarray(self.slots(applied), np.int32)
