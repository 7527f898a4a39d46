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
    mismatched = [f"{ours} = {getattr(m, ours)!r} but {theirs} = {config.get(theirs)!r}"
                  for theirs, ours in _SHAPE_KEYS.items()
                  if config.get(theirs, False if theirs == "tie_word_embeddings" else None) != getattr(m, ours)]
    if config.get("hidden_act", "silu") != "silu":
        mismatched.append(f"hidden_act = {config['hidden_act']!r} (only 'silu')")
    if mismatched:
        raise ConfigError(f"model.init_from: {directory} does not match the config: model.{'; model.'.join(mismatched)}")
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
