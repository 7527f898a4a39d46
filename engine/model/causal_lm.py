"""The decoder-only language model: LLaMA (RMSNorm, RoPE, SwiGLU, GQA) and a GPT-2 variant.

Owns: the network and its parameter names. Names follow Hugging Face's
`LlamaForCausalLM` one-to-one (`model.layers.0.self_attn.q_proj.weight`, …,
`lm_head.weight`), and every Linear weight is (out_features, in_features) like
torch's, so a Hugging Face export is a plain copy. Rotary embeddings use
Hugging Face's rotate-half layout.

Parameters are fp32; matmuls run in the compute dtype (fp32, fp16; bf16 on
Ascend), norms, softmax and the loss in fp32. Only ops with CPU kernels are
used (no mint RmsNorm/LayerNormExt/GeluExt). Initialisation draws from numpy
with the config's seed, so every data-parallel rank starts from the same weights.

On the CPU (`explicit_broadcast`), no element-wise op broadcasts an operand
implicitly over activations: MindSpore's CPU Add/Sub/Mul kernels that broadcast
keep a private buffer several times their output for the life of the graph (seen
on a (B,kv,rep,T,T) + (T,T) mask add, RoPE's (T,d) tables, RMSNorm's weight, and
the Sub in Softmax's stock gradient), which multiplied small-20m's step memory. The
smaller operand is broadcast first (`ops.broadcast_to`), Softmax gets a gradient
written that way, and rotate-half is a ±1 permutation matmul; the numbers are
bit-identical. Ascend keeps the plain forms, every primitive of which its parallel
strategies name (engine/model/sharding.py), and its attention is MindSpore's fused
FlashAttentionScore (`train.flash_attention`, the default there): no (T, T) scores kept.

On the CPU with `train.fused_kernels` (the default), RMSNorm, the causal softmax (with its scale and
mask), SwiGLU's product and RoPE are each one C++ kernel forward and one backward (engine/model/fused_cpu.py),
where MindSpore's CPU graph launches many small kernels for each; same numbers to float rounding.
"""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.ops.auto_generate import SiLU

from contracts.config import ModelConfig

DTYPES = {"fp32": ms.float32, "fp16": ms.float16, "bf16": ms.bfloat16}
FLASH_MASK = 2048           # the side of flash attention's compressed causal mask (sparse mode 2)


class _Init:
    """Deterministic numpy initialiser: the same seed gives the same weights on every rank. `lazy` (semi-auto
    parallel, built under engine.model.lazy_init.lazy_parameters): initializers that the compile runs on each
    rank's slices only; `lazy` = (dp x tp, tp) of the layout, for engine.model.lazy_init.SaltedNormal."""

    def __init__(self, seed: int, std: float, lazy: tuple[int, int] | None = None):
        self.rng = np.random.default_rng(seed)
        self.std = std
        self.lazy = lazy
        self.made = 0                        # weights drawn so far: a lazy weight's salt

    def normal(self, shape: tuple[int, ...], std: float | None = None) -> Tensor:
        std = self.std if std is None else std
        if self.lazy:
            from mindspore.common.initializer import initializer

            from engine.model.lazy_init import SaltedNormal

            self.made += 1
            return initializer(SaltedNormal(std, salt=self.made, stage_ranks=self.lazy[0], tp=self.lazy[1]), shape,
                               ms.float32)
        return Tensor(self.rng.normal(0.0, std, size=shape).astype(np.float32))

    @staticmethod
    def const(shape: tuple[int, ...], value: float) -> Tensor:
        return Tensor(np.full(shape, value, dtype=np.float32))


class Linear(nn.Cell):
    """y = x W^T (+ b) with W of shape (out, in); the matmul runs in the compute dtype."""

    def __init__(self, init: _Init, in_features: int, out_features: int, *, bias: bool = False,
                 std: float | None = None, compute_dtype=ms.float32):
        super().__init__()
        self.weight = Parameter(init.normal((out_features, in_features), std), name="weight")
        self.bias = Parameter(init.const((out_features,), 0.0), name="bias") if bias else None
        self.compute_dtype = compute_dtype
        self.matmul = ops.MatMul(transpose_b=True)
        self.add_bias = ops.Add()

    def construct(self, x):
        lead = x.shape[:-1]
        y = self.matmul(x.reshape(-1, x.shape[-1]).astype(self.compute_dtype),
                        self.weight.astype(self.compute_dtype))
        if self.bias is not None:
            y = self.add_bias(y, self.bias.astype(self.compute_dtype))
        return y.reshape(lead + (-1,))


