"""mindformers interop: export a checkpoint with the parameter names of mindformers' (1.x)
`LlamaForCausalLM` and a YAML model section it accepts; map a mindformers YAML onto this project's
TOML (`llm-pretrain import-config`).

Names follow mindformers' own Hugging Face converter (models/llama/convert_weight.py):
embed_tokens → tok_embeddings.embedding_weight, q/k/v/o_proj → attention.wq/wk/wv/wo,
gate/down/up_proj → feed_forward.w1/w2/w3, input_layernorm → attention_norm,
post_attention_layernorm → ffn_norm, norm → norm_out. Layouts are unchanged ((out, in), rotate-half
rotary: mindformers' converter copies Hugging Face's q/k weights without permuting them).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

from contracts.config import ModelConfig
from contracts.errors import ConfigError
from engine.interop import hf

_RENAMES = (("model.embed_tokens.weight", "model.tok_embeddings.embedding_weight"),
            (".self_attn.q_proj.", ".attention.wq."), (".self_attn.k_proj.", ".attention.wk."),
            (".self_attn.v_proj.", ".attention.wv."), (".self_attn.o_proj.", ".attention.wo."),
            (".mlp.gate_proj.", ".feed_forward.w1."), (".mlp.down_proj.", ".feed_forward.w2."),
            (".mlp.up_proj.", ".feed_forward.w3."), (".input_layernorm.", ".attention_norm."),
            (".post_attention_layernorm.", ".ffn_norm."), ("model.norm.weight", "model.norm_out.weight"))


def mf_name(name: str) -> str:
    for old, new in _RENAMES:
        name = name.replace(old, new)
    return name


def model_yaml(m: ModelConfig, *, compute_dtype: str = "float16") -> str:
    if m.arch != "llama":
        raise ConfigError(f"model.arch = {m.arch!r}: only 'llama' exports to mindformers' LlamaForCausalLM")
    fields = [("type", "LlamaConfig"), ("batch_size", 1), ("seq_length", m.max_seq_len),
              ("hidden_size", m.hidden_size), ("num_layers", m.num_layers), ("num_heads", m.num_heads),
              ("n_kv_heads", m.num_kv_heads if m.num_kv_heads != m.num_heads else None),
              ("vocab_size", m.vocab_size), ("intermediate_size", m.intermediate_size),
              ("rms_norm_eps", m.norm_eps), ("theta", m.rope_theta), ("max_position_embedding", m.max_seq_len),
              ("tie_word_embeddings", m.tie_embeddings), ("use_past", False), ("compute_dtype", compute_dtype),
              ("layernorm_compute_type", "float32"), ("softmax_compute_type", "float32"),
              ("rotary_dtype", "float32"), ("param_init_type", "float32"), ("pad_token_id", 0),
              ("bos_token_id", 1), ("eos_token_id", 2)]
    lines = ["model:", "  model_config:"]
    lines += [f"    {k}: {_yaml_scalar(v)}" for k, v in fields]
    lines += ["  arch:", "    type: LlamaForCausalLM", ""]
    return "\n".join(lines)


def _yaml_scalar(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, float):
        return repr(v) if "e" not in repr(v) else f"{v:.1e}".replace("e-0", "e-")
    if isinstance(v, str):
        return f'"{v}"' if v.startswith(("float", "bfloat")) else v
    return str(v)


def export(checkpoint: Path, out: Path, *, overwrite: bool = False) -> dict[str, Any]:
    """Writes `out` atomically, 0644/0755, refusing an existing non-empty one unless overwrite
    (engine.interop.hf.output_directory)."""
    hf.check_output(out, overwrite)
    cfg, tensors = hf.model_tensors(checkpoint)
    renamed = {mf_name(k): v for k, v in tensors.items()}
    yaml_text = model_yaml(cfg)
    with hf.output_directory(out, overwrite=overwrite) as tmp:
        safetensors.numpy.save_file(renamed, str(tmp / "llama.safetensors"), metadata={"format": "ms"})
        (tmp / "model.yaml").write_text(yaml_text)
        (tmp / "shapes.txt").write_text("".join(f"{k} {list(v.shape)}\n" for k, v in sorted(renamed.items())))
    return {"tensors": len(renamed), "parameters": int(sum(np.prod(v.shape) for v in renamed.values()))}
