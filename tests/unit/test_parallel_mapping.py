"""The pure mapping of [parallel] onto MindSpore, for each shipped config and each kind of layout,
against expectations worked out by hand."""
import numpy as np
import pytest

from contracts.config import load_config
from contracts.errors import ConfigError
from engine.layout.parallel import (
    DATA_PARALLEL,
    SEMI_AUTO,
    cell_stages,
    coordinates,
    decide,
    layer_stages,
    matmul_strategies,
    micro_batches,
    mode,
    cell_strategies,
    resume_refusal,
    row_parallel_out_strategy,
)

ASCEND = ['train.device="ascend"', 'train.precision="bf16"', "train.flash_attention=false"]
# a model every layout below divides: 8 heads, 4 kv heads, 4 layers, vocab 512, global batch 16
SHAPE = ["model.num_heads=8", "model.num_kv_heads=4", "model.num_layers=4", "model.hidden_size=64",
         "model.intermediate_size=128", "train.global_batch=16"]


def _cfg(*overrides):
    return load_config(None, ASCEND + SHAPE + list(overrides))


DP_ONLY = _cfg("parallel.dp=4", "train.micro_batch=2", "train.grad_accum_steps=2")
TP_ONLY = _cfg("parallel.tp=4", "train.micro_batch=4", "train.grad_accum_steps=4")
PP_ONLY = _cfg("parallel.pp=2", "parallel.pipeline_microbatches=2", "train.micro_batch=4",
               "train.grad_accum_steps=4")
ALL_THREE = _cfg("parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.pipeline_microbatches=4",
                 "parallel.sp=true", "parallel.optimizer_shard=true", "train.micro_batch=4",
                 "train.grad_accum_steps=2")


@pytest.mark.parametrize("layers,pp,expected", [
    (4, 1, [0, 0, 0, 0]), (4, 2, [0, 0, 1, 1]), (5, 2, [0, 0, 0, 1, 1]), (40, 4, [0] * 10 + [1] * 10 + [2] * 10 + [3] * 10),
])
def test_layers_fill_stages_in_contiguous_balanced_blocks(layers, pp, expected):
    assert layer_stages(layers, pp) == expected


def test_cpu_is_plain_data_parallel_with_the_steps_own_reduction():
    cfg = load_config(None, ["parallel.dp=2", "train.micro_batch=4"])
    assert decide(cfg).context == {"parallel_mode": "data_parallel", "gradients_mean": True, "device_num": 2}
    r = decide(cfg).reduction
    assert (r.hand_all_reduce, r.divide_by, r.pipeline, r.scalars_all_reduce) == (True, 2, False, False)


def test_one_rank_reduces_nothing():
    assert not decide(load_config(None, [])).reduction.hand_all_reduce


def test_ascend_dp_only_stays_data_parallel():
    assert mode(DP_ONLY) == DATA_PARALLEL
    assert decide(DP_ONLY).reduction.hand_all_reduce and decide(DP_ONLY).reduction.divide_by == 4


@pytest.mark.parametrize("cfg", [TP_ONLY, PP_ONLY, ALL_THREE, _cfg("parallel.dp=4", "parallel.optimizer_shard=true",
                                                                   "train.micro_batch=4")],
                         ids=["tp", "pp", "dp-tp-pp-sp", "dp-sharded"])
def test_model_parallel_layouts_leave_the_gradient_reduction_to_the_framework(cfg):
    # a hand-written world all-reduce on top of semi-auto's mirror operators would double-reduce
    # and sum tensor-parallel shards
    assert mode(cfg) == SEMI_AUTO
    r = decide(cfg).reduction
    assert not r.hand_all_reduce and r.divide_by == 1 and r.scalars_all_reduce
    assert r.pipeline == (cfg.parallel.pp > 1)


def test_semi_auto_is_configured_on_the_step_with_the_full_batch_and_the_strategy_file():
    assert decide(ALL_THREE).context == {}          # no global context: AutoParallel wraps the step
    s = decide(ALL_THREE).auto_parallel(strategy_file="/runs/x/strategy/rank_3.ckpt")
    assert s["parallel_mode"] == "semi_auto" and s["dataset_strategy"] == "full_batch"
    assert s["pipeline"] == {"stages": 2, "scheduler": "1f1b"} and s["hsdp"] == {"optimizer_level": "level1"}
    assert s["save_param_strategy_file"] == "/runs/x/strategy/rank_3.ckpt"
    tp = decide(TP_ONLY).auto_parallel()
    assert tp["pipeline"] is None and tp["hsdp"] is None
    assert decide(DP_ONLY).auto_parallel() == {}


def test_micro_batches_through_the_framework_include_the_accumulation_steps():
    assert micro_batches(TP_ONLY) == 4                # GradAccumulation over grad_accum_steps
    assert micro_batches(PP_ONLY) == 2 * 4            # pipeline micro-batches x accumulation steps
    assert micro_batches(ALL_THREE) == 4 * 2


def test_ranks_are_stage_major_then_dp_then_tp():
    # 8 ranks of dp2 x tp2 x pp2: ranks 0-3 are stage 0; within it (dp0: 0,1) (dp1: 2,3); tp innermost
    got = [tuple(vars(coordinates(r, ALL_THREE)).values()) for r in range(8)]
    assert got == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    with pytest.raises(ValueError):
        coordinates(8, ALL_THREE)


def test_data_parallel_ranks_feed_their_own_contiguous_slice():
    indices = np.arange(16)
    assert decide(DP_ONLY).rank_batch(indices, 1).tolist() == [[4, 5], [6, 7]]
    assert decide(DP_ONLY).rank_batch(indices, 3).tolist() == [[12, 13], [14, 15]]


