"""Initialising only each rank's slices of the model (Ascend, semi-auto parallel).

Owns: `lazy_parameters(parallelism)`, the context the model and its step are built
in, and `SaltedNormal`, the initializer of a weight built inside it.

Under semi-auto parallel, parameters made inside MindSpore's `no_init_parameters`
hold an initializer, not data; the compile slices each and initialises only the
slice this rank holds (at 7B that saves each rank ~81 GB of host memory: the full
fp32 model and both moments). The optimizer's moments and accumulators, clones of
the weights (engine/training/optim.py), must be made inside the same context: a
clone made outside it overwrites the weight's pending initializer.

MindSpore seeds numpy's global generator with (slice index + global seed) before it
initialises a slice, where the slice index is the tensor block's index, plus the
device count and the rank's place in its optimizer-shard group when the parameter is
optimizer-sharded (mindspore/parallel/_tensor.py, _get_slice_index). Two flaws for a
model: every weight of one shape gets the same values in slice k (every layer's
q_proj alike), and under tp with optimizer sharding the sum collides (tp block i at
shard rank j draws what block i' at j' draws when i + j = i' + j'), so a weight holds
repeated blocks. `SaltedNormal` reads the seed MindSpore set back off the generator,
splits it into (block, shard rank) — the shard rank is the rank's dp index, the
optimizer-shard group being the dp replicas of one block — and draws from a generator
keyed by (its weight's salt, block, shard rank): replicas of a block agree, weights,
blocks and shards differ. Data-parallel runs (the CPU) never use this: their numpy
initialiser (causal_lm._Init) draws whole tensors, the same on every rank.
"""
from __future__ import annotations

import contextlib

import numpy as np
from mindspore.common.initializer import Initializer

_MT_SEED_MASK = 2 ** 32 - 1          # numpy's legacy seed is a 32-bit key: what get_state() gives back


def slice_key(seeded: int, global_seed: int, devices: int, dp_index: int) -> tuple[int, int]:
    """(tensor block, optimizer-shard rank) of the slice MindSpore seeded numpy for with `seeded`."""
    index = (seeded - global_seed) & _MT_SEED_MASK
    if index < devices:                  # not optimizer-sharded: the block's index alone
        return index, 0
    return index - devices - dp_index, dp_index + 1


class SaltedNormal(Initializer):
    """N(0, sigma) slices of one weight (`salt`: its order of creation, the same on every rank); the
    layout's ranks per stage (dp x tp) and tp turn this rank's number into its dp index."""

    def __init__(self, sigma: float, salt: int, stage_ranks: int = 1, tp: int = 1):
        super().__init__(sigma=sigma, salt=salt, stage_ranks=stage_ranks, tp=tp)
        self.sigma, self.salt, self.stage_ranks, self.tp = float(sigma), int(salt), int(stage_ranks), int(tp)

    def _initialize(self, arr: np.ndarray) -> None:
        from mindspore.common.seed import get_seed
        from mindspore.communication import get_group_size, get_rank

        seeded = int(np.random.get_state()[1][0])           # what MindSpore seeded numpy with for this slice
        devices = get_group_size()
        dp_index = (get_rank() % self.stage_ranks) // self.tp   # stage-major, then dp, then tp (engine.layout.parallel)
        block, shard = slice_key(seeded, get_seed() or 0, devices, dp_index)
        rng = np.random.default_rng([self.salt, block, shard])
        arr[...] = rng.normal(0.0, self.sigma, size=arr.shape).astype(arr.dtype)


def lazy_parameters(parallelism):
    """Under semi-auto parallel, MindSpore's `no_init_parameters`; elsewhere nothing."""
    if not parallelism.semi_auto:
        return contextlib.nullcontext()
    from mindspore.nn.utils import no_init_parameters

    return no_init_parameters()
