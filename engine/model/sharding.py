"""Applies engine.layout.parallel's strategies and stages to a built CausalLM (semi-auto parallel only).

Owns: finding each primitive the strategies name (engine/model/causal_lm.py keeps every
primitive a semi-auto layer calls as an attribute of its cell: Linear.matmul by the
linear's role, the rest by cell class and attribute, engine.layout.parallel.cell_strategies)
and setting its `shard`, and
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
    matmuls, by_cell = parallel.matmul_strategies(cfg), parallel.cell_strategies(cfg)
    row_out, biases = parallel.row_parallel_out_strategy(cfg), parallel.bias_strategies(cfg)
    applied: dict[str, Any] = {}
    for name, cell in net.cells_and_names():
        role = name.rsplit(".", 1)[-1]
        kind = type(cell).__name__
        if role in matmuls and hasattr(cell, "matmul"):
            out = row_out if role in parallel.ROW_PARALLEL else None
            cell.matmul.shard(matmuls[role], out) if out else cell.matmul.shard(matmuls[role])
            if cell.bias is not None:
                cell.add_bias.shard(biases[role])
            applied[name] = (matmuls[role], out)
        elif kind in by_cell:
            for attr, strategy in by_cell[kind].items():
                getattr(cell, attr).shard(strategy)
            applied[name] = by_cell[kind]
        if kind in ("CausalLM", "InlinedCausalLM") and cell.lm_head is None:   # tied: the head reads the embedding
            cell.tied_matmul.shard(matmuls["lm_head"])
            applied[name or "tied_head"] = matmuls["lm_head"]
    if cfg.parallel.pp > 1:
        stages = parallel.cell_stages(cfg)
        for name, cell in net.cells_and_names():
            if name in stages:
                cell.pipeline_stage = stages[name]
                applied[f"{name}:stage"] = stages[name]
    return applied
