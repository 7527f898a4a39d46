"""Hugging Face LLaMA interop: export a checkpoint as `config.json` + `model.safetensors` that
transformers' `LlamaForCausalLM.from_pretrained` loads, and read such a directory back
(`model.init_from = "hf:DIR"`).

Owns: the config mapping and the weight selection. The model's parameters
already carry Hugging Face's names and layouts (Linear weights are (out, in),
rotary embeddings are rotate-half), so an export is a plain copy of the model
tensors — no permutation. numpy and safetensors only: no MindSpore.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

from checkpointing import CheckpointError, reader
from engine.config import ConfigError, ModelConfig

MODEL_PREFIXES = ("model.", "lm_head.")


def hf_config(m: ModelConfig) -> dict[str, Any]:
    if m.arch != "llama":
        raise ConfigError(f"model.arch = {m.arch!r}: only 'llama' exports to Hugging Face LlamaForCausalLM")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": m.vocab_size, "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
            "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim, "hidden_act": "silu",
            "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta,
            "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
            "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
            "torch_dtype": "float32", "use_cache": True}


# the config.json keys that must agree with model.* for init_from (others are informative)
_SHAPE_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
               "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
               "num_key_value_heads": "num_kv_heads", "tie_word_embeddings": "tie_embeddings"}
# float keys that change the logits, with LlamaConfig's default when config.json leaves them out
_FLOAT_KEYS = {"rope_theta": ("rope_theta", 10000.0), "rms_norm_eps": ("norm_eps", 1e-6)}
_REL_TOL = 1e-6            # 1e-05 == 1e-5; a float32 round trip (9.9999997e-06) still matches
_NO_BIAS_KEYS = ("attention_bias", "mlp_bias")     # this model's llama Linears have no bias


def _toml(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (bool, str)) else repr(value)


def _rope_type(scaling: Any) -> str | None:
    """None for plain RoPE (absent, null or rope_type "default"), else the name to refuse."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        return repr(scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    return None if kind == "default" else repr(kind) if kind is not None else f"{scaling!r} (no type)"