def test_full_batch_ranks_all_feed_each_micro_step_as_every_dp_rank_would_see_it():
    indices = np.arange(16)
    # dp 2, micro_batch 4, accum 2: under data parallel rank 0 trains [0..3] then [4..7], rank 1 [8..11] then
    # [12..15]; fed whole, micro-step 0 is [0..3 | 8..11], which the batch split gives back to dp 0 and dp 1
    expected = [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]
    for rank in range(8):
        assert decide(ALL_THREE).rank_batch(indices, rank).tolist() == expected
    assert decide(TP_ONLY).rank_batch(indices, 2).tolist() == indices.reshape(4, 4).tolist()


@pytest.mark.parametrize("cfg", [DP_ONLY, TP_ONLY, PP_ONLY, ALL_THREE], ids=["dp", "tp", "pp", "all"])
def test_a_steps_samples_do_not_depend_on_the_layout(cfg):
    indices = np.random.default_rng(0).permutation(1000)[:16]
    fed = set()
    for rank in range(cfg.parallel.world_size):
        fed |= set(decide(cfg).rank_batch(indices, rank).ravel().tolist())
    assert fed == set(indices.tolist())


def test_megatron_column_and_row_strategies():
    cfg = _cfg("parallel.dp=2", "parallel.tp=2", "train.micro_batch=4", "train.grad_accum_steps=2")
    s = matmul_strategies(cfg)
    assert s["q_proj"] == ((2, 1), (2, 1))      # weight rows (output features) split across tp
    assert s["down_proj"] == ((2, 2), (1, 2))   # input features split, partial sums all-reduced
    assert s["lm_head"] == ((2, 1), (2, 1))     # vocabulary split
    assert row_parallel_out_strategy(cfg) is None


def test_sequence_parallel_splits_the_norm_region_and_reduce_scatters_row_outputs():
    s = cell_strategies(ALL_THREE)
    assert s["RMSNorm"]["mul"] == ((2, 2, 1), (1,)) and s["DecoderLayer"]["add_attn"] == ((2, 2, 1), (2, 2, 1))
    assert all(strategy[0] == (2, 2, 1) for strategy in s["RMSNorm"].values())     # the whole norm, not its last op
    assert row_parallel_out_strategy(ALL_THREE) == ((4, 1),)
    plain = cell_strategies(_cfg("parallel.dp=2", "parallel.tp=2", "train.micro_batch=4", "train.grad_accum_steps=2"))
    assert plain["RMSNorm"]["mul"] == ((2, 1, 1), (1,))
    assert plain["Attention"]["qk"] == ((2, 2, 1, 1), (2, 2, 1, 1))           # heads split across tp
    assert plain["Attention"]["split_heads"] == ((2, 1, 2, 1),)              # (B, T, heads, d) before the transpose
    assert plain["SwiGLU"]["silu"] == ((2, 1, 2),)                           # the column-parallel output's split
    assert plain["Embedding"]["gather"] == ((2, 1), (2, 1))


def test_stages_put_the_embedding_first_and_the_head_last():
    stages = cell_stages(PP_ONLY)
    assert stages["model.embed_tokens"] == 0 and stages["lm_head"] == 1 and stages["model.norm"] == 1
    assert [stages[f"model.layers.{i}"] for i in range(4)] == [0, 0, 1, 1]
    assert set(cell_stages(TP_ONLY).values()) == {0}


@pytest.mark.parametrize("overrides,words", [
    (["parallel.tp=3"], ["model.num_heads = 8 must be divisible by parallel.tp = 3"]),
    (["parallel.pp=3", "parallel.pipeline_microbatches=4", "train.micro_batch=4", "train.grad_accum_steps=4"],
     ["model.num_layers = 4 must be divisible by parallel.pp = 3"]),
    (["parallel.sp=true"], ["parallel.sp = true needs parallel.tp > 1"]),
    (["parallel.tp=2", "parallel.sp=true", "data.seq_len=63"], ["data.seq_len = 63", "parallel.tp = 2"]),
    (["parallel.pp=2", "parallel.pipeline_microbatches=1"], ["must be >= parallel.pp = 2"]),
])
def test_layout_rules_are_refused_in_one_line(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, ASCEND + SHAPE + ["train.micro_batch=16"] + overrides)
    assert "\n" not in str(info.value)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("path", ["configs/llama-7b.toml", "configs/llama-13b.toml"])
def test_shipped_ascend_configs_map_to_semi_auto_with_consistent_feeds(path):
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[2] / path, [])
    p = cfg.parallel
    assert mode(cfg) == SEMI_AUTO and not decide(cfg).reduction.hand_all_reduce
    fed = decide(cfg).rank_batch(np.arange(cfg.train.global_batch), 0)
    assert fed.shape == (cfg.train.grad_accum_steps, p.dp * cfg.train.micro_batch)
    assert max(cell_stages(cfg).values()) == p.pp - 1


def test_whole_tensor_checkpoints_resume_onto_any_layout_and_slices_only_onto_their_own():
    whole = decide(DP_ONLY).checkpoint_layout
    assert not whole["sliced"]
    for cfg in (TP_ONLY, PP_ONLY, ALL_THREE):
        assert resume_refusal(whole, decide(cfg)) is None
        assert resume_refusal(None, decide(cfg)) is None                      # saved before layouts were recorded
    sliced = decide(ALL_THREE).checkpoint_layout
    assert sliced["sliced"] and resume_refusal(sliced, decide(ALL_THREE)) is None
    message = resume_refusal(sliced, decide(TP_ONLY))
    assert "dp2 x tp2 x pp2 +sp +optimizer_shard" in message and "dp1 x tp4 x pp1" in message
    assert "transform_checkpoints" in message and "\n" not in message
    assert resume_refusal(sliced, decide(DP_ONLY)) is not None
