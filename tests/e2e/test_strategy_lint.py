"""The Ascend layouts checked on the CPU (issue 34's strategy lint): what MindSpore needs of the cells
and the optimizer to compile a semi-auto step right, read off the real MindSpore objects a CPU builds
(semi-auto itself does not compile on CPU). Run on every shipped config, shrunk to a small model of the
same structure and layout, and on dp-, tp-, pp-only, sp and all-four layouts of a small model."""
from pathlib import Path

import numpy as np
import pytest
from mindspore.common.initializer import Zero

from contracts.config import load_config, with_changes
from engine.layout.parallel import decide, micro_batches

ROOT = Path(__file__).resolve().parents[2]
ASCEND = ["model.hidden_size=128", 'train.device="ascend"', 'train.precision="bf16"', "model.num_heads=8", "model.num_kv_heads=4",
          "model.num_layers=4", "train.global_batch=16"]
LAYOUTS = {
    "dp": ASCEND + ["parallel.dp=8", "train.micro_batch=2"],
    "dp-accum": ASCEND + ["parallel.dp=4", "train.micro_batch=2", "train.grad_accum_steps=2"],
    "dp-accum-no-opt-shard": ASCEND + ["parallel.dp=2", "parallel.tp=2", "parallel.optimizer_shard=false",
                                       "train.micro_batch=4", "train.grad_accum_steps=2"],
    "tp": ASCEND + ["parallel.tp=2", "train.micro_batch=16"],
    "pp": ASCEND + ["parallel.pp=2", "parallel.pipeline_microbatches=2", "train.micro_batch=4",
                    "train.grad_accum_steps=4"],
    "sp": ASCEND + ["parallel.tp=2", "parallel.sp=true", "train.micro_batch=1", "train.grad_accum_steps=16"],
    "gpt2-tp-sp": ASCEND + ['model.arch="gpt2"', "model.num_kv_heads=8", "parallel.tp=2", "parallel.sp=true",
                            "train.micro_batch=1", "train.grad_accum_steps=16"],
    "dp-tp-pp-sp": ASCEND + ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.pipeline_microbatches=4",
                             "parallel.sp=true", "parallel.optimizer_shard=true", "train.micro_batch=4",
                             "train.grad_accum_steps=2"],
}
SHRUNK = ["model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=4", "model.intermediate_size=128",
          "model.vocab_size=256", "model.max_seq_len=32", "data.seq_len=32"]


def _configs():
    for name, overrides in LAYOUTS.items():
        yield pytest.param(None, overrides, id=name)
    for path in sorted((ROOT / "configs").glob("*.toml")):
        cfg = load_config(path, [])
        if cfg.train.device != "ascend":
            continue
        layers = [f"model.num_layers={2 * cfg.parallel.pp}"]
        yield pytest.param(path, SHRUNK + layers, id=path.stem)


@pytest.fixture
def _step(tmp_path):
    """The model and the cell that holds its optimizer, built as a rank builds them (not compiled)."""
    from engine.training.step import build_network

    def build(cfg):
        cfg = with_changes(cfg, {"run.dir": str(tmp_path / "run")})     # where the step keeps its strategy files
        net, step = build_network(cfg, decide(cfg))
        return net, getattr(step, "cell", step)
    return build


@pytest.mark.parametrize("path,overrides", list(_configs()))
def test_every_optimizer_state_is_a_clone_of_its_weight(mindspore_cpu, _step, path, overrides):
    """MindSpore slices an optimizer state like its weight (tp, optimizer sharding) only if it is the
    weight's clone; a new Parameter keeps the full shape and fails to compile against the sliced gradient."""
    cfg = load_config(path, overrides)
    net, step = _step(cfg)
    weights = list(net.trainable_params())
    opt = step.optimizer
    for prefix, states in (("adam_m", opt.exp_avg), ("adam_v", opt.exp_avg_sq)):
        assert len(states) == len(weights)
        for w, m in zip(weights, states):
            cloned = getattr(w.param_info, "cloned_obj", [])
            assert any(c is m for c in cloned), f"{m.name} is not a clone of {w.name}"
            assert m.name == f"{prefix}.{w.name}" and m.shape == w.shape and not m.requires_grad
            assert isinstance(m.init_mode.init, Zero) if m.has_init else not m.asnumpy().any()