def _like(small, x, explicit: bool):
    """`small` broadcast to x's shape when `explicit` (the CPU: see the module's docstring), else as is."""
    return ops.broadcast_to(small, x.shape) if explicit else small


class RMSNorm(nn.Cell):
    def __init__(self, size: int, eps: float, explicit_broadcast: bool = False, fused=None):
        super().__init__()
        self.weight = Parameter(_Init.const((size,), 1.0), name="weight")
        self.eps = eps
        self.explicit = explicit_broadcast
        self.mul = ops.Mul()                 # x * weight: split along the tokens under sequence parallelism
        # the plain form's primitives, each given a strategy under semi-auto (engine/model/sharding.py)
        self.square, self.mean, self.add_eps = ops.Mul(), ops.ReduceMean(keep_dims=True), ops.Add()
        self.rsqrt, self.normalize = ops.Rsqrt(), ops.Mul()
        self.eps_t = Tensor(eps, ms.float32)
        self.fused = fused                   # engine.model.fused_cpu.FusedKernels, or None
        if fused is not None:
            self.eps_t = fused.scalar(eps)

    def construct(self, x):
        x = x.astype(ms.float32)
        if self.fused is not None:
            return self.fused.rms_norm(x, self.weight, self.eps_t)
        if self.explicit:
            inv_rms = ops.rsqrt((x * x).mean(-1, keep_dims=True) + self.eps)
            return self.mul(x * _like(inv_rms, x, True), _like(self.weight, x, True))
        inv_rms = self.rsqrt(self.add_eps(self.mean(self.square(x, x), -1), self.eps_t))
        return self.mul(self.normalize(x, inv_rms), self.weight)


class LayerNorm(nn.Cell):
    """Written out: LayerNormExt has no CPU kernel."""

    def __init__(self, size: int, eps: float, explicit_broadcast: bool = False, fused=None):
        super().__init__()
        self.weight = Parameter(_Init.const((size,), 1.0), name="weight")
        self.bias = Parameter(_Init.const((size,), 0.0), name="bias")
        self.eps = eps
        self.explicit = explicit_broadcast
        # the plain form's primitives, each given a strategy under semi-auto (engine/model/sharding.py)
        self.mean, self.centre, self.square = ops.ReduceMean(keep_dims=True), ops.Sub(), ops.Mul()
        self.var, self.add_eps, self.rsqrt = ops.ReduceMean(keep_dims=True), ops.Add(), ops.Rsqrt()
        self.normalize, self.mul, self.add_bias = ops.Mul(), ops.Mul(), ops.Add()
        self.eps_t = Tensor(eps, ms.float32)

    def construct(self, x):
        x = x.astype(ms.float32)
        e = self.explicit
        if e:
            centred = x - _like(x.mean(-1, keep_dims=True), x, e)
            var = (centred * centred).mean(-1, keep_dims=True)
            return centred * _like(ops.rsqrt(var + self.eps), x, e) * _like(self.weight, x, e) + _like(self.bias, x, e)
        centred = self.centre(x, self.mean(x, -1))
        inv_std = self.rsqrt(self.add_eps(self.var(self.square(centred, centred), -1), self.eps_t))
        return self.add_bias(self.mul(self.normalize(centred, inv_std), self.weight), self.bias)


class Softmax(nn.Cell):
    """Softmax over the last axis whose gradient, out * (dout - sum(dout * out)), broadcasts explicitly
    (the stock gradient's broadcasting Sub is one of the CPU kernels that hoard memory)."""

    def __init__(self):
        super().__init__()
        self.softmax = ops.Softmax(-1)

    def construct(self, x):
        return self.softmax(x)

    def bprop(self, x, out, dout):
        dot = (dout * out).sum(-1, keepdims=True)
        return (out * (dout - ops.broadcast_to(dot, out.shape)),)


