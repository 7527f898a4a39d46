"""Hugging Face LLaMA interop: export a checkpoint as `config.json` + `model.safetensors` that
transformers' `LlamaForCausalLM.from_pretrained` loads (plus the run's tokenizer for
`AutoTokenizer`, where the checkpoint says which it was), and read such a directory back
(`model.init_from = "hf:DIR"`).

An export directory (this format's and mindformers') appears complete or not at all: it is written
as `DIR.tmp-<pid>/`, its files made 0644 and directories 0755 whatever the umask, fsynced, then
renamed into place; an existing non-empty DIR is refused unless overwrite, as prepare-data refuses.

Owns: the config mapping and the weight selection. The model's parameters
already carry Hugging Face's names and layouts (Linear weights are (out, in),
rotary embeddings are rotate-half), so an export is a plain copy of the model
tensors — no permutation. numpy and safetensors only: no MindSpore.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import safetensors.numpy

from checkpointing import CheckpointError, layout, reader
from contracts.config import ModelConfig, load_config
from contracts.errors import CantCreateError, ConfigError, DataError

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


def verify_for_export(checkpoint: Path) -> None:
    """An export reads only a checkpoint that verifies (manifest, sizes, checksums)."""
    problems = reader.verify(checkpoint)
    if problems:
        raise CheckpointError(f"{checkpoint} does not verify: {'; '.join(problems)}")


def model_tensors(checkpoint: Path) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The verified checkpoint's model parameters (not the optimizer's or the scaler's state)."""
    verify_for_export(checkpoint)
    cfg, manifest = model_config_of(checkpoint)
    saved = manifest["run_state"].get("parallel_layout") or {}
    if saved.get("sliced"):
        raise CheckpointError(f"{checkpoint} holds each rank's slices (tensor/pipeline parallel, optimizer "
                              "sharding): export --format mindspore-sliced writes them for MindSpore's "
                              "transform_checkpoints, which merges them; hf and mindformers read whole tensors only")
    tensors = reader.load_tensors(checkpoint, manifest)
    return cfg, {k: np.ascontiguousarray(v) for k, v in tensors.items() if k.startswith(MODEL_PREFIXES)}


def export(checkpoint: Path, out: Path, *, overwrite: bool = False) -> dict[str, Any]:
    """Writes `out` (see the module doc) from a checkpoint; with the run's tokenizer files where
    `run_tokenizer` knows them, else info["tokenizer_note"] says why there are none."""
    check_output(out, overwrite)
    cfg, tensors = model_tensors(checkpoint)
    tokenizer, tokenizer_json, note = run_tokenizer(checkpoint, reader.read_manifest(checkpoint))
    files = {}
    if tokenizer is not None:
        from engine.data.tokenizer import BYTE_EOS_TOKEN, hf_tokenizer_files

        eos = tokenizer.get("eos_token", BYTE_EOS_TOKEN)
        files = hf_tokenizer_files(tokenizer_json, eos, model_max_length=cfg.max_seq_len)
    with output_directory(out, overwrite=overwrite) as tmp:
        info = save(tmp, cfg, tensors, eos_token_id=tokenizer["eos_id"] if tokenizer else None)
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
    return {**info, "tokenizer": tokenizer["kind"] if tokenizer else None, "tokenizer_note": note}


def check_output(out: Path, overwrite: bool) -> None:
    """prepare-data's rule for an existing output (engine.data.corpus.CorpusWriter): a non-empty one is a
    DataError (exit 65) unless overwrite; an empty directory is used."""
    out = Path(out)
    if out.exists() and not overwrite and any(out.iterdir() if out.is_dir() else [True]):
        raise DataError(f"output {str(out)!r} already exists; choose another directory or pass --overwrite")