@pytest.mark.parametrize("path,overrides", list(_configs()))
def test_a_step_with_micro_batches_inlines_its_network_lazily(mindspore_cpu, _step, path, overrides):
    """With a pipeline's micro-batches or MindSpore's accumulation, the outermost network cell is
    `lazy_inline` (one compiled subgraph reused per micro-batch, not the network copied once per
    micro-batch); without micro-batches it is not."""
    cfg = load_config(path, overrides)
    net, step = _step(cfg)
    lazy = str(getattr(net, "cell_init_args", "")).startswith("lazy_inline_")
    assert lazy == (decide(cfg).semi_auto and micro_batches(cfg) > 1), (type(net).__name__, micro_batches(cfg))


@pytest.mark.parametrize("opt_shard", [False, True], ids=["accumulators", "optimizer-sharded"])
def test_the_grad_reducer_compiles_and_hands_back_the_accumulated_gradients(mindspore_cpu, opt_shard):
    """MindSpore 2.10's PipelineGradReducer does not compile without optimizer sharding (its construct
    reads `grads` before assigning it); ours does, and divides what was accumulated by the scale."""
    from mindspore import Parameter, ParameterTuple, Tensor
    from mindspore.parallel.nn import PipelineGradReducer

    from engine.training.grad_reducer import GradReducer

    params = ParameterTuple([Parameter(Tensor(np.ones((2, 3), np.float32)), name="w"),
                             Parameter(Tensor(np.ones(3, np.float32)), name="b")])
    grads = (Tensor(np.full((2, 3), 6.0, np.float32)), Tensor(np.full(3, 9.0, np.float32)))
    reducer = GradReducer(params, scale_sense=3.0, opt_shard=opt_shard)
    accumulated = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([3.0, 6.0, 9.0], np.float32)]
    for acc, value in zip(reducer.accu_grads, accumulated):
        acc.set_data(Tensor(value))
    out = [g.asnumpy() for g in reducer(grads)]
    # without sharding the gradients are in the accumulators; with it, MindSpore accumulated them into `grads`
    expected = [g.asnumpy() / 3.0 for g in grads] if opt_shard else [a / 3.0 for a in accumulated]
    for got, want in zip(out, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert not any(a.asnumpy().any() for a in reducer.accu_grads)      # zeroed for the next step
    if not opt_shard:          # why ours exists: when this stops raising, engine/training/grad_reducer.py can go
        with pytest.raises(NameError, match="grads"):
            PipelineGradReducer(params, opt_shard=False)(grads)


def test_a_sliced_save_writes_only_what_the_rank_holds_and_a_restore_keeps_the_slices(mindspore_cpu, tmp_path):
    """Under semi-auto a rank saves the parameters its compiled step marked `sliced` (its stage's), not
    another pipeline stage's never-trained full copies, and a restore keeps them marked: a parameter
    `set_data` without the flag would be sliced again by a recompile."""
    from mindspore import Parameter, Tensor

    from checkpointing import layout, reader
    from engine.rank.checkpoint import TrainerCheckpoints

    cfg = load_config(None, LAYOUTS["pp"])
    parallelism = decide(cfg)
    assert parallelism.semi_auto

    def params():
        mine = Parameter(Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)), name="model.layers.2.w")
        theirs = Parameter(Tensor(np.full(4, 7.0, np.float32)), name="model.layers.0.w")
        return mine, theirs

    state = {"step": 5, "data_cursor": 80, "data_epoch": 0, "skip_ranges": [], "lr_overrides": [],
             "quarantined_blocks": []}
    loaded, events = [], []

    def checkpoints(ps):
        return TrainerCheckpoints(tmp_path / "checkpoints", cfg, params=list(ps), run_state=lambda: dict(state),
                                  load_run_state=loaded.append, rank=0, world=1, generation=0, emit=events.append,
                                  parallelism=parallelism)

    mine, theirs = params()
    mine.sliced = True                       # what the compile does to this stage's parameters
    saver = checkpoints((mine, theirs))
    saver.save({"loss": 1.0})
    assert saver.wait(), [e.detail for e in events]
    path = layout.step_dir(tmp_path / "checkpoints", 5)
    assert sorted(reader.load_tensors(path, reader.read_manifest(path))) == ["rank0/model.layers.2.w"]

    mine, theirs = params()
    mine.set_data(Tensor(np.zeros((2, 3), np.float32)))
    with pytest.raises(Exception, match="must be compiled before it loads"):
        checkpoints((mine, theirs)).restore_latest(before_slices=lambda: None)

    def compile_():
        mine.sliced = True

    assert checkpoints((mine, theirs)).restore_latest(before_slices=compile_)["step"] == 5
    assert mine.sliced and np.array_equal(mine.asnumpy(), np.arange(6).reshape(2, 3))
    assert not theirs.sliced and np.array_equal(theirs.asnumpy(), np.full(4, 7.0))