def rotate_half_matrix(head_dim: int) -> np.ndarray:
    """R with x @ R == rotate_half(x) exactly: each output is one input times ±1, plus zeros."""
    half = head_dim // 2
    r = np.zeros((head_dim, head_dim), np.float32)
    r[np.arange(half) + half, np.arange(half)] = -1.0       # out[i] = -x[i + half]
    r[np.arange(half), np.arange(half) + half] = 1.0        # out[i + half] = x[i]
    return r


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin of shape (max_seq_len, head_dim) in Hugging Face's layout: frequencies repeated [f, f]."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = np.outer(np.arange(max_seq_len, dtype=np.float64), inv_freq)   # (T, head_dim/2)
    angles = np.concatenate([angles, angles], axis=-1)                       # (T, head_dim)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rotate_half(x):
    half = x.shape[-1] // 2
    return ops.cat((-x[..., half:], x[..., :half]), -1)


class Attention(nn.Cell):
    def __init__(self, cfg: ModelConfig, init: _Init, out_std: float, compute_dtype, rotary: bool,
                 explicit_broadcast: bool = False, fused=None, flash: bool = False):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        bias = cfg.arch == "gpt2"
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = Linear(init, h, cfg.num_heads * d, bias=bias, compute_dtype=compute_dtype)
        self.k_proj = Linear(init, h, cfg.num_kv_heads * d, bias=bias, compute_dtype=compute_dtype)
        self.v_proj = Linear(init, h, cfg.num_kv_heads * d, bias=bias, compute_dtype=compute_dtype)
        self.o_proj = Linear(init, cfg.num_heads * d, h, bias=bias, std=out_std, compute_dtype=compute_dtype)
        self.rotary = rotary
        self.scale = 1.0 / math.sqrt(d)
        self.compute_dtype = compute_dtype
        # primitives, not functions, so semi-auto parallel can split them by heads (engine/model/sharding.py)
        self.qk, self.pv, self.softmax = ops.BatchMatMul(), ops.BatchMatMul(), ops.Softmax(-1)
        self.split_heads, self.transpose_k, self.merge_heads = ops.Transpose(), ops.Transpose(), ops.Transpose()
        self.rope_cos, self.rope_sin, self.rope_add = ops.Mul(), ops.Mul(), ops.Add()
        self.upper_half, self.lower_half = ops.StridedSlice(), ops.StridedSlice()
        self.negate, self.join_halves = ops.Neg(), ops.Concat(-1)
        self.scale_scores, self.mask = ops.Mul(), ops.Add()
        self.scale_t = Tensor(self.scale, ms.float32)
        self.flash = self.flash_short = None
        if flash:          # Ascend, half precision; GQA by kv heads
            from mindspore.ops.operations.nn_ops import FlashAttentionScore

            kernel = dict(head_num=cfg.num_heads, scale_value=self.scale, input_layout="BNSD")
            # causal by the compressed 2048 x 2048 mask of sparse mode 2 (MindFormers uses it from 2048 tokens)
            self.flash = FlashAttentionScore(**kernel, pre_tokens=2147483647, next_tokens=0, sparse_mode=2)
            self.flash_short = FlashAttentionScore(**kernel, sparse_mode=0)   # shorter: the whole (T, T) mask
        self.explicit = explicit_broadcast
        if explicit_broadcast:
            self.softmax = Softmax()
            self.rotate = ops.MatMul()
            self.rotation = Tensor(rotate_half_matrix(d))
        self.fused = fused
        if fused is not None:
            self.scale_t = fused.scalar(self.scale)

    def _heads(self, x, n):
        b, t, _ = x.shape
        return self.split_heads(x.reshape(b, t, n, self.head_dim), (0, 2, 1, 3))     # (B, n, T, d)

    def _rope(self, x, cos, sin):
        if self.fused is not None:
            return self.fused.rope(x, cos, sin)
        if not self.explicit:
            b, n, t, d = x.shape
            half = d // 2
            upper = self.upper_half(x, (0, 0, 0, half), (b, n, t, d), (1, 1, 1, 1))
            lower = self.lower_half(x, (0, 0, 0, 0), (b, n, t, half), (1, 1, 1, 1))
            rotated = self.join_halves((self.negate(upper), lower))             # rotate_half(x)
            return self.rope_add(self.rope_cos(x, cos), self.rope_sin(rotated, sin))
        rotated = self.rotate(x.reshape(-1, self.head_dim), ops.stop_gradient(self.rotation)).reshape(x.shape)
        return x * ops.broadcast_to(cos, x.shape) + rotated * ops.broadcast_to(sin, x.shape)

    def construct(self, x, cos, sin, mask):
        b, t, _ = x.shape
        kv, rep, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        q = self._heads(self.q_proj(x), self.num_heads).astype(ms.float32)
        k = self._heads(self.k_proj(x), kv).astype(ms.float32)
        v = self._heads(self.v_proj(x), kv)
        if self.rotary:
            q = self._rope(q, cos, sin)
            k = self._rope(k, cos, sin)
        # Grouped-query attention without repeating k/v (whose broadcast has a slow
        # gradient on CPU): query head h uses kv head h // rep, as Hugging Face's
        # repeat_kv does, so fold each group's rep query heads into the row axis.
        cd = self.compute_dtype
        if self.flash is not None:      # `mask` is the flash kernel's (engine.model.causal_lm.DecoderModel)
            kernel = self.flash if t >= FLASH_MASK else self.flash_short
            out = kernel(q.astype(cd), k.astype(cd), v.astype(cd), None, None, None, mask)[3]      # (B, n, T, d)
            out = self.merge_heads(out, (0, 2, 1, 3)).reshape(b, t, self.num_heads * d)
            return self.o_proj(out).astype(ms.float32)
        q = q.reshape(b, kv, rep * t, d)                                       # (B, kv, rep*T, d)
        scores = self.qk(q.astype(cd), self.transpose_k(k.astype(cd), (0, 1, 3, 2))).astype(ms.float32)
        if self.fused is not None:      # the scale and the causal mask inside the kernel
            probs = self.fused.causal_softmax(scores.reshape(b, kv * rep, t, t), self.scale_t)
        elif self.explicit:
            scores = scores.reshape(b, kv, rep, t, t) * self.scale             # (B, kv, rep, T, T)
            probs = self.softmax(scores + _like(mask, scores, True))
        else:
            probs = self.softmax(self.mask(self.scale_scores(scores.reshape(b, kv, rep, t, t), self.scale_t), mask))
        probs = probs.reshape(b, kv, rep * t, t)
        out = self.pv(probs.astype(cd), v.astype(cd))                         # (B, kv, rep*T, d)
        out = self.merge_heads(out.reshape(b, self.num_heads, t, d), (0, 2, 1, 3)).reshape(b, t, self.num_heads * d)
        return self.o_proj(out).astype(ms.float32)


