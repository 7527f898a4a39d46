"""How `[parallel]` maps onto MindSpore: the parallel mode, its context, the data each rank feeds,
who reduces the gradients, the per-op shard strategies and the pipeline's stages.

Owns: the pure mapping (testable without MindSpore or devices). engine/model/sharding.py
applies it to a built model and engine/training/step.py follows its reduction plan.

Two modes:
- DATA_PARALLEL (CPU; Ascend with dp only): every rank holds the whole model
  and feeds its own dp slice; the step all-reduces the gradients itself, once
  per optimizer step, with the loss, the grad norm's inputs and the control
  vector.
- SEMI_AUTO_PARALLEL (Ascend with tp, pp, sp or optimizer sharding): the graph is
  written for the whole logical tensors and MindSpore partitions it by the
  strategies below, inserting every collective itself — the data-parallel
  gradient reduction (its mirror operators) included, so the step must not add
  its own. `full_batch` is on, as in MindFormers: every rank feeds the same
  global micro-step batch and the framework splits it by the strategies.

Ranks are ordered stage-major, then data-parallel, then tensor-parallel
(innermost): rank = stage x (dp x tp) + dp_index x tp + tp_index — MindSpore's
device matrix with the pipeline stages outermost, so a tensor-parallel group is
tp consecutive ranks (on one node when tp divides the devices per node).

Megatron-style strategies: column-parallel q/k/v/gate/up (weights split along
their output rows), row-parallel o/down (split along their input columns,
partial sums all-reduced — or, under sequence parallelism, reduce-scattered
along the tokens), attention split by heads (key/value heads divide by tp), the
vocabulary split across tp for the embedding and the head; under sp the norms'
and residuals' element-wise ops are split along the tokens too. Layers are
assigned to pipeline stages in equal contiguous blocks; the embedding sits on
the first stage, the final norm and the head on the last.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from contracts.config import Config
from engine.data import order

DATA_PARALLEL, SEMI_AUTO = "data_parallel", "semi_auto_parallel"
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
# the parallel optimizer's level (AutoParallel.hsdp): level1 splits the weights and optimizer states across dp and
# leaves the gradient accumulators (pipeline, GradAccumulation) whole; level2 would split those too, at the cost
# of a reduce-scatter per micro-batch. engine/layout/memory_model.py counts what this level holds.
OPTIMIZER_LEVEL = "level1"
ROW_PARALLEL = ("o_proj", "down_proj")

Strategy = tuple[tuple[int, ...], ...]


def flash_attention(cfg: Config) -> bool:
    """Whether attention is MindSpore's fused FlashAttentionScore: on Ascend (it has no CPU kernel) in half
    precision (it has no fp32 kernel either; fp32 runs the eager attention)."""
    return cfg.train.device == "ascend" and cfg.train.flash_attention and cfg.train.precision != "fp32"


def mode(cfg: Config) -> str:
    p = cfg.parallel
    if cfg.train.device == "cpu" or (p.tp == 1 and p.pp == 1 and not p.optimizer_shard and not p.sp):
        return DATA_PARALLEL
    return SEMI_AUTO


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """A generation's parallel mode and what follows from it, decided once (`decide`) and passed down
    to the runtime, the model's cells, the step, the feed and the checkpoints, which never decide it
    again."""

    cfg: Config
    mode: str                    # DATA_PARALLEL or SEMI_AUTO

    @property
    def semi_auto(self) -> bool:
        return self.mode == SEMI_AUTO

    @property
    def context(self) -> dict[str, Any]:
        return _parallel_context(self.cfg, self.mode)

    def auto_parallel(self, *, strategy_file: str = "") -> dict[str, Any]:
        return _auto_parallel_settings(self.cfg, self.mode, strategy_file=strategy_file)

    @property
    def reduction(self) -> Reduction:
        return _reduction(self.cfg, self.mode)

    @property
    def checkpoint_layout(self) -> dict[str, Any]:
        return _checkpoint_layout(self.cfg, self.mode)

    def rank_batch(self, indices: np.ndarray, rank: int) -> np.ndarray:
        return _rank_batch(indices, rank, self.cfg, self.mode)


def decide(cfg: Config) -> Parallelism:
    """The generation's decision: made once where the rank starts, then handed down."""
    return Parallelism(cfg=cfg, mode=mode(cfg))