@pytest.mark.parametrize("path,overrides", list(_configs()))
def test_a_semi_auto_rank_leaves_its_weights_for_the_compile_to_initialise_slice_by_slice(mindspore_cpu, _step,
                                                                                         path, overrides):
    """Under semi-auto every weight matrix and its moments are built as initializers, not data (the compile
    initialises only the rank's slices: no rank holds the whole fp32 model and both moments in host memory);
    a data-parallel build draws whole tensors, as before."""
    from engine.model.lazy_init import SaltedNormal

    cfg = load_config(path, overrides)
    net, step = _step(cfg)
    matrices = [p for p in net.trainable_params() if len(p.shape) >= 2]
    states = [*step.optimizer.exp_avg, *step.optimizer.exp_avg_sq]
    if not decide(cfg).semi_auto:
        assert not any(p.has_init for p in [*matrices, *states])
        return
    assert all(p.has_init and isinstance(p.init_mode.init, SaltedNormal) for p in matrices), \
        [p.name for p in matrices if not p.has_init]
    of_matrices = [m for m in states if len(m.shape) >= 2]     # norms and biases are small, and made whole
    assert all(m.has_init and isinstance(m.init_mode.init, Zero) for m in of_matrices)
    salts = [p.init_mode.init.salt for p in matrices]
    assert len(set(salts)) == len(salts)          # every weight its own draws


def test_salted_normal_slices_agree_across_replicas_and_differ_across_weights_blocks_and_shards(mindspore_cpu,
                                                                                                monkeypatch):
    """MindSpore seeds numpy with (slice index + global seed) before it initialises a slice, the index being the
    tensor block's, plus the device count and the optimizer-shard rank when the parameter is optimizer-sharded
    (a sum: at dp 4 x tp 2, block 1 of shard rank 0 and block 0 of shard rank 1 get the same seed). Played
    here rank by rank for a column-parallel weight: replicas of a slice draw the same values; blocks, shards
    and weights of one shape never do."""
    import importlib

    import mindspore.communication as comm

    from engine.model.lazy_init import SaltedNormal

    seed, dp, tp = 1234, 4, 2
    monkeypatch.setattr(importlib.import_module("mindspore.common.seed"), "get_seed", lambda: seed)
    monkeypatch.setattr(comm, "get_group_size", lambda *a: dp * tp)

    def draw(rank, salt, opt_shard):
        monkeypatch.setattr(comm, "get_rank", lambda *a: rank)
        block, dp_index = rank % tp, rank // tp
        np.random.seed(block + (dp * tp + dp_index if opt_shard else 0) + seed)     # MindSpore's _get_slice_index
        arr = np.empty((16, 32), np.float32)
        SaltedNormal(0.02, salt, stage_ranks=dp * tp, tp=tp)(arr)
        return arr.tobytes()

    sharded = [draw(r, 3, True) for r in range(dp * tp)]
    assert len(set(sharded)) == dp * tp                        # 2 blocks x 4 shards: eight different slices
    replicated = [draw(r, 3, False) for r in range(dp * tp)]
    assert len(set(replicated)) == tp                          # the dp replicas of each block agree
    assert all(replicated[r] == replicated[r % tp] for r in range(dp * tp))
    assert draw(0, 4, False) != replicated[0] and draw(0, 4, True) != sharded[0]   # another weight of one shape
    values = np.frombuffer(b"".join(sharded), np.float32)
    assert 0.018 < values.std() < 0.022 and abs(values.mean()) < 0.002


