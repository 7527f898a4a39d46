"""model.init_from = "hf:DIR": every config.json key that changes the logits must match model.* or be
refused by name (engine.interop.hf.init_mismatches, through load_for_init). Pure: numpy and JSON, no MindSpore."""
import json

import numpy as np
import pytest

from contracts.config import ModelConfig
from contracts.errors import ConfigError
from engine.interop import hf

M = ModelConfig()      # rope_theta 10000.0, norm_eps 1e-5, max_seq_len 256, 4 heads of 16, 2 kv heads, untied


def _dir(tmp_path, m=M, **changes):
    """A Hugging Face directory exported from m (as `llm-pretrain export --format hf` writes it), then
    its config.json edited: a value of ... removes the key."""
    hf.save(tmp_path, m, {"model.norm.weight": np.ones(m.hidden_size, dtype=np.float32)})
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not ...}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _config(**changes):
    config = json.loads(json.dumps(hf.hf_config(M)))
    config.update(changes)
    return {k: v for k, v in config.items() if v is not ...}


# (config.json change, what the one-line refusal must say)
REFUSED = {
    "rope_theta": ({"rope_theta": 50000.0},
                   "model.rope_theta = 10000.0 but rope_theta = 50000.0 (set model.rope_theta = 50000.0)"),
    "rope_theta-int": ({"rope_theta": 500000}, "but rope_theta = 500000 (set model.rope_theta = 500000.0)"),
    "rms_norm_eps": ({"rms_norm_eps": 1e-6},
                     "model.norm_eps = 1e-05 but rms_norm_eps = 1e-06 (set model.norm_eps = 1e-06)"),
    "rms_norm_eps-absent": ({"rms_norm_eps": ...}, "rms_norm_eps = 1e-06"),   # LlamaConfig's default
    "max_position_embeddings": ({"max_position_embeddings": 128},
                                "model.max_seq_len = 256 but max_position_embeddings = 128 "
                                "(positions past it were never trained; set model.max_seq_len <= 128)"),
    "rope_scaling-linear": ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling type 'linear'"),
    "rope_scaling-llama3": ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
                            "rope_scaling type 'llama3' is not implemented"),
    "rope_scaling-dynamic": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
    "rope_scaling-no-type": ({"rope_scaling": {"factor": 2.0}}, "rope_scaling type {'factor': 2.0} (no type)"),
    "rope_parameters-yarn": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}},
                             "rope_parameters type 'yarn'"),
    "rope_parameters-theta": ({"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}},
                              "but rope_parameters.rope_theta = 50000.0 (set model.rope_theta = 50000.0)"),
    "partial_rotary_factor": ({"partial_rotary_factor": 0.5}, "partial_rotary_factor = 0.5"),
    "hidden_act": ({"hidden_act": "gelu"}, "hidden_act = 'gelu' (this model's MLP is SwiGLU; only 'silu')"),
    "attention_bias": ({"attention_bias": True}, "attention_bias = true (this model's llama layers have no biases"),
    "mlp_bias": ({"mlp_bias": True}, "mlp_bias = true"),
    "head_dim": ({"head_dim": 32}, "head_dim = 32 but model.hidden_size / model.num_heads = 16"),
    "vocab_size": ({"vocab_size": 32000},
                   "model.vocab_size = 512 but vocab_size = 32000 (set model.vocab_size = 32000)"),
    "hidden_size": ({"hidden_size": 128}, "model.hidden_size = 64 but hidden_size = 128"),
    "intermediate_size": ({"intermediate_size": 172}, "model.intermediate_size = 176 but intermediate_size = 172"),
    "num_hidden_layers": ({"num_hidden_layers": 3}, "model.num_layers = 2 but num_hidden_layers = 3"),
    "num_attention_heads": ({"num_attention_heads": 8}, "model.num_heads = 4 but num_attention_heads = 8"),
    "num_key_value_heads": ({"num_key_value_heads": 4}, "model.num_kv_heads = 2 but num_key_value_heads = 4"),
    "num_key_value_heads-absent": ({"num_key_value_heads": ...}, "but num_key_value_heads = 4"),  # = num_heads
    "tie_word_embeddings": ({"tie_word_embeddings": True},
                            "model.tie_embeddings = false but tie_word_embeddings = true "
                            "(set model.tie_embeddings = true)"),
}


