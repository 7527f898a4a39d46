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


def _seven_b(*extra):
    cfg = load_config(SEVEN_B, ["parallel.device_memory_gib=10000", *extra])
    split, replicated = mm.layer_param_counts(cfg.model, cfg.parallel.tp)
    count = mm.stage_param_count(cfg.model, tp=cfg.parallel.tp, pp=1, stage=0, layers=cfg.model.num_layers)
    return cfg, mm.estimate(cfg)[0], split + replicated, count


def test_level1_keeps_the_gradient_accumulators_whole_and_only_level2_shards_them():
    """Rule 1. The project sets the parallel optimizer at level1, which leaves MindSpore's
    grad_accumulation_shard false: SetClonedTensorShapeForOptimizer gives `accu_grads` the parameter's
    tensor-parallel slice, not its dp shard. At 7B dp4 x tp2 with accumulation 16: 12.55 GiB, not 3.14."""
    from engine.layout import parallel

    cfg, stage, _, count = _seven_b()
    assert parallel.OPTIMIZER_LEVEL == "level1"
    assert parallel.decide(cfg).auto_parallel()["hsdp"] == {"optimizer_level": "level1"}
    assert cfg.parallel.optimizer_shard and cfg.train.grad_accum_steps == 16
    assert stage.grad_accum == 4 * count and 12.5 < stage.grad_accum / mm.GIB < 12.6
    assert stage.params == 4 * count // 4                          # the weights do shard across dp 4
    level2 = mm.estimate(cfg, optimizer_level="level2")[0]
    assert level2.grad_accum == 4 * count // 4 and level2.params == stage.params
    piped = mm.estimate(load_config(THIRTEEN_B, []))                # the pipeline's accumulators: whole too
    for k, s in enumerate(piped):
        assert s.grad_accum == 4 * mm.stage_param_count(load_config(THIRTEEN_B, []).model, tp=4, pp=2, stage=k,
                                                        layers=20)


def test_on_ascend_each_gradient_goes_into_its_accumulator_layer_by_layer():
    """Rule 2. With accumulation (or a pipeline) on Ascend a gradient lives from its production to its
    AssignAdd into the accumulator: one layer's (the largest unit: a decoder layer, the embedding or the
    head) is counted, not the whole model's. With one micro-batch per step the whole gradient is produced
    before it is reduced, and the CPU keeps its whole count (what a CPU build measures)."""
    cfg, stage, layer, count = _seven_b()
    embed = cfg.model.vocab_size * cfg.model.hidden_size // 2
    assert layer > embed and stage.grads == 4 * layer
    one_step = mm.estimate(load_config(SEVEN_B, ["train.micro_batch=32", "train.grad_accum_steps=1",
                                                 "parallel.device_memory_gib=1e4"]))[0]
    assert one_step.grads == 4 * count and one_step.grad_accum == 0
    small_vocab_head = load_config(None, ASCEND + ["train.micro_batch=4", "train.grad_accum_steps=2"])
    m = small_vocab_head.model
    assert mm.estimate(small_vocab_head)[0].grads == 4 * max(sum(mm.layer_param_counts(m)),
                                                             m.vocab_size * m.hidden_size)
    piped = mm.estimate(load_config(THIRTEEN_B, []))                # the pipeline accumulates too
    split, replicated = mm.layer_param_counts(load_config(THIRTEEN_B, []).model, 4)
    assert [s.grads for s in piped] == [4 * (split + replicated)] * 2
    cpu = mm.estimate(load_config(None, ["train.micro_batch=4", "train.grad_accum_steps=2"]))[0]
    assert cpu.grads == 4 * mm.total_param_count(load_config(None, []).model)


def test_the_gathered_weight_dies_at_its_cast_unless_its_layer_recomputes():
    """Rule 3. The parallel optimizer all-gathers each weight in its own dtype (fp32) before the cast to
    bf16. A layer that does not recompute keeps the cast (weight_copies), and the gathered fp32 whole dies
    there; a recomputed layer keeps the gathered whole (MindSpore recomputes the all-gather only with
    parallel_optimizer_comm_recompute) to cast it again. Where nothing is cast (fp32 compute), every layer
    keeps it: it is the matmul's operand."""
    cfg, stage, layer, count = _seven_b()
    assert cfg.recompute_layers == 32
    assert stage.gathered_weights == 4 * 32 * layer and 12.0 < stage.gathered_weights / mm.GIB < 12.1
    assert stage.weight_copies == 2 * (count - 31 * layer)         # embedding, head, one layer being rebuilt
    _, eight, _, _ = _seven_b("train.recompute_num_layers=8")
    assert eight.gathered_weights == 4 * 8 * layer
    _, plain, _, _ = _seven_b("train.recompute=false")
    assert plain.gathered_weights == 0 and plain.weight_copies == 2 * count
    _, fp32, _, _ = _seven_b('train.precision="fp32"', "train.recompute=false")
    assert fp32.gathered_weights == 4 * count and fp32.weight_copies == 0
    _, unsharded, _, _ = _seven_b("parallel.optimizer_shard=false")
    assert unsharded.gathered_weights == 0 and unsharded.params == 4 * count


def test_the_shipped_configs_per_device_estimates():
    """configs/llama-7b.toml and llama-13b.toml as docs/ascend.md shows them."""
    seven = mm.estimate(load_config(SEVEN_B, []), runtime=True)
    assert round(seven[0].total / mm.GIB, 2) == 45.11
    thirteen = mm.estimate(load_config(THIRTEEN_B, []), runtime=True)
    assert [round(s.total / mm.GIB, 2) for s in thirteen] == [27.87, 26.99]


def test_cpu_estimates_are_the_counts_a_cpu_build_holds():
    """None of the Ascend rules reaches the CPU: the tiny model's whole-step counts by hand."""
    n = 158016
    for overrides in ([], ["train.micro_batch=4", "train.grad_accum_steps=2"], ['train.precision="fp16"'],
                      ["train.recompute=true"], ["parallel.dp=2", "train.micro_batch=4"]):
        stage = mm.estimate(load_config(None, overrides))[0]
        accum = 4 * n if "train.grad_accum_steps=2" in overrides else 0
        assert (stage.params, stage.grads, stage.grad_accum, stage.gathered_weights) == (4 * n, 4 * n, accum, 0)
        assert stage.weight_copies == (2 * n if 'train.precision="fp16"' in overrides else 0)