def _parallel_context(cfg: Config, mode_: str) -> dict[str, Any]:
    """Keyword arguments for `mindspore.set_auto_parallel_context` (DATA_PARALLEL only: the semi-auto
    settings go to the AutoParallel wrapper of the compiled step, as MindSpore 2.10 requires for
    functional training — see Parallelism.auto_parallel)."""
    if mode_ != DATA_PARALLEL:
        return {}
    return {"parallel_mode": DATA_PARALLEL, "gradients_mean": True, "device_num": cfg.parallel.dp}


def _auto_parallel_settings(cfg: Config, mode_: str, *, strategy_file: str = "") -> dict[str, Any]:
    """SEMI_AUTO: how engine/training/sharded_step.py configures `mindspore.parallel.auto_parallel.AutoParallel`
    around the whole step. `strategy_file`: where the compiler writes the sharding strategy (beside
    the checkpoints it describes, for MindSpore's transform_checkpoints).

    Gradients are not averaged by the framework (AutoParallel's default, MindFormers'
    `gradients_mean: False`): the graph is the logical single-device one, whose loss is already the
    mean over the global batch, so its mirror reduction sums exact partial gradients."""
    p = cfg.parallel
    if mode_ != SEMI_AUTO:
        return {}
    return {
        "parallel_mode": "semi_auto",
        "dataset_strategy": "full_batch",     # every rank feeds the whole global micro-step batch
        "pipeline": {"stages": p.pp, "scheduler": "1f1b"} if p.pp > 1 else None,
        # the parallel optimizer: fp32 weights and optimizer states split across dp (ZeRO-1-like, level1)
        "hsdp": {"optimizer_level": OPTIMIZER_LEVEL} if p.optimizer_shard else None,
        "save_param_strategy_file": strategy_file,
    }


def micro_batches(cfg: Config) -> int:
    """SEMI_AUTO: micro-batches one compiled step runs through MindSpore's accumulation (GradAccumulation,
    or the pipeline, whose micro-batches include the accumulation steps)."""
    p, accum = cfg.parallel, cfg.train.grad_accum_steps
    return accum * (p.pipeline_microbatches if p.pp > 1 else 1)


# Who feeds what ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RankCoordinates:
    stage: int
    dp_index: int
    tp_index: int


def coordinates(rank: int, cfg: Config) -> RankCoordinates:
    p = cfg.parallel
    if not 0 <= rank < p.world_size:
        raise ValueError(f"rank {rank} is outside the {p.world_size} ranks of dp x tp x pp")
    stage, within = divmod(rank, p.dp * p.tp)
    dp_index, tp_index = divmod(within, p.tp)
    return RankCoordinates(stage, dp_index, tp_index)


def _rank_batch(indices: np.ndarray, rank: int, cfg: Config, mode_: str) -> np.ndarray:
    """The (grad_accum_steps, rows) sample indices `rank` feeds for one optimizer step.

    DATA_PARALLEL: its dp slice (contiguous, in micro-batches). SEMI_AUTO (full batch): every rank
    feeds the same rows, each micro-step the concatenation of every dp rank's micro-batch, so without
    a pipeline the framework's split along the batch gives dp rank d what rank d trains on under data
    parallel. Either way the samples of a step, and so its loss and gradient, do not depend on the
    layout."""
    p, accum = cfg.parallel, cfg.train.grad_accum_steps
    if indices.size % (p.dp * accum):
        raise ValueError(f"{indices.size} samples do not split into dp {p.dp} x {accum} micro-batches")
    if mode_ == DATA_PARALLEL:
        return order.rank_slice(indices, coordinates(rank, cfg).dp_index, dp=p.dp, grad_accum_steps=accum)
    per_rank = indices.reshape(p.dp, accum, -1)                 # (dp, accum, micro_batch)
    return per_rank.transpose(1, 0, 2).reshape(accum, -1)       # (accum, dp x micro_batch)


# Who reduces the gradients -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Reduction:
    """How the step turns each rank's gradients into the update's."""

    hand_all_reduce: bool        # the step all-reduces gradients and loss over the world, then divides by dp
    divide_by: int               # ... by this
    pipeline: bool               # gradients accumulate over the pipeline's micro-batches (MindSpore's reducer)
    scalars_all_reduce: bool     # loss, grad norm and control vector agreed by one all-reduce outside the graph


