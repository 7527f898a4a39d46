"""`llm-pretrain import-config mindformers.yaml -o config.toml`: a mindformers model and training
YAML mapped onto this project's TOML. Every key of the YAML that is not mapped is listed — in the
output's header and on stderr — never dropped silently.
"""
from __future__ import annotations

from typing import Any

from contracts.config import Config, config_from_dict
from contracts.errors import ConfigError

_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
# keys that only steer mindformers' own runtime (nothing to map, nothing lost for training)
_RUNTIME = {"type", "batch_size", "use_past", "layernorm_compute_type",
            "softmax_compute_type", "rotary_dtype", "param_init_type", "pad_token_id", "bos_token_id",
            "eos_token_id", "ignore_token_id", "checkpoint_name_or_path", "repetition_penalty", "max_decode_length",
            "top_k", "top_p", "do_sample", "is_dynamic", "block_size", "num_blocks", "offset",
            "scaling_factor", "extend_method", "qkv_concat", "fine_grain_interleave", "use_paged_attention"}


def _intermediate(mc: dict[str, Any], hidden: int) -> int:
    if mc.get("intermediate_size"):
        return int(mc["intermediate_size"])
    size = int(2 * (4 * hidden) / 3)                      # LLaMA's rule, as mindformers applies it
    if mc.get("ffn_dim_multiplier"):
        size = int(mc["ffn_dim_multiplier"] * size)
    multiple = int(mc.get("multiple_of") or 256)
    return multiple * ((size + multiple - 1) // multiple)


class _Read:
    """The YAML's keys this mapping has read (every other leaf is reported as not mapped)."""

    def __init__(self) -> None:
        self.used: set[str] = set()

    def __call__(self, section: dict[str, Any] | None, path: str, key: str, default=None):
        if section and key in section and section[key] is not None:
            self.used.add(f"{path}.{key}")
            return section[key]
        return default


def convert(doc: dict[str, Any]) -> tuple[Config, list[str]]:
    """(the config, the YAML keys not mapped) for a parsed mindformers YAML."""
    get, unmapped = _Read(), []
    model, train, seq = _model(doc, get)
    par = _parallel(doc, get)
    train.update(_batch_and_recompute(doc, get, par["dp"]))
    optim = _optim(doc, get, train, unmapped)
    data = {"seq_len": min(seq, model["max_seq_len"])}
    run_name = doc.get("run_name") or (doc.get("trainer") or {}).get("model_name")
    run = {"name": str(run_name).replace("/", "-")} if run_name else {}
    if run_name:
        get.used.update({"run_name", "trainer.model_name"})
    unmapped += sorted(k for k in _leaves(doc) if k not in get.used and k.rsplit(".", 1)[-1] not in _RUNTIME)
    cfg = config_from_dict({"model": model, "data": data, "train": train, "optim": optim, "parallel": par, "run": run})
    return cfg, unmapped


def _model(doc: dict[str, Any], get: _Read) -> tuple[dict[str, Any], dict[str, Any], int]:
    """[model], the precision of [train], and the YAML's sequence length."""
    model_doc = doc.get("model") or {}
    mc = model_doc.get("model_config") or {}
    if (model_doc.get("arch") or {}).get("type", "LlamaForCausalLM") not in ("LlamaForCausalLM",):
        raise ConfigError(f"model.arch.type = {model_doc['arch']['type']!r}: only LlamaForCausalLM is mapped")
    get.used.add("model.arch.type")
    hidden = int(get(mc, "model.model_config", "hidden_size", 4096))
    heads = int(get(mc, "model.model_config", "num_heads", 32))
    seq = int(get(mc, "model.model_config", "seq_length", 2048))
    for k in ("intermediate_size", "multiple_of", "ffn_dim_multiplier"):
        get(mc, "model.model_config", k)
    model = {"arch": "llama", "hidden_size": hidden, "num_heads": heads,
             "num_layers": int(get(mc, "model.model_config", "num_layers", 32)),
             "num_kv_heads": int(get(mc, "model.model_config", "n_kv_heads", heads) or heads),
             "vocab_size": int(get(mc, "model.model_config", "vocab_size", 32000)),
             "intermediate_size": _intermediate(mc, hidden),
             "max_seq_len": int(get(mc, "model.model_config", "max_position_embedding", seq)),
             "rope_theta": float(get(mc, "model.model_config", "theta", 10000.0)),
             "norm_eps": float(get(mc, "model.model_config", "rms_norm_eps", 1e-5)),
             "tie_embeddings": bool(get(mc, "model.model_config", "tie_word_embeddings", False))}
    train: dict[str, Any] = {"precision": _DTYPES.get(get(mc, "model.model_config", "compute_dtype", "float16"),
                                                      "fp16")}
    flash = get(mc, "model.model_config", "use_flash_attention")
    if flash is not None:
        train["flash_attention"] = bool(flash)
    return model, train, seq


def _parallel(doc: dict[str, Any], get: _Read) -> dict[str, Any]:
    parallel_doc = doc.get("parallel_config") or {}
    par = {"dp": int(get(parallel_doc, "parallel_config", "data_parallel", 1)),
           "tp": int(get(parallel_doc, "parallel_config", "model_parallel", 1)),
           "pp": int(get(parallel_doc, "parallel_config", "pipeline_stage", 1)),
           "pipeline_microbatches": int(get(parallel_doc, "parallel_config", "micro_batch_num", 1)),
           "sp": bool(get(parallel_doc, "parallel_config", "use_seq_parallel", False)),
           "optimizer_shard": bool(get(doc.get("parallel") or {}, "parallel", "enable_parallel_optimizer", False))}
    if par["pp"] == 1:
        par["pipeline_microbatches"] = 1
    return par


def _batch_and_recompute(doc: dict[str, Any], get: _Read, dp: int) -> dict[str, Any]:
    """[train]'s batch, recompute and seed keys."""
    runner = doc.get("runner_config") or {}
    micro = int(get(runner, "runner_config", "batch_size", 1))
    accum = int(get(runner, "runner_config", "gradient_accumulation_steps", 1) or 1)
    train: dict[str, Any] = {"micro_batch": micro, "grad_accum_steps": accum, "global_batch": micro * accum * dp}
    recompute = doc.get("recompute_config") or {}
    rc = get(recompute, "recompute_config", "recompute", False)
    if isinstance(rc, list):                       # layers per pipeline stage
        train.update(recompute=sum(int(x) for x in rc) > 0, recompute_num_layers=sum(int(x) for x in rc))
    else:
        train["recompute"] = bool(rc)
    if doc.get("seed") is not None:
        train["seed"] = int(doc["seed"])
        get.used.add("seed")
    return train


def _optim(doc: dict[str, Any], get: _Read, train: dict[str, Any], unmapped: list[str]) -> dict[str, Any]:
    """[optim] (and [train].steps) from the lr schedule, the optimizer and the wrapper's clipping."""
    sched = doc.get("lr_schedule") or {}
    opt_doc = doc.get("optimizer") or {}
    optim: dict[str, Any] = {}
    lr = get(sched, "lr_schedule", "learning_rate")
    if lr is not None:
        optim["lr"] = float(lr)
    for key, ours in (("lr_end", "min_lr"), ("min_lr", "min_lr")):
        if (v := get(sched, "lr_schedule", key)) is not None:
            optim[ours] = float(v)
    total = get(sched, "lr_schedule", "total_steps")
    if total is not None and int(total) > 0:
        train["steps"] = int(total)
    warmup = get(sched, "lr_schedule", "warmup_steps")
    ratio = get(sched, "lr_schedule", "warmup_ratio")
    if warmup is not None:
        optim["warmup_steps"] = int(warmup)
    elif ratio is not None and total:
        optim["warmup_steps"] = max(1, int(float(ratio) * int(total)))
    sched_type = get(sched, "lr_schedule", "type")
    if sched_type and "cosine" not in str(sched_type).lower():
        unmapped.append(f"lr_schedule.type = {sched_type} (only warmup + cosine is supported; cosine used)")
    for key, ours in (("beta1", "beta1"), ("beta2", "beta2"), ("eps", "eps"), ("weight_decay", "weight_decay")):
        if (v := get(opt_doc, "optimizer", key)) is not None:
            optim[ours] = float(v)
    betas = get(opt_doc, "optimizer", "betas")
    if betas:
        optim["beta1"], optim["beta2"] = float(betas[0]), float(betas[1])
    get(opt_doc, "optimizer", "type")
    clip = (doc.get("runner_wrapper") or {}).get("max_grad_norm")
    if clip is not None:
        optim["grad_clip"] = float(clip)
        get.used.add("runner_wrapper.max_grad_norm")
    if optim.get("min_lr", 0) >= optim.get("lr", 3e-3):
        optim["min_lr"] = optim.get("lr", 3e-3) * 0.1
    return optim


def _leaves(doc: Any, prefix: str = "") -> list[str]:
    if isinstance(doc, dict):
        out = []
        for k, v in doc.items():
            out += _leaves(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return [prefix]


def to_toml(cfg: Config, unmapped: list[str], source: str) -> str:
    from contracts.config import to_toml as config_toml

    comments = [f"imported from {source} by `llm-pretrain import-config`",
                "keys of the YAML not mapped (check them):" if unmapped else "every key of the YAML was mapped"]
    return config_toml(cfg, [*comments, *(f"  {k}" for k in unmapped)])