class SwiGLU(nn.Cell):
    def __init__(self, cfg: ModelConfig, init: _Init, out_std: float, compute_dtype, fused=None):
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(init, h, f, compute_dtype=compute_dtype)
        self.up_proj = Linear(init, h, f, compute_dtype=compute_dtype)
        self.down_proj = Linear(init, f, h, std=out_std, compute_dtype=compute_dtype)
        self.silu, self.gate_times_up = SiLU(), ops.Mul()
        self.fused = fused

    def construct(self, x):
        gate = self.gate_proj(x).astype(ms.float32)
        up = self.up_proj(x).astype(ms.float32)
        product = self.fused.swiglu(gate, up) if self.fused is not None else self.gate_times_up(self.silu(gate), up)
        return self.down_proj(product).astype(ms.float32)


class GeluMLP(nn.Cell):
    def __init__(self, cfg: ModelConfig, init: _Init, out_std: float, compute_dtype, fused=None):
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.up_proj = Linear(init, h, f, bias=True, compute_dtype=compute_dtype)
        self.down_proj = Linear(init, f, h, bias=True, std=out_std, compute_dtype=compute_dtype)
        self.gelu = ops.GeLU()                  # the tanh approximation, as GPT-2's

    def construct(self, x):
        return self.down_proj(self.gelu(self.up_proj(x).astype(ms.float32))).astype(ms.float32)


