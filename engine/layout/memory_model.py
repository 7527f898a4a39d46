"""Per-device training memory of a layout, estimated from the model's shapes.

Owns: the byte count of what each device holds during a step, per pipeline
stage — parameters, gradients, gradient-accumulation buffers, optimizer
states, compute-dtype copies of the weights, activations, communication
buffers and the runtime's reserve — for `llm-pretrain plan` and for the check
that refuses an Ascend config which cannot fit. Pure: no MindSpore.

What is counted follows this project's model and step (engine/model/causal_lm.py,
engine/training/step.py, engine/training/optim.py), not a generic transformer:
- parameters are fp32, gradients fp32 (taken with respect to the fp32
  parameters), accumulation buffers fp32 (the step's with grad_accum_steps > 1,
  MindSpore's pipeline accumulator with pp > 1), AdamW's two moments fp32, plus
  the 4-byte step count and the loss scaler's three scalars;
- under tensor parallelism q/k/v/gate/up are split by output rows, o/down by
  input columns, the embedding and the head by vocabulary rows; norms (and
  GPT-2's row-parallel biases) are replicated;
- optimizer sharding (MindSpore's parallel optimizer at parallel.OPTIMIZER_LEVEL,
  level1) splits the weights and their moments across dp; the gradient
  accumulators stay whole (level1 leaves `grad_accumulation_shard` false, and
  MindSpore gives `accu_grads` the parameter's unsharded slice shape); only
  level2 would split them too;
- gradients: with one micro-batch per step the whole gradient exists while it
  is produced (reduce-scattered or all-reduced afterwards) and is counted; on
  Ascend with accumulation (grad_accum_steps > 1 or a pipeline) each gradient
  is added into its accumulator as it is produced, layer by layer, so only the
  largest unit's (a decoder layer, or the embedding or head) is counted. The CPU's
  count stays whole (what tests/e2e/test_parallel_build.py measures);
- compute-dtype (fp16/bf16) casts of the weights are kept for the backward pass
  of the layers that do not recompute (and of one layer being rebuilt);
- activations are the tensors autodiff keeps for the backward pass, listed
  per op (`layer_activation_bytes`), per micro-batch in flight: a 1F1B
  pipeline's stage k holds min(pp - k, pipeline_microbatches) of them; on
  Ascend attention is flash attention (no (T, T) scores kept), on the CPU eager;
- with optimizer sharding each weight is all-gathered (in its own dtype) for
  the forward pass. Where it is cast to the compute dtype the gathered whole
  dies at its cast (the cast is what the backward keeps, counted above) unless
  its layer recomputes: MindSpore recomputes that all-gather only with
  `parallel_optimizer_comm_recompute`, which this project does not set, so a
  recomputed layer's gathered whole is kept from forward to backward to be cast
  again. Where no cast exists (fp32 compute, or fp16 weights computing in fp16)
  the gathered whole is the matmul's operand and every layer keeps it.
  A recomputed layer keeps only its input, and the backward pass rebuilds one
  layer at a time.

`parallel.plan_recipe = "mindformers"` counts MindFormers' LLaMA-2 pretrain recipe
instead (configs/mindformers-llama2-7b.toml; `Recipe`): fp16 weights (its
`param_init_type`), so fp16 gradients and fp16 accumulators (clones of the
weights), fp32 AdamW moments and no fp32 master copy (FP32StateAdamWeightDecay),
and its LLaMA's activations: the residual stream and the MLP in the compute dtype,
the norms fused (RmsNorm keeps its input and a per-row fp32 rstd).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

from contracts.config import Config, ModelConfig
from engine.layout.parallel import OPTIMIZER_LEVEL, flash_attention, layer_stages

GIB = 1024 ** 3
COMPUTE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
STEP_SCALARS_BYTES = 4 + 3 * 4         # adam_step (int32) + loss_scale, loss_scale_good_steps, loss_scale_cap
RUNTIME_RESERVE_BYTES = 2 * GIB        # the Ascend runtime's own: HCCL buffers, kernels, workspace (not on CPU)
DP_BUCKET_BYTES = 64 * 1024 ** 2       # one fused gradient all-reduce bucket in flight


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What a step holds per parameter and how its layers keep activations (`parallel.plan_recipe`)."""

    param_dtype: str = "fp32"     # the weights; their gradients and accumulators (clones of them) have this dtype
    half_stream: bool = False     # residual stream and MLP kept in the compute dtype, norms fused (MindFormers)

    @classmethod
    def of(cls, cfg: Config) -> "Recipe":
        if cfg.parallel.plan_recipe == "mindformers":
            return cls(param_dtype="fp16", half_stream=True)      # param_init_type: float16 (its bf16 file too)
        return cls()

    @property
    def param_bytes(self) -> int:
        return COMPUTE_BYTES[self.param_dtype]


