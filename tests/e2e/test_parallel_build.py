"""The Ascend layouts' cells, built (not compiled: MindSpore refuses semi-auto parallel on CPU) with the
real MindSpore, and the memory model's state sizes against the tensors a real CPU build allocates."""
from pathlib import Path

import numpy as np
import pytest

from contracts.config import load_config
from engine.layout import memory_model as mm
from engine.layout.parallel import decide

ROOT = Path(__file__).resolve().parents[2]
ASCEND = ["model.hidden_size=128", 'train.device="ascend"', 'train.precision="bf16"', "model.num_heads=8", "model.num_kv_heads=4",
          "model.num_layers=4", "train.global_batch=16"]
TP = ASCEND + ["parallel.dp=2", "parallel.tp=2", "train.micro_batch=4", "train.grad_accum_steps=2"]
PP = ASCEND + ["parallel.pp=2", "parallel.pipeline_microbatches=2", "train.micro_batch=4", "train.grad_accum_steps=4"]
ALL = ASCEND + ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.pipeline_microbatches=4",
                "parallel.sp=true", "parallel.optimizer_shard=true", "train.micro_batch=4", "train.grad_accum_steps=2"]


def _primitive_names(cell) -> set[str]:
    from mindspore.ops import Primitive

    return {type(v).__name__ for _, c in cell.cells_and_names() for v in [*vars(c).values(), *c._primitives.values()]
            if isinstance(v, Primitive)}


@pytest.mark.parametrize("overrides,pp", [(TP, 1), (PP, 2), (ALL, 2)], ids=["dp-tp", "pp", "dp-tp-pp-sp"])
def test_semi_auto_layouts_build_with_stages_strategies_and_the_frameworks_accumulation(mindspore_cpu, overrides, pp):
    from engine.model.causal_lm import InlinedCausalLM, build_model
    from engine.training.sharded_step import PipelineStep, ShardedStep

    cfg = load_config(None, overrides)
    net = build_model(cfg, decide(cfg))
    assert isinstance(net, InlinedCausalLM)      # every layout here has micro-batches
    cells = dict(net.cells_and_names())
    q = cells["model.layers.0.self_attn.q_proj"].matmul.attrs["in_strategy"]
    assert q == ((cfg.parallel.dp, 1), (cfg.parallel.tp, 1))
    o = cells["model.layers.0.self_attn.o_proj"].matmul.attrs
    assert ("out_strategy" in o) == cfg.parallel.sp
    if pp > 1:
        assert cells["model.embed_tokens"].pipeline_stage == 0
        assert [cells[f"model.layers.{i}"].pipeline_stage for i in range(4)] == [0, 0, 1, 1]
        assert cells["lm_head"].pipeline_stage == cells["loss"].pipeline_stage == cells["model.norm"].pipeline_stage == 1
    step = (PipelineStep if pp > 1 else ShardedStep)(net, cfg)
    assert type(step.network).__name__ == ("Pipeline" if pp > 1 else "GradAccumulation")
    # under pp the step's one input is the tokens (lr and poison are parameters) and the differentiated cell
    # keeps a graph of its own, so MindSpore's pipeline pass finds the lazily inlined network's calls in it
    assert (type(step.scaled_loss).__name__ == "_PipelinedScaledLoss") == (pp > 1)
    assert step.scaled_loss.get_flags().get("defer_inline", False) == (pp > 1)
    assert step.micro == cfg.train.grad_accum_steps * (cfg.parallel.pipeline_microbatches if pp > 1 else 1)
    assert type(step.reducer).__name__ == "GradReducer"      # engine/training/grad_reducer.py: 2.10's own fails
    # the framework reduces the gradients: the step's collectives of its own sum the non-finite flag and the
    # global norm's square sums over the world (issue 47)
    names = _primitive_names(step)
    assert "MatMul" in names and not names & {"ReduceScatter", "AllGather"}
    from mindspore.ops import AllReduce
    reduces = [v for _, c in step.cells_and_names() for v in [*vars(c).values(), *c._primitives.values()]
               if isinstance(v, AllReduce)]
    assert reduces and all(r is step.world_sum or r is step.norm_sum for r in reduces)
    assert not any(p.attrs.get("grad_scale") for _, c in step.cells_and_names() for p in c._primitives.values()
                   if p is not None)         # nothing for HandleGlobalNormScale's depth-limited search


def test_pipeline_stage_one_layout_builds_and_leaves_stages_unset(mindspore_cpu):
    from engine.model.causal_lm import build_model

    cfg = load_config(None, TP)
    net = build_model(cfg, decide(cfg))
    assert all(getattr(c, "pipeline_stage", 0) == 0 for c in net.cells())


def test_data_parallel_step_reduces_by_hand_and_the_cpu_model_is_untouched(mindspore_cpu):
    from engine.model.causal_lm import build_model
    from engine.training.step import TrainStep, build_step

    cfg = load_config(None, [])
    net = build_model(cfg, decide(cfg))
    step = build_step(net, cfg, decide(cfg))
    assert isinstance(step, TrainStep) and step.all_reduce is None      # one rank: nothing to reduce
    assert "in_strategy" not in net.model.layers[0].self_attn.q_proj.matmul.attrs


@pytest.mark.parametrize("path,overrides", [
    (None, []), (None, ["train.micro_batch=4", "train.grad_accum_steps=2"]),
    (ROOT / "configs" / "small-20m.toml", []), (None, ['model.arch="gpt2"', "model.tie_embeddings=true"]),
], ids=["tiny", "tiny-accum", "small-20m", "gpt2-tied"])
def test_state_sizes_equal_the_tensors_a_cpu_build_allocates(mindspore_cpu, path, overrides):
    import mindspore as ms

    from engine.model.causal_lm import build_model
    from engine.training.step import build_step

    cfg = load_config(path, overrides)
    net = build_model(cfg, decide(cfg))
    step = build_step(net, cfg, decide(cfg))
    nbytes = lambda params: sum(int(np.prod(p.shape)) * p.data.itemsize for p in params)
    estimate = mm.estimate(cfg)[0]
    assert estimate.params == nbytes(net.trainable_params())
    assert estimate.optimizer == nbytes(step.state())
    assert estimate.grad_accum == nbytes(step.grad_buffers)
    _, grads = ms.jit(step._backward)(ms.Tensor(np.ones((1, 9), np.int32)), ms.Tensor(1.0, ms.float32))
    assert estimate.grads == sum(g.asnumpy().nbytes for g in grads)
