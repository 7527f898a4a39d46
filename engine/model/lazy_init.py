"""Initialising only each rank's slices of the model (Ascend, semi-auto parallel).

Owns: `lazy_parameters(parallelism)`, the context the model and its step are built
in, and `SaltedNormal`, the initializer of a weight built inside it.

Under semi-auto parallel, parameters made inside MindSpore's `no_init_parameters`
hold an initializer, not data; the compile slices each and initialises only the
slice this rank holds (at 7B that saves each rank ~81 GB of host memory: the full
fp32 model and both moments). The optimizer's moments and accumulators, clones of
the weights (engine/training/optim.py), must be made inside the same context: a
clone made outside it overwrites the weight's pending initializer.

MindSpore initialises a slice after seeding numpy's global generator with the
slice's index plus the global seed, so its own `Normal` would give slice k of
every weight of one shape the same values (every layer's q_proj alike).
`SaltedNormal` mixes a per-weight salt (its order of creation, the same on every
rank) into that state: replicas of a slice agree, weights and slices differ.
Data-parallel runs (the CPU) never use this: their numpy initialiser
(causal_lm._Init) draws whole tensors, the same on every rank.
"""
from __future__ import annotations

import contextlib

import numpy as np
from mindspore.common.initializer import Initializer


class SaltedNormal(Initializer):
    def __init__(self, sigma: float, salt: int):
        super().__init__(sigma=sigma, salt=salt)
        self.sigma, self.salt = float(sigma), int(salt)

    def _initialize(self, arr: np.ndarray) -> None:
        slice_entropy = int(np.random.randint(0, 2 ** 63 - 1, dtype=np.int64))   # numpy as MindSpore seeded it
        rng = np.random.default_rng([self.salt, slice_entropy])
        arr[...] = rng.normal(0.0, self.sigma, size=arr.shape).astype(arr.dtype)


def lazy_parameters(parallelism):
    """Under semi-auto parallel, MindSpore's `no_init_parameters`; elsewhere nothing."""
    if not parallelism.semi_auto:
        return contextlib.nullcontext()
    from mindspore.nn.utils import no_init_parameters

    return no_init_parameters()