@contextlib.contextmanager
def output_directory(out: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """The temporary directory to write an export into; renamed to `out` when the block ends without
    an error, removed when it raises (see the module doc)."""
    from engine.data.corpus import remove_stale_temporaries

    out = Path(out)
    check_output(out, overwrite)
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise _cant_create(out, e, tmp) from None
    try:
        try:
            yield tmp
            _seal(tmp)
        except OSError as e:
            raise _cant_create(out, e, tmp) from None
        _rename_into_place(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _cant_create(out: Path, e: OSError, where: Path) -> CantCreateError:
    return CantCreateError(f"cannot create the export at {str(out)!r}: {e.strerror or e} "
                           f"({e.filename or where}); choose a writable -o/--output")


def _seal(directory: Path) -> None:
    """Modes 0644 (files) and 0755 (directories), whatever the umask (systemd's is 0027), and fsync."""
    from durable import fsync_path

    for parent, dirs, files in os.walk(directory, topdown=False):
        for name in files:
            os.chmod(os.path.join(parent, name), 0o644)
            fsync_path(os.path.join(parent, name))
        for name in dirs:
            os.chmod(os.path.join(parent, name), 0o755)
        os.chmod(parent, 0o755)
        fsync_path(parent)


def _rename_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    from durable import fsync_path

    old = None
    if overwrite and out.exists():
        old = out.parent / f"{out.name}.old-{os.getpid()}"
        os.rename(out, old)
    try:
        os.rename(tmp, out)          # replaces an empty directory, refuses a non-empty one
    except OSError:
        if old is not None:
            os.rename(old, out)
        raise DataError(f"output {str(out)!r} appeared while exporting; left it as it is") from None
    fsync_path(out.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


_SET_ASIDE = re.compile(r"^step-(\d{8,})\.corrupt(?:-\d+)?$")


def passed_over(chosen: Path) -> str | None:
    """Why a run's newest checkpoint is not `chosen` (the newest that verifies, as reader.find_latest
    picked it), naming both steps; None when `chosen` is the newest. Newer committed steps failed
    verification (re-verified here for the reason); `step-N.corrupt` ones were set aside."""
    step = layout.parse_step(chosen.name)
    if step is None or not chosen.parent.is_dir():
        return None
    newer: list[tuple[int, str]] = []
    for path in chosen.parent.iterdir():
        other = layout.parse_step(path.name)
        if other is not None and other > step and path.is_dir():
            problems = reader.verify(path)
            if problems:                    # one that verifies was committed after the choice: no fallback
                newer.append((other, f"failed verification ({problems[0]})"))
        set_aside = _SET_ASIDE.match(path.name)
        if set_aside and int(set_aside.group(1)) > step:
            newer.append((int(set_aside.group(1)), f"was set aside as {path.name}"))
    if not newer:
        return None
    newest, why = max(newer)
    others = len({s for s, _ in newer}) - 1
    also = f"; {others} other newer checkpoint{'s' if others > 1 else ''} unusable too" if others else ""
    return f"the newest checkpoint, step {newest}, {why}; exported step {step} instead{also}"


def _data_section(checkpoint: Path, manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The run's data.* as the checkpoint records it (its trajectory), else its run's config.resolved.toml."""
    data = ((manifest.get("run_state") or {}).get("trajectory") or {}).get("data")
    if isinstance(data, dict):
        return data
    resolved = checkpoint.parent.parent / "config.resolved.toml"
    try:
        return load_config(resolved).to_dict()["data"] if resolved.is_file() else None
    except ConfigError:
        return None


def run_tokenizer(checkpoint: Path, manifest: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None, str | None]:
    """The tokenizer the checkpoint was trained with: (its corpus manifest's description, the text of
    a tokenizer.json that encodes as it did, None), or (None, None, why export cannot know it).
    Never a guess: an "hf" tokenizer.json is read from the path the corpus recorded, and only if
    its sha256 is still the recorded one."""
    from engine.data.tokenizer import ByteTokenizer

    data = _data_section(checkpoint, manifest)
    if data is None:
        return None, None, "the checkpoint records no data source, and its run has no config.resolved.toml"
    if data.get("source") == "synthetic":
        return None, None, 'the run trained on synthetic data (data.source = "synthetic"): it has no tokenizer'
    byte = ByteTokenizer()
    if not data.get("path"):                   # the embedded corpus: prepared with the byte tokenizer
        return byte.describe(), byte.to_tokenizers().to_str(), None
    corpus = Path(data["path"])
    where = "" if corpus.is_absolute() else " (a relative data.path is read from the current directory)"
    try:
        description = json.loads((corpus / "manifest.json").read_text())["tokenizer"]
        kind = description["kind"]
    except OSError as e:
        return None, None, f"cannot read the manifest of its corpus {str(corpus)!r}{where}: {e.strerror or e}"
    except (ValueError, KeyError, TypeError):
        return None, None, f"the manifest of its corpus {str(corpus)!r} records no tokenizer"
    if kind == "byte":
        return description, byte.to_tokenizers().to_str(), None
    if kind != "hf":
        return None, None, f"its corpus {str(corpus)!r} has a tokenizer of kind {kind!r}, unknown to this version"
    name, path = description.get("file"), description.get("path")
    if not path:
        return None, None, (f"its corpus {str(corpus)!r} was prepared with {name!r} but does not record where "
                            "that file is (prepared by an older version)")
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        return None, None, f"the tokenizer file of its corpus, {path!r}, cannot be read: {e.strerror or e}"
    if hashlib.sha256(raw).hexdigest() != description.get("sha256"):
        return None, None, f"the tokenizer file {path!r} changed since its corpus {str(corpus)!r} was prepared"
    return description, raw.decode("utf-8"), None


def save(out: Path, cfg: ModelConfig, tensors: dict[str, np.ndarray], *,
         eos_token_id: int | None = None) -> dict[str, Any]:
    """Writes a Hugging Face LLaMA directory from model tensors named as this project names them
    (in place, into an existing or new `out`; `export` makes it atomic)."""
    config = hf_config(cfg)
    if eos_token_id is not None:         # else LlamaConfig's default (2) would end generate() early
        config["eos_token_id"] = eos_token_id
    tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items() if k.startswith(MODEL_PREFIXES)}
    out.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return {"tensors": len(tensors), "parameters": int(sum(v.size for v in tensors.values())), "config": config}


def check_init_from(directory: Path, m: ModelConfig) -> list[Path]:
    """A Hugging Face LLaMA directory that model.* can start from (its config.json against the model,
    ConfigError naming every mismatch; no tensor read): its safetensors files. Checked by `config` and
    the daemon before any rank starts, and by the rank that loads it."""
    config_path = directory / "config.json"
    if not config_path.exists():
        raise ConfigError(f"model.init_from: {config_path} does not exist (expected a Hugging Face model directory)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"model.init_from: {config_path} cannot be read as JSON: {e}") from None
    if not isinstance(config, dict) or config.get("model_type") != "llama":
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise ConfigError(f"model.init_from: {directory} holds a {kind!r} model, not 'llama'")
    mismatched = init_mismatches(config, m)
    if mismatched:
        raise ConfigError(f"model.init_from: {directory} does not match the config: {'; '.join(mismatched)}")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.init_from: no .safetensors files in {directory} (pickled .bin files are not read)")
    for f in files:
        check_safetensors(f)
    return files


def check_safetensors(path: Path) -> None:
    """A .safetensors file is whole: its header is JSON and every tensor's bytes lie inside the file (a copy
    cut short fails here, in one line, and not in every rank's loader). DataError (65); no tensor is read."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 0 < length <= size - 8:
                raise ValueError(f"its header length ({length}) does not fit the file's {size} bytes")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise DataError(f"model.init_from: {path} is not a readable safetensors file: {e}") from None
    if 8 + length + end > size:
        raise DataError(f"model.init_from: {path} is cut short: its tensors need {8 + length + end} bytes, the file "
                        f"has {size} (copy it again)")


def load_for_init(directory: Path, m: ModelConfig) -> dict[str, np.ndarray]:
    """A Hugging Face LLaMA directory's weights, checked against model.* (ConfigError naming every
    mismatch), by this model's parameter names."""
    files = check_init_from(directory, m)
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
