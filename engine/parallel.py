"""How `[parallel]` maps onto MindSpore: the auto-parallel context and per-op shard strategies.

Owns: the pure mapping (testable without MindSpore or devices) and its
application to a built model. On CPU only data parallel runs (MindSpore's
semi-auto parallel refuses the CPU backend), so the CPU path sets
DATA_PARALLEL; on Ascend, dp × tp × pp becomes SEMI_AUTO_PARALLEL with
Megatron-style strategies: column-parallel q/k/v/gate/up (weights split along
their output rows), row-parallel o/down (split along their input columns, an
all-reduce after), the vocabulary split across tp for the embedding and the
head, layers assigned to pipeline stages in contiguous, balanced blocks.
"""
from __future__ import annotations

from typing import Any

from engine.config import Config

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def parallel_context(cfg: Config) -> dict[str, Any]:
    """Keyword arguments for `mindspore.set_auto_parallel_context`."""
    p = cfg.parallel
    if cfg.train.device == "cpu" or (p.tp == 1 and p.pp == 1 and not p.optimizer_shard):
        return {"parallel_mode": "data_parallel", "gradients_mean": True, "device_num": p.dp}
    ctx: dict[str, Any] = {
        "parallel_mode": "semi_auto_parallel",
        "device_num": p.world_size,
        "gradients_mean": True,
        "full_batch": True,
        "enable_parallel_optimizer": p.optimizer_shard,
        "strategy_ckpt_config": {"save_file": "", "load_file": ""},
    }
    if p.pp > 1:
        ctx["pipeline_stages"] = p.pp
    return ctx


def layer_stages(num_layers: int, pp: int) -> list[int]:
    """Pipeline stage of each decoder layer: contiguous blocks, earlier stages take the remainder."""
    base, extra = divmod(num_layers, pp)
    stages: list[int] = []
    for stage in range(pp):
        stages += [stage] * (base + (1 if stage < extra else 0))
    return stages


def matmul_strategies(cfg: Config) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    """Shard strategy of the MatMul(transpose_b) of each linear role: ((x rows, x cols), (w rows, w cols))."""
    dp, tp = cfg.parallel.dp, cfg.parallel.tp
    strategies = {name: ((dp, 1), (tp, 1)) for name in COLUMN_PARALLEL}
    strategies.update({name: ((dp, tp), (1, tp)) for name in ROW_PARALLEL})
    strategies["lm_head"] = ((dp, 1), (tp, 1))
    return strategies


def apply_to_model(net: Any, cfg: Config) -> None:
    """Sets shard strategies and pipeline stages on a built CausalLM (Ascend semi-auto parallel only)."""
    if cfg.train.device == "cpu" or parallel_context(cfg)["parallel_mode"] == "data_parallel":
        return
    strategies = matmul_strategies(cfg)
    for name, cell in net.cells_and_names():
        role = name.rsplit(".", 1)[-1]
        if role in strategies and hasattr(cell, "matmul"):
            cell.matmul.shard(strategies[role])
    if cfg.parallel.pp > 1:
        stages = layer_stages(cfg.model.num_layers, cfg.parallel.pp)
        for layer, stage in zip(net.model.layers, stages):
            layer.pipeline_stage = stage
