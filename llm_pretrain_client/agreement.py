"""What every rank of a script applies after the same step: each rank's control vector (a stop flag, then the
commands window of contracts.command_tail) summed over the ranks. One rank needs no sum; several sum through
MindSpore's own collective (the script formed its cluster under msrun's environment, as it does for its
gradients): one AllReduce of WINDOW + 1 integers per step."""
from __future__ import annotations

from typing import Sequence


class Agreement:
    def __init__(self, world: int):
        self.world = world
        self._allreduce = None

    def sum(self, vector: Sequence[int]) -> list[int]:
        if self.world == 1:
            return list(vector)
        import mindspore as ms
        from mindspore import ops

        if self._allreduce is None:
            self._allreduce = ops.AllReduce()
        # float32: MindSpore's CPU AllReduce takes float32 and float16 only (int32 fails its kernel select);
        # the slots are flags and counts far below 2**24, which float32 holds exactly
        return [int(round(float(v))) for v in self._allreduce(ms.Tensor(list(vector), ms.float32)).asnumpy()]
