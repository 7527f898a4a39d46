"""`plan` on MindFormers' LLaMA-2 7B pretrain recipe, like for like (configs/mindformers-llama2-7b.toml,
parallel.plan_recipe = "mindformers"): each term against the standard formulas, and the total against the
58 GB cap that is the recipe's only published memory figure."""
from pathlib import Path

import pytest

from contracts.config import load_config
from contracts.errors import ConfigError
from engine.layout import memory_model as mm
from engine.layout import plan

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "mindformers-llama2-7b.toml"


def _recipe():
    cfg = load_config(RECIPE, [])
    return cfg, mm.estimate(cfg, runtime=True)[0], mm.total_param_count(cfg.model)


def test_the_config_is_mindformers_recipe():
    """pretrain_llama2_7b.yaml: data_parallel 8, model_parallel 1, pipeline_stage 1, batch_size 1,
    gradient_accumulation_steps 8, seq_length 4096, compute_dtype float16, use_flash_attention True,
    recompute False, enable_parallel_optimizer True, gradient_accumulation_shard False, max_device_memory 58GB."""
    cfg, _, n = _recipe()
    p, t = cfg.parallel, cfg.train
    assert (p.dp, p.tp, p.pp, p.optimizer_shard, p.sp) == (8, 1, 1, True, False)
    assert (t.micro_batch, t.grad_accum_steps, t.global_batch, cfg.data.seq_len) == (1, 8, 64, 4096)
    assert (t.precision, t.flash_attention, cfg.recompute_layers, p.device_memory_gib) == ("fp16", True, 0, 58.0)
    assert p.plan_recipe == "mindformers" and mm.Recipe.of(cfg) == mm.Recipe(param_dtype="fp16", half_stream=True)
    assert 6.73e9 < n < 6.75e9


def test_each_state_term_is_the_standard_formula():
    """fp16 weights (2 bytes/parameter) sharded by dp, fp32 moments (8 bytes) sharded by dp, fp16
    accumulators (2 bytes, clones of the weights) whole under level1, one layer's fp16 gradient at a time,
    no master copy, no cast (fp16 weights compute in fp16), and every weight's gathered fp16 whole kept for
    the backward pass (nothing recomputes)."""
    cfg, stage, n = _recipe()
    layer = sum(mm.layer_param_counts(cfg.model))
    assert stage.params == 2 * n // 8
    assert stage.optimizer == 8 * n // 8 + mm.STEP_SCALARS_BYTES
    assert stage.grad_accum == 2 * n
    assert stage.grads == 2 * layer
    assert stage.weight_copies == 0
    assert stage.gathered_weights == 2 * n
    assert stage.runtime == 2 * mm.GIB


def test_activations_are_korthikantis_half_precision_count_with_flash_attention():
    """Per layer, LLaMA without dropout: 16·s·b·h bytes (the two norms' inputs and outputs, q, k, v,
    attention's output) + 8·s·b·f (gate, SiLU(gate), up, their product), plus what flash attention and the
    fused norms keep per row; 32 layers of s 4096, b 1: 19.0 GiB. The head keeps four vocabulary-wide fp32
    tensors (logits, log-softmax, and their two in the backward pass)."""
    cfg, stage, _ = _recipe()
    m, s, b = cfg.model, 4096, 1
    h, f = m.hidden_size, m.intermediate_size
    per_layer = mm.layer_activation_bytes(m, seq=s, batch=b, compute_bytes=2, flash=True, half_stream=True)
    rows = 2 * 4 * s * b + 2 * 4 * 8 * b * m.num_heads * s          # two rstd, flash's softmax max and sum
    assert per_layer == 16 * s * b * h + 8 * s * b * f + rows
    assert 18.9 < 32 * per_layer / mm.GIB < 19.1
    head = mm.head_activation_bytes(m, seq=s, batch=b, compute_bytes=2, half_stream=True)
    assert head == 4 * s * b * h + 4 * s * b + 4 * 4 * s * b * m.vocab_size
    workspace = mm.backward_workspace_bytes(m, seq=s, batch=b, flash=True, compute_bytes=2)
    assert stage.activations == 32 * per_layer + head + workspace
    project = mm.layer_activation_bytes(m, seq=s, batch=b, compute_bytes=2, flash=True)
    assert project > per_layer * 1.7          # this project's model keeps its residual stream and MLP in fp32


def test_the_recipe_lands_within_10_percent_of_its_58_gb_cap():
    """max_device_memory "58GB" is MindSpore's GB (2**30 bytes): the cap MindFormers ran the recipe under."""
    _, stage, _ = _recipe()
    cap = 58 * mm.GIB
    assert abs(stage.total - cap) / cap < 0.10
    assert stage.total <= cap                  # and it fits, as MindFormers' runs do
    lines, verdict = plan.report(load_config(RECIPE, []), 8, plan.Hardware(memory_gib=58))
    assert verdict == "" and any("fits: " in line and "of 58 GiB" in line for line in lines)
    assert any("fp16 weights and both moments" in line for line in lines)


def test_the_recipe_is_for_plan_only():
    with pytest.raises(ConfigError, match='parallel.plan_recipe = "mindformers" is for `llm-pretrain plan` only'):
        plan.check_fits(load_config(RECIPE, []))
    with pytest.raises(ConfigError, match='needs train.device = "ascend"'):
        load_config(None, ['parallel.plan_recipe="mindformers"'])
    with pytest.raises(ConfigError, match="parallel.plan_recipe = 'other' is not allowed"):
        load_config(RECIPE, ['parallel.plan_recipe="other"'])
    assert load_config(None, []).parallel.plan_recipe == "project"