def _reduction(cfg: Config, mode_: str) -> Reduction:
    p = cfg.parallel
    if mode_ == DATA_PARALLEL:
        return Reduction(hand_all_reduce=p.dp > 1, divide_by=p.dp, pipeline=False, scalars_all_reduce=False)
    # the framework's mirror operators reduce over dp (and optimizer sharding's reduce-scatter);
    # a world sum on top would double-reduce and sum tensor-parallel shards that must not be summed
    return Reduction(hand_all_reduce=False, divide_by=1, pipeline=p.pp > 1, scalars_all_reduce=True)


# Strategies ---------------------------------------------------------------------------
def matmul_strategies(cfg: Config) -> dict[str, Strategy]:
    """Shard strategy of the 2-D MatMul(transpose_b) of each linear role: ((x rows, x cols), (w rows, w cols));
    x's rows are the batch's tokens."""
    dp, tp = cfg.parallel.dp, cfg.parallel.tp
    strategies: dict[str, Strategy] = {name: ((dp, 1), (tp, 1)) for name in COLUMN_PARALLEL}
    strategies.update({name: ((dp, tp), (1, tp)) for name in ROW_PARALLEL})
    strategies["lm_head"] = ((dp, 1), (tp, 1))
    return strategies


def row_parallel_out_strategy(cfg: Config) -> Strategy | None:
    """Under sp the row-parallel outputs are reduce-scattered along the tokens instead of all-reduced."""
    dp, tp = cfg.parallel.dp, cfg.parallel.tp
    return ((dp * tp, 1),) if cfg.parallel.sp else None


def cell_strategies(cfg: Config) -> dict[str, dict[str, Strategy]]:
    """Strategies of every other primitive the model calls under semi-auto, by the class of the cell that
    holds it, then by its attribute (engine/model/causal_lm.py): each consistent with its neighbours, so
    the compiler inserts no redistribution inside a layer beyond the matmuls' own collectives (the ops a
    strategy is missing from get MindSpore's default batch split, which undoes the head split and, under
    sp, the token split)."""
    dp, tp = cfg.parallel.dp, cfg.parallel.tp
    seq = tp if cfg.parallel.sp else 1            # the tokens' split in the norms' region
    tokens = (dp, seq, 1)                         # (B, T, hidden) outside the matmuls
    heads = (dp, tp, 1, 1)                        # (B, heads, T, head_dim): split by heads
    scores = (dp, tp, 1, 1, 1)                    # (B, kv, rep, T, T)
    wide = (dp, 1, tp)                            # (B, T, intermediate): a column-parallel output
    table = (1, 1)                                # rotary tables, the causal mask: whole on every device
    norm = {"square": (tokens, tokens), "add_eps": (tokens, ()), "rsqrt": (tokens,),
            "normalize": (tokens, tokens), "mul": (tokens, (1,))}
    return {
        "RMSNorm": {**norm, "mean": (tokens,)},
        "LayerNorm": {**norm, "mean": (tokens,), "var": (tokens,), "centre": (tokens, tokens),
                      "add_bias": (tokens, (1,))},
        "Attention": {
            "split_heads": ((dp, 1, tp, 1),),                   # (B, T, n, d) → (B, n, T, d)
            "transpose_k": (heads,), "merge_heads": (heads,),
            "rope_cos": (heads, table), "rope_sin": (heads, table), "rope_add": (heads, heads),
            "upper_half": (heads,), "lower_half": (heads,), "negate": (heads,), "join_halves": (heads, heads),
            "qk": (heads, heads),                               # (B, kv, rep*T, d) x (B, kv, d, T)
            "scale_scores": (scores, ()), "mask": (scores, table), "softmax": (scores,),
            "pv": (heads, heads),                               # (B, kv, rep*T, T) x (B, kv, T, d)
            # q, k, v and the mask: the causal kernel (2048 tokens and more) and the one with a whole mask
            **({"flash": (heads, heads, heads, table), "flash_short": (heads, heads, heads, table)}
               if flash_attention(cfg) else {}),
        },
        "SwiGLU": {"silu": (wide,), "gate_times_up": (wide, wide)},
        "GeluMLP": {"gelu": (wide,)},
        "DecoderLayer": {"add_attn": (tokens, tokens), "add_mlp": (tokens, tokens)},   # the residuals
        "DecoderModel": {"cut_table": (table,), "add_positions": (tokens, (seq, 1))},
        "Embedding": {"gather": ((tp, 1), (dp, 1))},             # rows of a vocab-split table
        "VocabParallelCrossEntropy": loss_strategies(cfg),
    }