@pytest.mark.parametrize("change,says", REFUSED.values(), ids=REFUSED.keys())
def test_each_key_mismatched_alone_is_a_one_line_config_error_naming_it(tmp_path, change, says):
    assert len(hf.init_mismatches(_config(**change), M)) == 1
    with pytest.raises(ConfigError) as refused:
        hf.load_for_init(_dir(tmp_path, **change), M)
    message = str(refused.value)
    assert message.startswith(f"model.init_from: {tmp_path} does not match the config: ")
    assert says in message and "\n" not in message


ACCEPTED = {
    "export": ({}, M),
    "eps-written-1e-05": ({"rms_norm_eps": 1e-05}, M),
    "eps-float32-round-trip": ({"rms_norm_eps": float(np.float32(1e-5))}, M),
    "theta-int": ({"rope_theta": 10000}, M),
    "theta-50000-set": ({"rope_theta": 50000.0, "rms_norm_eps": 1e-6}, ModelConfig(rope_theta=50000.0, norm_eps=1e-6)),
    "eps-absent-1e-6-set": ({"rms_norm_eps": ...}, ModelConfig(norm_eps=1e-6)),
    "more-positions-than-used": ({"max_position_embeddings": 4096}, M),
    "positions-equal": ({"max_position_embeddings": 256}, M),
    "rope_scaling-null": ({"rope_scaling": None}, M),
    "rope_scaling-absent": ({"rope_scaling": ...}, M),
    "rope_scaling-default": ({"rope_scaling": {"rope_type": "default"}}, M),
    "rope_parameters-default": ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                                 "rope_theta": ...}, M),
    "optional-keys-absent": ({k: ... for k in ("hidden_act", "attention_bias", "mlp_bias", "head_dim",
                                               "tie_word_embeddings")}, M),
    "kv-absent-mha": ({"num_key_value_heads": ...}, ModelConfig(num_kv_heads=4)),
}


@pytest.mark.parametrize("change,m", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_matching_values_load(tmp_path, change, m):
    directory = _dir(tmp_path, m, **change)
    assert hf.init_mismatches(json.loads((directory / "config.json").read_text()), m) == []
    assert list(hf.load_for_init(directory, m)) == ["model.norm.weight"]


def test_every_mismatch_is_named_in_the_one_message(tmp_path):
    change = {"rope_theta": 50000.0, "rms_norm_eps": 1e-6, "rope_scaling": {"type": "linear", "factor": 2.0},
              "vocab_size": 32000}
    with pytest.raises(ConfigError) as refused:
        hf.load_for_init(_dir(tmp_path, **change), M)
    message = str(refused.value)
    assert "\n" not in message
    for says in ("model.vocab_size = 32000", "model.rope_theta = 50000.0", "model.norm_eps = 1e-06",
                 "rope_scaling type 'linear'"):
        assert says in message


@pytest.mark.parametrize("cut", ["tensors", "header", "length"])
def test_a_safetensors_file_cut_short_is_refused_in_one_line_before_any_rank(tmp_path, cut):
    """A copy of model.safetensors cut short (a failed download): checked with config.json, before any rank
    starts (it used to reach every rank's loader, exit 70 three times, then a crash loop)."""
    from contracts.errors import DataError

    _dir(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    keep = {"tensors": len(data) - 7, "header": 8 + length // 2, "length": 5}[cut]
    path.write_bytes(data[:keep])
    with pytest.raises(DataError) as e:
        hf.check_init_from(tmp_path, M)
    assert str(e.value).startswith(f"model.init_from: {path}") and "\n" not in str(e.value)
    assert ("cut short" if cut == "tensors" else "not a readable safetensors file") in str(e.value)


def test_a_whole_safetensors_file_passes_the_check(tmp_path):
    assert hf.check_init_from(_dir(tmp_path), M) == [tmp_path / "model.safetensors"]
