"""Shared pieces of the MindSpore tests: one graph-mode CPU context per test process, trainer builders."""
from __future__ import annotations

import numpy as np
import pytest

from engine.config import load_config


@pytest.fixture(scope="session")
def mindspore_cpu():
    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    return ms


@pytest.fixture
def make_trainer(mindspore_cpu):
    from engine.runtime import RankInfo
    from engine.worker import Trainer

    def build(*overrides: str) -> Trainer:
        return Trainer(load_config(None, list(overrides)), RankInfo(rank=0, world_size=1, local_world_size=1))

    return build


def snapshot(trainer) -> dict[str, np.ndarray]:
    """Every parameter and every optimizer/scaler state tensor, copied to host."""
    cells = list(trainer.net.trainable_params()) + list(trainer.step_fn.state())
    return {p.name: p.asnumpy().copy() for p in cells}