# The loss's gradient under a layout: a numpy model of how a semi-auto compile splits the loss's rows.
# A primitive MindSpore registers as batch-parallel (BatchParallelInfo) splits its rows over every device
# of the stage and reduces them on each device alone, with no communication: SparseSoftmaxCrossEntropy-
# WithLogits returns each device's mean of its own rows. Any other reduction over a split axis is
# all-reduced by the compiler and keeps its single-device meaning. The mirror operators then sum the
# devices' gradients (gradients_mean off, sharded_step.py), so the update's gradient is that sum. Under
# DATA_PARALLEL each rank takes the mean of its own dp slice and the step divides the all-reduced sum by dp
# (Parallelism.reduction.divide_by).
BATCH_PARALLEL = {"SparseSoftmaxCrossEntropyWithLogits"}


def _primitives(cell):
    from mindspore.ops import Primitive

    return {name: value for name, value in vars(cell).get("_primitives", {}).items() if isinstance(value, Primitive)}


def _loss_gradient_factor(loss_cell, dp: int, tp: int, divide_by: int = 1, rows: int = 32, vocab: int = 16) -> float:
    """The update's gradient of the logits over the global-mean cross entropy's, as the devices of one
    stage would compute it with `loss_cell`'s primitives (1.0: right under this layout)."""
    rng = np.random.default_rng(0)
    logits, targets = rng.normal(size=(rows, vocab)), rng.integers(0, vocab, rows)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    per_row = probs - np.eye(vocab)[targets]                 # d(row's loss)/d(its logits)
    true = per_row / rows
    batch_parallel = [n for n, p in _primitives(loss_cell).items() if type(p).__name__ in BATCH_PARALLEL]
    devices = dp * tp
    if batch_parallel:              # each device: the mean of its rows / devices rows, no communication
        blocks = np.split(per_row, devices)
        summed = np.concatenate([b / len(b) for b in blocks])
    else:                           # the global sum's share of each device's (rows/dp, vocab/tp) block
        summed = np.block([[b / rows for b in np.split(r, tp, axis=1)] for r in np.split(per_row, dp)])
    return float(np.median(summed / divide_by / true))


@pytest.mark.parametrize("path,overrides", list(_configs()))
def test_the_loss_gradient_is_the_global_means_under_every_layout(mindspore_cpu, _step, path, overrides):
    """Issue 34, item 2: under semi-auto the loss is built of primitives that keep their meaning when split,
    the logits split by rows across dp and by vocabulary across tp (never gathered to the whole vocabulary),
    so the gradient is the global mean's (factor 1), not dp·tp times it."""
    from engine.layout.parallel import loss_strategies

    cfg = load_config(path, overrides)
    net, _ = _step(cfg)
    dp, tp = cfg.parallel.dp, cfg.parallel.tp
    assert _loss_gradient_factor(net.loss, dp, tp, decide(cfg).reduction.divide_by) == pytest.approx(1.0)
    if not decide(cfg).semi_auto:
        return
    for name, prim in _primitives(net.loss).items():
        assert prim.attrs.get("in_strategy") == loss_strategies(cfg)[name], f"loss.{name} ({type(prim).__name__})"
        if name in ("max", "exp", "sum_exp", "pick", "one_hot"):         # over the logits: vocab split by tp
            assert prim.attrs["in_strategy"][0] == (dp, tp)


def test_the_fused_loss_would_scale_the_gradient_by_the_devices_that_split_its_rows(mindspore_cpu):
    """The model above tells the two losses apart: the CPU's fused op, used under semi-auto, gives dp·tp."""
    from engine.model.causal_lm import NextTokenLoss
    from engine.model.parallel_loss import VocabParallelCrossEntropy

    assert _loss_gradient_factor(NextTokenLoss(), 2, 4) == pytest.approx(8.0)
    assert _loss_gradient_factor(VocabParallelCrossEntropy(), 2, 4) == pytest.approx(1.0)