class DecoderLayer(nn.Cell):
    def __init__(self, cfg: ModelConfig, init: _Init, compute_dtype, explicit_broadcast: bool = False,
                 fused=None, flash: bool = False):
        super().__init__()
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        llama = cfg.arch == "llama"
        norm = RMSNorm if llama else LayerNorm
        e = explicit_broadcast
        self.input_layernorm = norm(cfg.hidden_size, cfg.norm_eps, e, fused)
        self.self_attn = Attention(cfg, init, out_std, compute_dtype, rotary=llama, explicit_broadcast=e,
                                   fused=fused, flash=flash)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.norm_eps, e, fused)
        self.mlp = (SwiGLU if llama else GeluMLP)(cfg, init, out_std, compute_dtype, fused)
        self.add_attn, self.add_mlp = ops.Add(), ops.Add()     # the residuals (split like the norms)

    def construct(self, x, cos, sin, mask):
        x = self.add_attn(x, self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return self.add_mlp(x, self.mlp(self.post_attention_layernorm(x)))


class Embedding(nn.Cell):
    """A lookup table as its own cell (`weight`), so a pipeline can place it and tp can split its rows."""

    def __init__(self, table: Tensor):
        super().__init__()
        self.weight = Parameter(table, name="weight")
        self.gather = ops.Gather()

    def construct(self, ids):
        return self.gather(self.weight, ids, 0)


class DecoderModel(nn.Cell):
    """The trunk, named like Hugging Face's `LlamaModel` (`model.` prefix in the full network)."""

    def __init__(self, cfg: ModelConfig, init: _Init, compute_dtype, explicit_broadcast: bool = False,
                 fused=None, flash: bool = False):
        super().__init__()
        self.explicit = explicit_broadcast
        self.embed_tokens = Embedding(init.normal((cfg.vocab_size, cfg.hidden_size)))
        self.embed_positions = (Embedding(init.normal((cfg.max_seq_len, cfg.hidden_size)))
                                if cfg.arch == "gpt2" else None)
        self.layers = nn.CellList([DecoderLayer(cfg, init, compute_dtype, explicit_broadcast, fused, flash)
                                   for _ in range(cfg.num_layers)])
        self.norm = (RMSNorm if cfg.arch == "llama" else LayerNorm)(cfg.hidden_size, cfg.norm_eps,
                                                                    explicit_broadcast, fused)
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.cos, self.sin = Tensor(cos), Tensor(sin)
        causal = np.triu(np.full((cfg.max_seq_len, cfg.max_seq_len), -1e9, dtype=np.float32), k=1)
        self.causal_mask = Tensor(causal)
        # flash attention's causal mask, 1 above the diagonal: compressed (sparse mode 2) from 2048 tokens, whole
        # below (cut to the length)
        size = FLASH_MASK if cfg.max_seq_len >= FLASH_MASK else cfg.max_seq_len
        self.flash_mask = Tensor(np.triu(np.ones((size, size), np.uint8), k=1)) if flash else None
        self.cut_table, self.add_positions = ops.StridedSlice(), ops.Add()

    def _first(self, table, t, square: bool = False):
        """table[:t] (table[:t, :t] when `square`: the mask), as a primitive semi-auto gives a strategy."""
        return self.cut_table(table, (0, 0), (t, t if square else table.shape[1]), (1, 1))

    def construct(self, tokens):
        t = tokens.shape[1]
        x = self.embed_tokens(tokens)                                         # (B, T, hidden)
        if self.embed_positions is not None:
            if self.explicit:
                x = x + _like(self.embed_positions.weight[:t], x, True)
            else:
                x = self.add_positions(x, self._first(self.embed_positions.weight, t))
        if self.explicit:
            cos, sin, mask = self.cos[:t], self.sin[:t], self.causal_mask[:t, :t]
        else:
            cos, sin = self._first(self.cos, t), self._first(self.sin, t)
            if self.flash_mask is None:
                mask = self._first(self.causal_mask, t, square=True)
            else:
                mask = self.flash_mask if t >= FLASH_MASK else self._first(self.flash_mask, t, square=True)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class CausalLM(nn.Cell):
    """tokens (B, T) → mean next-token cross-entropy; `logits` exposes the (B, T, vocab) scores.
    fused_kernels: the CPU's fused C++ kernels (engine/model/fused_cpu.py), where they can be built."""

    def __init__(self, cfg: ModelConfig, *, seed: int, compute_dtype: str = "fp32", recompute_layers: int = 0,
                 explicit_broadcast: bool = False, fused_kernels: bool = False, lazy_init: tuple | None = None,
                 vocab_parallel_loss: bool = False, flash_attention: bool = False):
        super().__init__()
        init = _Init(seed, cfg.init_std, lazy=lazy_init)
        dtype = DTYPES[compute_dtype]
        self.config = cfg
        fused = None
        if fused_kernels:
            from engine.model import fused_cpu

            fused = fused_cpu.kernels()
        self.fused = fused is not None
        self.model = DecoderModel(cfg, init, dtype, explicit_broadcast, fused, flash_attention)
        self.lm_head = None if cfg.tie_embeddings else Linear(init, cfg.hidden_size, cfg.vocab_size,
                                                              compute_dtype=dtype)
        self.compute_dtype = dtype
        self.tied_matmul = ops.MatMul(transpose_b=True)
        if vocab_parallel_loss:          # semi-auto: the fused op below is batch-parallel (dp*tp times the gradient)
            from engine.model.parallel_loss import VocabParallelCrossEntropy

            self.loss = VocabParallelCrossEntropy()
        else:
            self.loss = NextTokenLoss()
        # Recompute (activation checkpointing) per layer, from the first: the backward
        # pass reruns these layers' forward instead of keeping their activations.
        for layer in list(self.model.layers)[:recompute_layers]:
            layer.recompute()

    def logits(self, tokens):
        h = self.model(tokens)                                                # (B, T, hidden)
        if self.lm_head is not None:
            return self.lm_head(h).astype(ms.float32)
        b, t, d = h.shape
        out = self.tied_matmul(h.reshape(b * t, d).astype(self.compute_dtype),
                               self.model.embed_tokens.weight.astype(self.compute_dtype))
        return out.reshape(b, t, -1).astype(ms.float32)                       # (B, T, vocab)

    def construct(self, tokens, targets):
        return self.loss(self.logits(tokens), targets)


class NextTokenLoss(nn.Cell):
    """Mean cross-entropy of (B, T, vocab) logits against (B, T) targets: a cell of its own, so a
    pipeline places it on the last stage, beside the head.

    MindSpore's fused SparseSoftmaxCrossEntropyWithLogits (data parallel only: under semi-auto it is
    batch-parallel, see engine/model/parallel_loss.py): the same loss and gradient as
    `ops.cross_entropy` (to ~1e-9 in fp32) in one kernel each way, where cross_entropy's
    x − logsumexp(x) with its gather and ReduceMax/Equal gradient took ~10x longer on CPU."""

    def __init__(self):
        super().__init__()
        self.cross_entropy = ops.SparseSoftmaxCrossEntropyWithLogits()

    def construct(self, logits, targets):
        vocab = logits.shape[-1]
        return self.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))


