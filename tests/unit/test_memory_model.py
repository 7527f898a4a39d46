"""The per-device memory estimate and the planner: hand-counted sizes, the effect of each knob,
the rules, and the refusal of an Ascend config that cannot fit."""
from pathlib import Path

import pytest

from contracts.config import load_config
from contracts.errors import ConfigError
from engine.layout import memory_model as mm
from engine.layout import plan

ROOT = Path(__file__).resolve().parents[2]
ASCEND = ['train.device="ascend"', 'train.precision="bf16"']
SEVEN_B = ROOT / "configs" / "llama-7b.toml"
THIRTEEN_B = ROOT / "configs" / "llama-13b.toml"


def test_parameters_of_the_tiny_model_counted_by_hand():
    m = load_config(None, []).model        # vocab 512, hidden 64, 2 layers, 4 heads, 2 kv heads, mlp 176
    layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 176 + 2 * 64
    assert mm.layer_param_counts(m) == (layer - 128, 128)
    assert mm.total_param_count(m) == 2 * layer + 512 * 64 * 2 + 64 == 158016


def test_tensor_parallel_splits_matrices_and_vocabulary_but_not_norms():
    m = load_config(None, []).model
    split, replicated = mm.layer_param_counts(m, tp=2)
    assert (split, replicated) == ((46208 - 128) // 2, 128)
    one = mm.stage_param_count(m, tp=2, pp=1, stage=0, layers=2)
    assert one == 2 * (split + replicated) + 2 * 512 * 64 // 2 + 64


def test_pipeline_stages_hold_their_layers_and_the_ends_hold_embedding_and_head():
    m = load_config(None, ["model.tie_embeddings=true"]).model
    split, replicated = mm.layer_param_counts(m)
    first = mm.stage_param_count(m, tp=1, pp=2, stage=0, layers=1)
    last = mm.stage_param_count(m, tp=1, pp=2, stage=1, layers=1)
    assert first == split + replicated + 512 * 64
    assert last == split + replicated + 64 + 512 * 64            # a tied embedding: a copy on the last stage
    assert mm.total_param_count(m) == 2 * (split + replicated) + 512 * 64 + 64   # one copy with pp = 1


def test_fp32_state_bytes_per_parameter():
    cfg = load_config(None, [])
    stage = mm.estimate(cfg)[0]
    n = 158016
    assert (stage.params, stage.grads, stage.grad_accum) == (4 * n, 4 * n, 0)
    assert stage.optimizer == 8 * n + mm.STEP_SCALARS_BYTES
    assert stage.weight_copies == 0 and stage.runtime == 0       # fp32 casts copy nothing; no runtime on CPU
    accum = mm.estimate(load_config(None, ["train.micro_batch=4", "train.grad_accum_steps=2"]))[0]
    assert accum.grad_accum == 4 * n


def test_optimizer_sharding_divides_weights_states_and_buffers_by_dp():
    base = ["parallel.dp=4", "train.micro_batch=2", "train.grad_accum_steps=1"]
    plain = mm.estimate(load_config(None, ASCEND + base))[0]
    sharded = mm.estimate(load_config(None, ASCEND + base + ["parallel.optimizer_shard=true"]))[0]
    assert sharded.params * 4 == plain.params
    assert sharded.optimizer - mm.STEP_SCALARS_BYTES == (plain.optimizer - mm.STEP_SCALARS_BYTES) // 4
    assert sharded.grads == plain.grads                          # the full gradient exists while it is produced


def test_activations_follow_batch_and_shrink_with_recompute_sp_and_tp():
    def acts(*extra):
        return mm.estimate(load_config(SEVEN_B, list(extra) + ["parallel.device_memory_gib=10000"]))[0].activations
    assert acts("train.recompute=false") > 5 * acts()                           # full recompute
    assert acts("train.recompute=false", "train.micro_batch=1", "train.grad_accum_steps=32") < \
        acts("train.recompute=false")
    one_row = ["train.recompute=false", "train.micro_batch=1", "train.grad_accum_steps=32"]    # sp's rule
    assert acts(*one_row, "parallel.sp=true") < acts(*one_row)


def test_flash_attention_keeps_no_sequence_squared_scores():
    """On Ascend (the default there) attention keeps its softmax's max and sum per row, not the (T, T)
    probabilities: at 7B, seq 4096, micro-batch 1, tp 2, that is 3 GiB per layer less (32 heads / 2 x
    4096^2 x (4 + 2) bytes, against 16 x 4096 x 64 bytes)."""
    m = load_config(SEVEN_B, []).model
    eager, flash = (mm.layer_activation_bytes(m, seq=4096, batch=1, compute_bytes=2, tp=2, flash=f) for f in (0, 1))
    assert eager - flash == 16 * 4096 * 4096 * 6 - 16 * 4096 * 64
    on, off = (mm.estimate(load_config(SEVEN_B, [f"train.flash_attention={v}", "train.recompute=false",
                                                 "parallel.device_memory_gib=10000"]))[0] for v in ("true", "false"))
    assert off.activations - on.activations > 32 * (eager - flash)      # every layer, and the backward's workspace
    assert load_config(None, ASCEND + ["train.flash_attention=true"]).train.flash_attention      # head size 16: fine
    from engine.layout.parallel import flash_attention

    assert flash_attention(load_config(None, ASCEND)) and not flash_attention(load_config(None, []))
    fp32 = load_config(None, ['train.device="ascend"', "model.num_heads=8", "model.num_kv_heads=4"])
    assert not flash_attention(fp32)          # no fp32 kernel: eager attention, and any head size


def test_flash_attention_needs_a_head_size_of_a_multiple_of_16():
    with pytest.raises(ConfigError, match=r"model.hidden_size / model.num_heads = 8 \(the head size\) must be a "
                                          r"multiple of 16 for train.flash_attention = true"):
        load_config(None, ASCEND + ["model.num_heads=8", "model.num_kv_heads=4"])
    assert not load_config(None, ASCEND + ["model.num_heads=8", "model.num_kv_heads=4",
                                           "train.flash_attention=false"]).train.flash_attention
    load_config(None, ["model.num_heads=8", "model.num_kv_heads=4"])          # the CPU's attention is eager


def test_a_1f1b_pipeline_holds_more_micro_batches_on_its_first_stage():
    stages = mm.estimate(load_config(THIRTEEN_B, ["train.recompute=false", "parallel.device_memory_gib=10000"]))
    per_layer = mm.layer_activation_bytes(load_config(THIRTEEN_B, []).model, seq=4096, batch=1, compute_bytes=2, tp=4,
                                          flash=True)
    assert stages[0].activations >= 2 * 20 * per_layer           # pp 2: stage 0 holds 2 micro-batches of 20 layers
    assert stages[1].activations < stages[0].activations


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_recompute_saves_more_than_60_percent_of_activation_memory(precision):
    # the seed's claim, for the shipped 7B layout in half precision
    def acts(recompute):
        return mm.estimate(load_config(SEVEN_B, [f'train.precision="{precision}"', f"train.recompute={recompute}",
                                                 "parallel.device_memory_gib=10000"]))[0].activations
    assert 1 - acts("true") / acts("false") > 0.6


def test_an_ascend_config_that_cannot_fit_is_refused_in_one_line_by_the_planner_not_the_schema():
    cfg = load_config(SEVEN_B, ["parallel.device_memory_gib=16"])     # the schema's rules hold: it loads
    with pytest.raises(ConfigError) as info:
        plan.check_fits(cfg)
    message = str(info.value)
    assert "\n" not in message and "parallel.device_memory_gib = 16" in message and "llm-pretrain plan" in message
    assert plan.check_fits(load_config(SEVEN_B, [])) is not None      # the shipped layout fits


@pytest.mark.parametrize("path,devices", [(SEVEN_B, 8), (THIRTEEN_B, 16)])
def test_the_shipped_ascend_configs_fit_and_their_proposals_obey_every_rule(path, devices):
    cfg = load_config(path, [])
    lines, verdict = plan.report(cfg, devices, plan.Hardware())
    assert verdict == "", "\n".join(lines)
    found = plan.propose(cfg, devices, plan.Hardware())
    assert found and [c.tokens_per_s for c in found] == sorted((c.tokens_per_s for c in found), reverse=True)
    for c in found:
        assert c.layout.devices == devices and not plan.broken_rules(cfg, c.layout)
        assert c.memory.total <= 64 * mm.GIB
        assert c.layout.tp <= 8                                  # tensor parallelism within a node
        applied = plan.config_with(cfg, c.layout)                # a proposal is a config that loads
        assert applied.parallel.world_size == devices


def test_plan_says_what_each_machine_needs_in_host_memory_to_initialise():
    """Semi-auto ranks initialise only their slices of the fp32 weights and both moments; a data-parallel
    Ascend rank (dp only, no optimizer sharding) builds whole copies: 8 of them on a machine."""
    cfg = load_config(SEVEN_B, [])
    stage = mm.estimate(cfg, runtime=True)[0]
    per_rank = (stage.params + stage.optimizer) / mm.GIB
    line = next(l for l in plan.report(cfg, 8, plan.Hardware())[0] if "host memory" in l)
    assert f"{per_rank:.1f} GiB per rank, {8 * per_rank:.1f} per machine of 8" in line and "slices" in line
    whole = load_config(SEVEN_B, ["parallel.dp=8", "parallel.tp=1", "parallel.optimizer_shard=false",
                                  "train.micro_batch=1", "train.grad_accum_steps=16", "parallel.device_memory_gib=1e4"])
    line = next(l for l in plan.report(whole, 8, plan.Hardware())[0] if "host memory" in l)
    count = mm.total_param_count(whole.model)
    assert f"{12 * count / mm.GIB:.1f} GiB per rank" in line and "copy" in line        # fp32 weights + 2 moments


def test_planning_a_broken_layout_reports_each_rule():
    cfg, layout, problem = plan.planned(str(SEVEN_B), ["parallel.tp=3"])
    assert "parallel.tp = 3" in problem and layout.tp == 3
    lines, verdict = plan.report(cfg, 12, plan.Hardware(), layout=layout)
    assert verdict == "a rule is broken: model.num_heads (32) divisible by tp (3)"
    assert any(line.startswith("  FAIL model.num_heads (32) divisible by tp (3)") for line in lines)


def test_fewer_devices_than_a_layout_needs_proposes_none():
    cfg = load_config(SEVEN_B, [])
    assert plan.propose(cfg, 1, plan.Hardware(memory_gib=64)) == []


def test_a_layout_for_other_devices_or_too_little_memory_says_why():
    cfg = load_config(SEVEN_B, [])
    assert plan.report(cfg, 16, plan.Hardware())[1] == "its layout (dp4 tp2 pp1 opt-shard) uses 8 devices, not 16"
    verdict = plan.report(cfg, 8, plan.Hardware(memory_gib=24))[1]
    assert verdict.startswith("it needs about ") and verdict.endswith("more than 24 GiB")


def test_dry_run_plays_the_first_rank_of_each_stage_and_reads_the_memory_pools_peak():
    from engine.layout import dry_run

    lay = mm.Layout.of(load_config(THIRTEEN_B, []))
    assert dry_run.stage_ranks(lay) == [0, 8]                   # dp2 x tp4 ranks per stage
    env = dry_run.stage_env(lay, 8, base={"PATH": "/bin", "MS_ROLE": "MS_WORKER"})
    assert (env["RANK_SIZE"], env["RANK_ID"], env["MS_SIMULATION_LEVEL"]) == ("16", "8", "1") and "MS_ROLE" not in env
    log = ("[INFO] PRE_ACT: total mem: 62000M, peak used mem: 30100M, in used mem: 1M, actual peak used mem: 30512M\n"
           "[INFO] PRE_ACT: ... actual peak used mem: 120M")
    assert dry_run.peak_bytes(log) == 30512 * 1024 ** 2
    assert dry_run.peak_bytes("Used peak memory usage (without fragments): 48874M\n"
                              "Actual peak memory usage (with fragments): 49000M") == 49000 * 1024 ** 2
    assert dry_run.peak_bytes("nothing here") is None
    assert dry_run.toolkit_home({"ASCEND_HOME_PATH": "/nonexistent"}) is None or Path("/usr/local/Ascend").is_dir()


def test_optimizer_sharding_keeps_each_gathered_weight_from_forward_to_backward():
    """The parallel optimizer all-gathers each sharded weight for the forward pass and keeps the whole until
    the backward pass, recomputed layers included: at 7B dp4 x tp2, 12.5 GiB of fp32 per device."""
    big = ["parallel.device_memory_gib=10000"]
    cfg = load_config(SEVEN_B, big)
    assert cfg.parallel.optimizer_shard and cfg.parallel.dp == 4 and cfg.recompute_layers == cfg.model.num_layers
    stage = mm.estimate(cfg)[0]
    count = mm.stage_param_count(cfg.model, tp=2, pp=1, stage=0, layers=cfg.model.num_layers)
    assert stage.gathered_weights == 4 * count and 12.4 < stage.gathered_weights / mm.GIB < 12.7
    unsharded = mm.estimate(load_config(SEVEN_B, big + ["parallel.optimizer_shard=false"]))[0]
    assert unsharded.gathered_weights == 0 and stage.total - stage.gathered_weights < unsharded.total