def test_the_vocab_parallel_loss_gives_the_fused_ops_loss_and_gradient(mindspore_cpu):
    """Unsplit (stand-alone, as on one device) it is the same cross entropy as the CPU's fused op."""
    import mindspore as ms
    from mindspore import Tensor

    from engine.model.causal_lm import NextTokenLoss
    from engine.model.parallel_loss import VocabParallelCrossEntropy

    rng = np.random.default_rng(1)
    logits = Tensor(rng.normal(0, 3, size=(2, 8, 50)).astype(np.float32))
    targets = Tensor(rng.integers(0, 50, size=(2, 8)).astype(np.int32))
    results = []
    for cell in (NextTokenLoss(), VocabParallelCrossEntropy()):
        loss, grad = ms.value_and_grad(cell, grad_position=0)(logits, targets)
        results.append((float(loss.asnumpy()), grad.asnumpy()))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-5, atol=1e-8)


def _nodes(folder: Path):
    from tests.e2e import strategy_lint

    return strategy_lint.read_nodes(strategy_lint.forward_ir(folder))


def _forward_problems(cfg, folder: Path) -> list[str]:
    """Compiles the layout's model's forward loss on the CPU with its IR saved, and lints every primitive."""
    import mindspore as ms
    from mindspore import Tensor

    from engine.model.causal_lm import build_model
    from tests.e2e import strategy_lint

    net = build_model(cfg, decide(cfg))
    rows, seq = cfg.train.micro_batch * cfg.parallel.dp, cfg.data.seq_len
    tokens = Tensor(np.zeros((rows, seq), np.int32))
    ms.set_context(save_graphs=1, save_graphs_path=str(folder))
    try:
        net.compile(tokens, tokens)
    except (RuntimeError, TypeError):   # the CPU backend has no bf16 or flash attention kernels, and refuses
        if not list(folder.glob("*_inline_*.ir")):    # lazy_inline's reused graph: after the IR we read
            raise
    finally:
        ms.set_context(save_graphs=0)
    nodes = _nodes(folder)
    assert len(nodes) > 50, f"only {len(nodes)} nodes read: has MindSpore's IR format changed?"
    p = cfg.parallel
    return strategy_lint.problems(nodes, devices=p.dp * p.tp, tp=p.tp)


def _semi_auto_configs():
    return [p for p in _configs() if decide(load_config(*p.values)).semi_auto]


@pytest.mark.parametrize("path,overrides", _semi_auto_configs())
def test_every_primitive_the_model_calls_has_a_strategy_that_fits(mindspore_cpu, tmp_path, monkeypatch, path,
                                                                  overrides):
    """Issue 34, item 3: every primitive of a semi-auto model's forward pass (read off the graph MindSpore
    compiles) has a strategy of its inputs' ranks that divides their shapes within the stage's devices, or
    is one the compiler lays out from its neighbours (Reshape, Cast, ...)."""
    cfg = load_config(path, overrides)
    monkeypatch.chdir(tmp_path)                    # MindSpore writes rank_0/ beside a failed compile
    assert _forward_problems(cfg, tmp_path / "ir") == []
    ops_ = {n.op for n in _nodes(tmp_path / "ir")}
    assert ("FlashAttentionScore" in ops_) == cfg.train.flash_attention and ("Softmax" in ops_) != ("FlashAttentionScore" in ops_)


def test_a_missing_or_misfit_strategy_is_named_with_its_op_and_cell(mindspore_cpu, tmp_path, monkeypatch):
    """The lint fails where it should: a strategy dropped from SwiGLU's SiLU, one of the wrong rank on flash
    attention's query, one that does not divide the heads on RoPE's cos multiply."""
    from engine.layout import parallel

    real = parallel.cell_strategies

    def broken(cfg):
        table = real(cfg)
        del table["SwiGLU"]["silu"]
        for kernel in ("flash", "flash_short"):         # (the lint's 32 tokens run the short one)
            table["Attention"][kernel] = ((2, 2, 1),) + table["Attention"][kernel][1:]
        table["Attention"]["rope_cos"] = ((1, 3, 1, 1), (1, 1))
        return table

    monkeypatch.setattr(parallel, "cell_strategies", broken)
    monkeypatch.chdir(tmp_path)
    found = _forward_problems(load_config(None, LAYOUTS["tp"]), tmp_path / "ir")
    assert any(p.startswith("SiLU in ") and "mlp-SwiGLU" in p and "no strategy" in p for p in found), found
    assert any(p.startswith("FlashAttentionScore in ") and "self_attn-Attention" in p and "input 0 of rank 4" in p
               for p in found), found
    assert any(p.startswith("Mul in ") and "self_attn-Attention" in p and "does not divide" in p for p in found), found