class InlinedCausalLM(CausalLM):
    """CausalLM for a semi-auto step with micro-batches (a pipeline's, or MindSpore's GradAccumulation):
    `lazy_inline` on the outermost cell's __init__, as MindSpore documents for both (each micro-batch
    reuses one compiled subgraph instead of the network inlined once per micro-batch: 16 copies for
    the 7B config's accumulation of 16). Ascend only; the CPU never builds it except in tests."""

    @ms.lazy_inline
    def __init__(self, cfg: ModelConfig, *, seed: int, compute_dtype: str = "fp32", recompute_layers: int = 0,
                 explicit_broadcast: bool = False, fused_kernels: bool = False, lazy_init: tuple | None = None,
                 vocab_parallel_loss: bool = False, flash_attention: bool = False):
        super().__init__(cfg, seed=seed, compute_dtype=compute_dtype, recompute_layers=recompute_layers,
                         explicit_broadcast=explicit_broadcast, fused_kernels=fused_kernels, lazy_init=lazy_init,
                         vocab_parallel_loss=vocab_parallel_loss, flash_attention=flash_attention)


def build_model(config, parallelism) -> CausalLM:
    """The network of a run's Config, with its parallel strategies and pipeline stages applied (under the
    generation's decided `parallelism`, engine.layout.parallel.decide)."""
    from engine.model import sharding

    from engine.layout.parallel import flash_attention, micro_batches

    cls = InlinedCausalLM if parallelism.semi_auto and micro_batches(config) > 1 else CausalLM
    cpu = config.train.device == "cpu"
    p = config.parallel
    lazy = (p.dp * p.tp, p.tp) if parallelism.semi_auto else None         # (ranks per stage, tp): lazy_init.py
    net = cls(config.model, seed=config.train.seed, compute_dtype=config.train.precision,
              recompute_layers=config.recompute_layers, explicit_broadcast=cpu,
              fused_kernels=cpu and config.train.fused_kernels, lazy_init=lazy,
              vocab_parallel_loss=parallelism.semi_auto, flash_attention=flash_attention(config))
    sharding.apply_to_model(net, config, parallelism)
    return net


def parameter_count(net: nn.Cell) -> int:
    return int(sum(np.prod(p.shape) for p in net.trainable_params()))
