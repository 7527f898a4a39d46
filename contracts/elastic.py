"""The shape of a run on fewer machines than it was configured for (multi-node, elastic).

A run of `run.nodes` machines may go on with fewer, down to `run.min_nodes`, when a machine is
lost. The global batch and the order of samples stay exactly the same (neither depends on the
data-parallel size): only the data-parallel size shrinks with the machines, and gradient
accumulation grows to make up for it. Where the micro-batch does not fit the new size, it is
made smaller (the largest that divides the global batch evenly). Arithmetic only; no config, no
MindSpore.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Shape:
    dp: int
    micro_batch: int
    grad_accum_steps: int


def shape_on(nodes: int, *, ranks_per_node: int, model_parallel: int, global_batch: int,
             micro_batch: int) -> Shape | None:
    """How a run trains on `nodes` machines of `ranks_per_node` ranks each, with tp x pp =
    `model_parallel` (kept within the machines that remain): None when it cannot keep
    `global_batch` (the data-parallel size does not divide it, or the ranks do not divide into
    whole model replicas)."""
    world = nodes * ranks_per_node
    if nodes < 1 or world % model_parallel:
        return None
    dp = world // model_parallel
    for micro in range(micro_batch, 0, -1):
        if global_batch % (micro * dp) == 0:
            return Shape(dp=dp, micro_batch=micro, grad_accum_steps=global_batch // (micro * dp))
    return None


def unshapeable(*, nodes: int, min_nodes: int, ranks_per_node: int, model_parallel: int, global_batch: int,
                micro_batch: int) -> int | None:
    """The first machine count in [min_nodes, nodes) the run could not go on with, or None."""
    for count in range(min_nodes, nodes):
        if shape_on(count, ranks_per_node=ranks_per_node, model_parallel=model_parallel,
                    global_batch=global_batch, micro_batch=micro_batch) is None:
            return count
    return None