def test_a_sliced_checkpoint_exports_per_rank_for_transform_checkpoints(mindspore_cpu, tmp_path):
    """Issue 34, item 7: `export --format mindspore-sliced` writes each rank's slices as MindSpore's own
    `rank_<r>/checkpoint_<r>.ckpt` (the names the compiled step used, moments included) with the run's
    strategy files: what transform_checkpoints reads to resume onto another layout. A whole checkpoint
    is refused in one line."""
    import subprocess
    import sys

    import mindspore as ms
    from mindspore import Parameter, Tensor

    from engine.rank.checkpoint import TrainerCheckpoints

    def save(layout_name, run):
        cfg = load_config(None, LAYOUTS[layout_name])
        weight = Parameter(Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)), name="model.norm.weight")
        moment = Parameter(Tensor(np.full((2, 3), 0.5, np.float32)), name="adam_m.model.norm.weight")
        weight.sliced = moment.sliced = True
        state = {"step": 7, "data_cursor": 0, "data_epoch": 0, "skip_ranges": [], "lr_overrides": [],
                 "quarantined_blocks": []}
        saver = TrainerCheckpoints(run / "checkpoints", cfg, params=[weight, moment], run_state=lambda: dict(state),
                                   load_run_state=lambda s: None, rank=0, world=1, generation=0, emit=lambda e: None,
                                   parallelism=decide(cfg))
        saver.save({"loss": 1.0})
        assert saver.wait()

    run = tmp_path / "run"
    save("tp", run)
    (run / "strategy").mkdir()
    (run / "strategy" / "rank_0.ckpt").write_bytes(b"the compile's strategy")
    out = tmp_path / "sliced"
    cli = [sys.executable, "-m", "cli", "export", str(run), "--format", "mindspore-sliced", "-o", str(out)]
    done = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "transform_checkpoints(" in done.stderr and "strategy/rank_0.ckpt" in done.stderr
    loaded = ms.load_checkpoint(str(out / "rank_0" / "checkpoint_0.ckpt"))
    assert sorted(loaded) == ["adam_m.model.norm.weight", "model.norm.weight"]
    assert np.array_equal(loaded["model.norm.weight"].asnumpy(), np.arange(6).reshape(2, 3))
    assert (out / "strategy" / "rank_0.ckpt").read_bytes() == b"the compile's strategy"

    whole = tmp_path / "whole"
    save("dp", whole)
    done = subprocess.run([*cli[:4], str(whole), *cli[5:-1], str(tmp_path / "w")], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode != 0 and "holds whole tensors (data parallel)" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("seq", [32, 4096])
def test_flash_attention_is_causal_by_the_compressed_mask_from_2048_tokens_and_by_the_whole_mask_below(
        mindspore_cpu, tmp_path, monkeypatch, seq):
    """Sparse mode 2's 2048 x 2048 mask from 2048 tokens (MindFormers' rule); a whole (T, T) mask below."""
    cfg = load_config(None, LAYOUTS["tp"] + [f"model.max_seq_len={seq}", f"data.seq_len={seq}", "model.num_layers=1",
                                             "train.micro_batch=1", "train.grad_accum_steps=16"])
    monkeypatch.chdir(tmp_path)
    assert _forward_problems(cfg, tmp_path / "ir") == []
    flash = [n for n in _nodes(tmp_path / "ir") if n.op == "FlashAttentionScore"]
    assert flash and all(n.inputs[0][2] == seq for n in flash)                     # (B, heads, T, d)
    masks = {[s for s in n.inputs if s is not None][3] for n in flash}
    assert masks == {(2048, 2048) if seq >= 2048 else (seq, seq)}