def bias_strategies(cfg: Config) -> dict[str, Strategy]:
    """The bias add of a linear role (GPT-2): on its matmul's output, (tokens, features)."""
    dp, tp = cfg.parallel.dp, cfg.parallel.tp
    rows = dp * tp if cfg.parallel.sp else dp
    out = {name: ((dp, tp), (tp,)) for name in COLUMN_PARALLEL}
    out.update({name: ((rows, 1), (1,)) for name in ROW_PARALLEL})
    return out


def loss_strategies(cfg: Config) -> dict[str, Strategy]:
    """Strategies of engine/model/parallel_loss.py's primitives, by attribute: the (rows, vocab) logits
    split as the head leaves them, rows across dp and the vocabulary across tp; the per-row results
    (rows, 1) across dp. OneHot's strategy is its output's, (rows, vocab), as MindSpore defines it."""
    dp, tp = cfg.parallel.dp, cfg.parallel.tp
    logits, rows = ((dp, tp),), ((dp, 1),)
    return {
        "max": logits, "exp": logits, "sum_exp": logits, "sum_picked": logits,
        "shift": ((dp, tp), (dp, 1)),                  # x − its row's max
        "log": rows,
        "one_hot": ((dp, tp), (), ()),
        "pick": ((dp, tp), (dp, tp)),
        "nll": ((dp, 1), (dp, 1)),
        "sum_rows": rows,                              # the rows' sum: all-reduced across dp
    }


# Pipeline --------------------------------------------------------------------------------
def layer_stages(num_layers: int, pp: int) -> list[int]:
    """Pipeline stage of each decoder layer: equal contiguous blocks (config requires pp | num_layers;
    a remainder, where allowed, goes to the earlier stages)."""
    base, extra = divmod(num_layers, pp)
    stages: list[int] = []
    for stage in range(pp):
        stages += [stage] * (base + (1 if stage < extra else 0))
    return stages


def cell_stages(cfg: Config) -> dict[str, int]:
    """Pipeline stage of every cell that owns parameters, by its name in the model."""
    pp = cfg.parallel.pp
    out = {"model.embed_tokens": 0, "model.norm": pp - 1, "lm_head": pp - 1, "loss": pp - 1}
    if cfg.model.arch == "gpt2":
        out["model.embed_positions"] = 0
    out.update({f"model.layers.{i}": s for i, s in enumerate(layer_stages(cfg.model.num_layers, pp))})
    return out


# Checkpoints ------------------------------------------------------------------------------
def _checkpoint_layout(cfg: Config, mode_: str) -> dict[str, Any]:
    """What a checkpoint records of the layout that wrote it. `sliced`: each rank saved its own slices
    (semi-auto parallel) rather than its share of whole tensors."""
    p = cfg.parallel
    return {"sliced": mode_ == SEMI_AUTO, "dp": p.dp, "tp": p.tp, "pp": p.pp, "sp": p.sp,
            "optimizer_shard": p.optimizer_shard}


def describe_layout(layout: dict[str, Any]) -> str:
    extras = [k for k in ("sp", "optimizer_shard") if layout.get(k)]
    return f"dp{layout.get('dp')} x tp{layout.get('tp')} x pp{layout.get('pp')}" + \
        "".join(f" +{k}" for k in extras)


def resume_refusal(saved: dict[str, Any] | None, parallelism: Parallelism) -> str | None:
    """Why a checkpoint saved under `saved` cannot be resumed by `cfg`, or None.

    Whole tensors (a data-parallel checkpoint, or one from before layouts were recorded) load into
    any layout: under semi-auto they are set before the step is compiled, and the compiler slices
    them. Slices load only into the layout that cut them."""
    if not saved or not saved.get("sliced"):
        return None
    current = parallelism.checkpoint_layout
    if all(saved.get(k) == current[k] for k in current):
        return None
    return (f"it was saved in slices by {describe_layout(saved)} and this config is "
            f"{describe_layout(current)}; resume with the same [parallel] layout, or transform it offline "
            "with MindSpore's transform_checkpoints and the strategy files in the run's strategy/ directory")