@dataclasses.dataclass(frozen=True)
class Layout:
    """The parallel shape of a run and its batch geometry (what `plan` varies)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False
    optimizer_shard: bool = False
    micro_batch: int = 1             # sequences per rank per forward/backward (split further by the pipeline)
    pipeline_microbatches: int = 1
    grad_accum_steps: int = 1
    recompute_layers: int = 0        # decoder layers, from the first, that recompute

    @classmethod
    def of(cls, cfg: Config) -> "Layout":
        p, t = cfg.parallel, cfg.train
        return cls(dp=p.dp, tp=p.tp, pp=p.pp, sp=p.sp, optimizer_shard=p.optimizer_shard,
                   micro_batch=t.micro_batch, pipeline_microbatches=p.pipeline_microbatches,
                   grad_accum_steps=t.grad_accum_steps, recompute_layers=cfg.recompute_layers)

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    def describe(self) -> str:
        extras = ["sp" if self.sp else "", "opt-shard" if self.optimizer_shard else ""]
        return " ".join(x for x in [f"dp{self.dp} tp{self.tp} pp{self.pp}", *extras] if x)


@dataclasses.dataclass(frozen=True)
class StageMemory:
    """Bytes on one device of a pipeline stage (every device of a stage holds the same)."""

    stage: int
    layers: int
    params: int
    grads: int
    grad_accum: int
    optimizer: int
    weight_copies: int    # compute-dtype casts of the weights that the backward pass keeps (fp16/bf16)
    gathered_weights: int  # optimizer sharding: each weight's all-gathered whole, kept from forward to backward
    activations: int
    comm_buffers: int
    runtime: int

    PARTS = ("params", "grads", "grad_accum", "optimizer", "weight_copies", "gathered_weights", "activations",
             "comm_buffers", "runtime")

    @property
    def total(self) -> int:
        return sum(getattr(self, k) for k in self.PARTS)


# Parameters ------------------------------------------------------------------
def layer_param_counts(m: ModelConfig, tp: int = 1) -> tuple[int, int]:
    """(elements split across tp, elements replicated) of one decoder layer, per device."""
    h, f, d = m.hidden_size, m.intermediate_size, m.head_dim
    q, kv = m.num_heads * d, m.num_kv_heads * d
    split = h * q + 2 * h * kv + q * h + (3 if m.arch == "llama" else 2) * h * f
    if m.arch == "llama":
        replicated = 2 * h                              # two RMSNorm weights
    else:
        split += q + 2 * kv + f                         # column-parallel biases (q, k, v, up)
        replicated = 4 * h + 2 * h                      # two LayerNorms (weight, bias), o and down biases
    return split // tp, replicated


def stage_param_count(m: ModelConfig, *, tp: int, pp: int, stage: int, layers: int) -> int:
    """Parameter elements one device of `stage` holds: its layers, plus the embedding on the first
    stage and the final norm and head on the last (a tied embedding is held by both)."""
    split, replicated = layer_param_counts(m, tp)
    count = layers * (split + replicated)
    embed = m.vocab_size * m.hidden_size // tp
    norm = m.hidden_size * (1 if m.arch == "llama" else 2)
    if stage == 0:
        count += embed + (m.max_seq_len * m.hidden_size if m.arch == "gpt2" else 0)
    if stage == pp - 1:
        count += norm
        if not m.tie_embeddings or pp > 1:
            count += embed
    return count


def total_param_count(m: ModelConfig) -> int:
    return stage_param_count(m, tp=1, pp=1, stage=0, layers=m.num_layers)


# Activations -----------------------------------------------------------------
def layer_activation_bytes(m: ModelConfig, *, seq: int, batch: int, compute_bytes: int, tp: int = 1,
                           sp: bool = False, flash: bool = False, half_stream: bool = False) -> int:
    """Bytes one decoder layer keeps for its backward pass, for `batch` sequences of `seq` tokens.

    Tensor-parallel regions (attention heads, the MLP's inner width) divide by tp; the norms'
    and residuals' regions divide by tp only under sequence parallelism. Casts to the compute
    dtype are free in fp32 (no copy) and keep a compute-dtype copy otherwise. `flash` (Ascend's
    FlashAttentionScore): attention keeps its output and each row's softmax max and sum ((B, heads, T, 8)
    fp32 each), not the (T, T) scores. `half_stream` (MindFormers' LLaMA): the residual stream and the MLP's
    tensors in the compute dtype, each norm a fused RmsNorm that keeps its input and a per-row fp32 rstd
    (Korthikanti et al.'s count: 16·s·b·h + 8·s·b·f bytes per layer in half precision, with flash attention)."""
    s, b, h, f, c = seq, batch, m.hidden_size, m.intermediate_size, compute_bytes
    heads, kv_width = m.num_heads // tp, m.num_kv_heads * m.head_dim // tp
    region = 1 if not sp else tp                     # divisor of the replicated (norm/residual) region
    sbh = s * b * h
    cast = 0 if c == 4 else 1                        # a cast's own copy, only when it changes dtype
    stream = c if half_stream else 4                 # the residual stream's dtype
    # a norm: x * rsqrt (for its weight) and its output in compute dtype; fused: its output and rstd
    norm = (c * sbh + 4 * s * b) // region if half_stream else (4 + c) * sbh // region
    total = stream * sbh // region                   # the layer's input (norm 1's)
    total += norm                                    # norm 1
    total += c * sbh // tp                           # q after rotary, compute dtype
    total += 2 * c * s * b * kv_width                # k after rotary, v
    if flash:
        total += 2 * 4 * 8 * b * heads * s           # softmax_max, softmax_sum
    else:
        total += (4 + c * cast) * b * heads * s * s  # softmax output (fp32) and its compute-dtype copy
    total += c * sbh // tp                           # attention output, the o projection's input
    total += stream * sbh // region                  # the residual after attention (norm 2's input)
    total += norm                                    # norm 2, as norm 1
    if m.arch == "llama":
        total += (3 * stream + c) * s * b * f // tp  # gate, up, silu(gate) (fp32 here); their product in compute dtype
    else:
        total += (stream + c) * s * b * f // tp      # GELU's input (fp32 here); its output in compute dtype
    return total


def head_activation_bytes(m: ModelConfig, *, seq: int, batch: int, compute_bytes: int, tp: int = 1,
                          sp: bool = False, half_stream: bool = False) -> int:
    """The last stage's final norm, head and loss: norm as in a layer; fp32 logits and the loss's
    log-softmax, then in its backward the log-softmax's gradient and the softmax that turns it into
    the logits' gradient (four vocabulary-wide fp32 tensors, split by vocabulary across tp)."""
    s, b, h, c = seq, batch, m.hidden_size, compute_bytes
    region = 1 if not sp else tp
    norm = (2 * c * s * b * h + 4 * s * b) // region if half_stream else (4 + 4 + c) * s * b * h // region
    return norm + 4 * 4 * s * b * m.vocab_size // tp


def backward_workspace_bytes(m: ModelConfig, *, seq: int, batch: int, tp: int = 1, flash: bool = False,
                             compute_bytes: int = 4) -> int:
    """The largest gradient alive at once inside a layer's backward pass: the attention softmax's (fp32);
    with `flash`, whose backward recomputes the scores tile by tile, the gradients of q, k and v."""
    if flash:
        return compute_bytes * batch * seq * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim // tp
    return 4 * batch * (m.num_heads // tp) * seq * seq


def _comm_bytes(lay: Layout, m: ModelConfig, *, seq: int, batch: int, compute_bytes: int, weight_bytes: int,
                count: int, split: int) -> int:
    """The collectives' buffers in flight on one device of a stage holding `count` parameters."""
    c, h, comm = compute_bytes, m.hidden_size, 0
    if lay.dp > 1:
        comm += min(weight_bytes * count, DP_BUCKET_BYTES)         # one fused gradient bucket
    if lay.tp > 1:
        comm += 2 * c * seq * batch * h                            # the row-parallel outputs' all-reduce
    if lay.pp > 1:
        comm += 2 * c * seq * batch * h // (lay.tp if lay.sp else 1)   # send and receive
    if lay.optimizer_shard and lay.dp > 1:
        comm += weight_bytes * split                               # one layer's weights all-gathered
    return comm


# The whole estimate ------------------------------------------------------------
def estimate(cfg: Config, layout: Layout | None = None, *, runtime: bool | None = None,
             optimizer_level: str = OPTIMIZER_LEVEL) -> list[StageMemory]:
    """Per-stage device memory of `cfg` under `layout` (default: the config's own). `optimizer_level`: the
    parallel optimizer's (default what engine/layout/parallel.py sets)."""
    lay = layout or Layout.of(cfg)
    m, seq = cfg.model, cfg.data.seq_len
    c = COMPUTE_BYTES[cfg.train.precision]
    rec = Recipe.of(cfg)
    w = rec.param_bytes                          # a weight, its gradient, its accumulator
    cast = rec.param_dtype != cfg.train.precision  # whether the forward casts each weight (a copy kept or not)
    tp, pp, dp = lay.tp, lay.pp, lay.dp
    shard = dp if lay.optimizer_shard else 1
    accum_shard = shard if optimizer_level == "level2" else 1     # level1: accumulators whole
    batch = lay.micro_batch // lay.pipeline_microbatches if pp > 1 else lay.micro_batch
    in_flight = lambda k: min(pp - k, lay.pipeline_microbatches) if pp > 1 else 1
    reserve = (cfg.train.device == "ascend") if runtime is None else runtime
    flash = flash_attention(cfg)
    half = rec.half_stream
    per_layer = layer_activation_bytes(m, seq=seq, batch=batch, compute_bytes=c, tp=tp, sp=lay.sp, flash=flash,
                                       half_stream=half)
    kept_if_recomputed = (c if half else 4) * seq * batch * m.hidden_size // (tp if lay.sp else 1)
    split, replicated = layer_param_counts(m, tp)
    layer_params = split + replicated
    embed = m.vocab_size * m.hidden_size // tp
    accumulates = lay.grad_accum_steps > 1 or pp > 1
    # on Ascend each gradient goes into its accumulator as it is produced (MindSpore's accumulation, or the step's
    # compiled AssignAdd): one unit's at a time. The CPU count stays whole.
    layer_by_layer = accumulates and cfg.train.device == "ascend"
    placed = layer_stages(m.num_layers, pp)
    stages, first = [], 0
    for k, layers in enumerate(placed.count(stage) for stage in range(pp)):
        last = k == pp - 1
        count = stage_param_count(m, tp=tp, pp=pp, stage=k, layers=layers)
        recomputed = max(0, min(layers, lay.recompute_layers - first))
        first += layers
        acts = (layers - recomputed) * per_layer + recomputed * kept_if_recomputed
        if last:
            acts += head_activation_bytes(m, seq=seq, batch=batch, compute_bytes=c, tp=tp, sp=lay.sp,
                                          half_stream=half)
        acts *= in_flight(k)
        if recomputed:
            acts += per_layer                   # the one layer rebuilt at a time in the backward pass
        acts += backward_workspace_bytes(m, seq=seq, batch=batch, tp=tp, flash=flash, compute_bytes=c)
        unit = max(layer_params if layers else 0, embed if (k == 0 or last) else 0)
        recomputed_params = recomputed * layer_params
        stages.append(StageMemory(
            stage=k, layers=layers,
            params=w * count // shard,
            grads=w * (unit if layer_by_layer else count),
            grad_accum=w * count // accum_shard if accumulates else 0,
            optimizer=8 * count // shard + STEP_SCALARS_BYTES,
            # a recomputed layer casts its weights again in the backward pass, one layer at a time
            weight_copies=c * (count - max(recomputed - 1, 0) * layer_params) if cast else 0,
            # the gathered whole: kept by a recomputed layer (to cast again), and by every layer with no cast
            gathered_weights=(w * (count if not cast else recomputed_params)) if shard > 1 else 0,
            activations=acts, comm_buffers=_comm_bytes(lay, m, seq=seq, batch=batch, compute_bytes=c,
                                                       weight_bytes=w, count=count, split=split),
            runtime=RUNTIME_RESERVE_BYTES if reserve else 0))
    return stages


def peak(stages: Iterable[StageMemory]) -> StageMemory:
    """The stage that needs the most memory (the one that decides whether a layout fits)."""
    return max(stages, key=lambda s: s.total)
