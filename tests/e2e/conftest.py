"""Shared pieces of the MindSpore tests: one graph-mode CPU context per test process, trainer builders."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from contracts.config import load_config


@pytest.fixture(scope="session")
def mindspore_cpu():
    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    return ms


@pytest.fixture(scope="session")
def stdlib_corpus(tmp_path_factory) -> str:
    """The embedded default corpus, prepared once for the whole session."""
    from engine.data.prepare import STDLIB, prepare

    out = tmp_path_factory.mktemp("corpus") / "stdlib"
    prepare([STDLIB], out, log=open(os.devnull, "w"))
    return str(out)


@pytest.fixture
def make_trainer(mindspore_cpu, stdlib_corpus):
    """Builds a Trainer on the tiny config (trained on the stdlib corpus) with overrides."""
    from engine.layout.parallel import decide
    from engine.rank.runtime import RankInfo
    from engine.rank.trainer import Trainer

    def build(*overrides: str, **kwargs) -> Trainer:
        cfg = load_config(None, [f'data.path="{stdlib_corpus}"', *overrides])
        return Trainer(cfg, RankInfo(rank=0, world_size=1, local_world_size=1, parallelism=decide(cfg)), **kwargs)

    return build


def snapshot(trainer) -> dict[str, np.ndarray]:
    """Every parameter and every optimizer/scaler state tensor, copied to host."""
    cells = list(trainer.net.trainable_params()) + list(trainer.step_fn.state())
    return {p.name: p.asnumpy().copy() for p in cells}


@pytest.fixture(scope="session")
def ascend_standins() -> dict[str, str]:
    """The environment of a process that runs MindSpore's Ascend dry run against stand-in CANN libraries
    (tests/ascend/standins.py: built once per MindSpore version into the cache, ~15 s). Skips where they
    cannot be built (no gcc/binutils, or a wheel without the Ascend plugin); under CI a missing tool fails."""
    from tests.ascend import standins

    try:
        root = standins.build()
    except standins.Unavailable as e:
        if os.environ.get("CI") and standins.missing_tools():
            pytest.fail(f"Ascend stand-ins: {e}")
        pytest.skip(f"Ascend stand-ins: {e}")
    env = standins.environment(root)
    env["PYTHONPATH"] = ":".join([env["PYTHONPATH"], str(Path(__file__).resolve().parents[2])])
    env["GLOG_v"] = "2"
    return env
