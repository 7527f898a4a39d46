"""mindformers YAML -> this project's config, and the export formats' pure parts."""
from pathlib import Path

import yaml

from contracts.config import ModelConfig, load_config
from engine.interop import hf, import_config, mindformers

DATA = Path(__file__).parent / "data"


def test_a_mindformers_llama2_7b_yaml_maps_onto_the_config_and_lists_what_it_did_not_map(tmp_path):
    doc = yaml.safe_load((DATA / "mindformers_llama2_7b.yaml").read_text())
    cfg, unmapped = import_config.convert(doc)
    m = cfg.model
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.vocab_size) == (4096, 32, 32, 32, 32000)
    assert m.intermediate_size == 11008                     # LLaMA's rule with multiple_of 256
    assert (m.max_seq_len, cfg.data.seq_len, m.rope_theta, m.norm_eps) == (4096, 4096, 10000.0, 1e-5)
    t, o, p = cfg.train, cfg.optim, cfg.parallel
    assert (t.precision, t.micro_batch, t.grad_accum_steps, t.global_batch, t.recompute) == ("fp16", 1, 8, 64, True)
    assert (t.steps, o.lr, o.min_lr, o.warmup_steps, o.beta2, o.weight_decay) == (10000, 3e-4, 3e-5, 300, 0.95, 0.1)
    assert (p.dp, p.tp, p.pp) == (8, 1, 1) and cfg.run.name == "llama2_7b"
    assert "parallel_config.vocab_emb_dp" in unmapped and "runner_config.epochs" in unmapped
    assert "model.model_config.hidden_size" not in unmapped and "model.model_config.use_past" not in unmapped
    assert t.flash_attention is True and "model.model_config.use_flash_attention" not in unmapped
    doc["model"]["model_config"]["use_flash_attention"] = False
    assert import_config.convert(doc)[0].train.flash_attention is False
    out = tmp_path / "llama2_7b.toml"
    out.write_text(import_config.to_toml(cfg, unmapped, "pretrain_llama2_7b.yaml"))
    assert load_config(out) == cfg                            # the TOML written is a valid config of its own
    assert "#   runner_wrapper.scale_sense.scale_window" in out.read_text()


def test_hf_config_and_mindformers_names_cover_every_parameter():
    m = ModelConfig(num_heads=4, num_kv_heads=2)
    config = hf.hf_config(m)
    assert config["num_key_value_heads"] == 2 and config["head_dim"] == 16 and config["tie_word_embeddings"] is False
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
             "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
             "model.norm.weight", "lm_head.weight"]
    assert [mindformers.mf_name(n) for n in names] == [
        "model.tok_embeddings.embedding_weight", "model.layers.0.attention.wq.weight",
        "model.layers.0.feed_forward.w1.weight", "model.layers.0.feed_forward.w2.weight",
        "model.layers.0.attention_norm.weight", "model.layers.0.ffn_norm.weight", "model.norm_out.weight",
        "lm_head.weight"]
    doc = yaml.safe_load(mindformers.model_yaml(m))
    mc = doc["model"]["model_config"]
    assert (mc["type"], mc["n_kv_heads"], mc["rms_norm_eps"], doc["model"]["arch"]["type"]) == (
        "LlamaConfig", 2, 1e-5, "LlamaForCausalLM")


def test_bf16_safetensors_are_read_as_float32(tmp_path):
    import json
    import struct

    import numpy as np

    values = np.array([1.0, -2.5, 3.140625], dtype=np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype("<u2").tobytes()
    header = json.dumps({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, len(bf16)]}}).encode()
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bf16)
    assert hf.read_safetensors(tmp_path / "m.safetensors")["w"].tolist() == values.tolist()