def init_mismatches(config: dict[str, Any], m: ModelConfig) -> list[str]:
    """Every way a Hugging Face LLaMA config.json computes other logits than model.* would, one
    phrase each naming the key, both values and what to set; absent keys take LlamaConfig's defaults.
    Pure: no files, no MindSpore."""
    out = []
    defaults = {"num_key_value_heads": config.get("num_attention_heads"), "tie_word_embeddings": False}
    for theirs, ours in _SHAPE_KEYS.items():
        value, mine = config.get(theirs, defaults.get(theirs)), getattr(m, ours)
        if value is None:
            out.append(f"model.{ours} = {_toml(mine)} but config.json has no {theirs}")
        elif value != mine:
            out.append(f"model.{ours} = {_toml(mine)} but {theirs} = {_toml(value)} "
                       f"(set model.{ours} = {_toml(value)})")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != m.head_dim:
        out.append(f"head_dim = {_toml(head_dim)} but model.hidden_size / model.num_heads = {m.head_dim} "
                   "(this model's head_dim is always hidden_size / num_heads)")
    rope = config.get("rope_parameters")           # transformers >= 5 keeps rope_theta and the type here
    rope = rope if isinstance(rope, dict) else {}
    for theirs, (ours, default) in _FLOAT_KEYS.items():
        name = f"rope_parameters.{theirs}" if theirs in rope else theirs
        value, mine = rope.get(theirs, config.get(theirs, default)), getattr(m, ours)
        try:
            same = math.isclose(float(value), mine, rel_tol=_REL_TOL, abs_tol=0.0)
        except (TypeError, ValueError):
            out.append(f"model.{ours} = {_toml(mine)} but {name} = {value!r} (not a number)")
            continue
        if not same:
            out.append(f"model.{ours} = {_toml(mine)} but {name} = {_toml(value)} "
                       f"(set model.{ours} = {_toml(float(value))})")
    positions = config.get("max_position_embeddings", 2048)
    if not isinstance(positions, (int, float)) or m.max_seq_len > positions:
        out.append(f"model.max_seq_len = {m.max_seq_len} but max_position_embeddings = {_toml(positions)} "
                   f"(positions past it were never trained; set model.max_seq_len <= {_toml(positions)})")
    for key, scaling in (("rope_scaling", config.get("rope_scaling")), ("rope_parameters", rope or None)):
        kind = _rope_type(scaling)
        if kind is not None:
            out.append(f"{key} type {kind} is not implemented (this model computes plain RoPE only; "
                       f"use a model whose {key} is null)")
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        out.append(f"partial_rotary_factor = {partial!r} (this model rotates every head dimension; only 1.0)")
    if config.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act = {config['hidden_act']!r} (this model's MLP is SwiGLU; only 'silu')")
    for key in _NO_BIAS_KEYS:
        if config.get(key, False) is not False:
            out.append(f"{key} = {_toml(config[key])} (this model's llama layers have no biases; only false)")
    return out


def model_config_of(checkpoint: Path) -> tuple[ModelConfig, dict[str, Any]]:
    manifest = reader.read_manifest(checkpoint)
    model = manifest["run_state"]["trajectory"]["model"]
    known = {f for f in ModelConfig.__dataclass_fields__}
    return ModelConfig(**{k: v for k, v in model.items() if k in known}), manifest


def model_tensors(checkpoint: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The verified checkpoint's model parameters (not the optimizer's or the scaler's state)."""
    problems = reader.verify(checkpoint)
    if problems:
        raise CheckpointError(f"{checkpoint} does not verify: {'; '.join(problems)}")
    cfg, manifest = model_config_of(checkpoint)
    tensors = reader.load_tensors(checkpoint, manifest)
    return cfg, {k: np.ascontiguousarray(v) for k, v in tensors.items() if k.startswith(MODEL_PREFIXES)}


def export(checkpoint: Path, out: Path) -> dict[str, Any]:
    cfg, tensors = model_tensors(checkpoint)
    return save(out, cfg, tensors)


def save(out: Path, cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, Any]:
    """Writes a Hugging Face LLaMA directory from model tensors named as this project names them."""
    config = hf_config(cfg)
    tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items() if k.startswith(MODEL_PREFIXES)}
    out.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return {"tensors": len(tensors), "parameters": int(sum(v.size for v in tensors.values())), "config": config}


def load_for_init(directory: Path, m: ModelConfig) -> dict[str, np.ndarray]:
    """A Hugging Face LLaMA directory's weights, checked against model.* (ConfigError naming every
    mismatch), by this model's parameter names."""
    config_path = directory / "config.json"
    if not config_path.exists():
        raise ConfigError(f"model.init_from: {config_path} does not exist (expected a Hugging Face model directory)")
    config = json.loads(config_path.read_text())
    if config.get("model_type") != "llama":
        raise ConfigError(f"model.init_from: {directory} holds a {config.get('model_type')!r} model, not 'llama'")
    mismatched = init_mismatches(config, m)
    if mismatched:
        raise ConfigError(f"model.init_from: {directory} does not match the config: {'; '.join(mismatched)}")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.init_from: no .safetensors files in {directory} (pickled .bin files are not read)")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(read_safetensors(f))
    tensors.pop("model.rotary_emb.inv_freq", None)
    return tensors


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file as float32 — bfloat16 included (published LLaMA weights
    usually are), which numpy has no type for: its 16 bits are the top half of a float32."""
    with open(path, "rb") as f:
        (length,) = np.frombuffer(f.read(8), dtype="<u8")
        header = json.loads(f.read(int(length)))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = data[start:end]
        if info["dtype"] == "BF16":
            values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif info["dtype"] in _DTYPES:
            values = np.frombuffer(raw, dtype=np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<")).astype(np.float32)
        else:
            raise ConfigError(f"model.init_from: {path.name}: tensor {name!r} has dtype {info['dtype']}; "
                              "only F64, F32, F16 and BF16 are read")
        out[name] = values.reshape(info["shape"])
    return out
