"""Applies engine.layout.parallel's strategies and stages to a built CausalLM (semi-auto parallel only).

Owns: finding each primitive the strategies name (engine/model/causal_lm.py keeps them
as attributes: Linear.matmul, Attention.qk/pv/softmax, RMSNorm.mul,
DecoderLayer.add_attn/add_mlp, Embedding.gather, VocabParallelCrossEntropy's ops) and setting its `shard`, and
setting `pipeline_stage` on the cells that own parameters. Under
DATA_PARALLEL it changes nothing: the CPU path's cells stay untouched.
"""
from __future__ import annotations

from typing import Any

from contracts.config import Config
from engine.layout import parallel


def apply_to_model(net: Any, cfg: Config, parallelism: parallel.Parallelism) -> dict[str, Any]:
    """Sets shard strategies and pipeline stages; returns {cell name: what was set} for inspection."""
    if not parallelism.semi_auto:
        return {}
    matmuls, ops_ = parallel.matmul_strategies(cfg), parallel.op_strategies(cfg)
    row_out = parallel.row_parallel_out_strategy(cfg)
    losses = parallel.loss_strategies(cfg)
    applied: dict[str, Any] = {}
    for name, cell in net.cells_and_names():
        role = name.rsplit(".", 1)[-1]
        kind = type(cell).__name__
        if role in matmuls and hasattr(cell, "matmul"):
            out = row_out if role in parallel.ROW_PARALLEL else None
            cell.matmul.shard(matmuls[role], out) if out else cell.matmul.shard(matmuls[role])
            applied[name] = (matmuls[role], out)
        elif kind == "Attention":
            for attr in ("qk", "pv", "softmax"):
                getattr(cell, attr).shard(ops_[attr])
            applied[name] = tuple(ops_[a] for a in ("qk", "pv", "softmax"))
        elif kind == "RMSNorm":
            cell.mul.shard(ops_["norm"])
            applied[name] = ops_["norm"]
        elif kind == "DecoderLayer":
            cell.add_attn.shard(ops_["residual"])
            cell.add_mlp.shard(ops_["residual"])
            applied[name] = ops_["residual"]
        elif kind == "CausalLM" and cell.lm_head is None:            # tied: the head reads the embedding
            cell.tied_matmul.shard(matmuls["lm_head"])
            applied[name or "tied_head"] = matmuls["lm_head"]
        elif kind == "VocabParallelCrossEntropy":
            for attr, strategy in losses.items():
                getattr(cell, attr).shard(strategy)
            applied[name] = losses
        elif kind == "Embedding" and role == "embed_tokens":
            cell.gather.shard(ops_["embedding"])
            applied[name] = ops_["embedding"]
    if cfg.parallel.pp > 1:
        stages = parallel.cell_stages(cfg)
        for name, cell in net.cells_and_names():
            if name in stages:
                cell.pipeline_stage = stages[name]
                applied[f"{name}:stage"] = stages[name]
    return applied
