"""This engine against the reference implementations: transformers' LlamaForCausalLM computes the
same logits from an export, torch's AdamW takes the same steps, and an exported model comes back
through model.init_from unchanged. Needs the `interop` extra (torch 2.13.0, transformers)."""
import json
import subprocess

import numpy as np
import pytest

from engine.interop import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_model(directory):
    model = transformers.LlamaForCausalLM.from_pretrained(directory, torch_dtype=torch.float32,
                                                          attn_implementation="eager")
    return model.eval()


def _tensors(net) -> dict[str, np.ndarray]:
    return {p.name: p.asnumpy().copy() for p in net.trainable_params()}


@pytest.mark.parametrize("kv_heads,tied", [(4, False), (2, False), (2, True), (1, True)],
                         ids=["mha", "gqa", "gqa-tied", "mqa-tied"])
def test_logits_agree_with_transformers(make_trainer, tmp_path, kv_heads, tied):
    import mindspore as ms

    trainer = make_trainer(f"model.num_kv_heads={kv_heads}", f"model.tie_embeddings={str(tied).lower()}",
                           "model.init_std=0.2")              # a wide init: logits far from uniform
    cfg = trainer.cfg.model
    hf.save(tmp_path, cfg, _tensors(trainer.net))
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is tied
    assert ("lm_head.weight" in _tensors(trainer.net)) is not tied
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 48)).astype(np.int32)
    ours = trainer.net.logits(ms.Tensor(tokens)).asnumpy()
    with torch.no_grad():
        theirs = _hf_model(tmp_path)(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    diff = float(np.abs(ours - theirs).max())
    print(f"kv_heads {kv_heads} tied {tied}: max |logit difference| {diff:.2e} (logit std {theirs.std():.2f})")
    assert diff < 1e-4


def test_five_adamw_steps_with_warmup_cosine_and_clipping_match_torch(make_trainer, tmp_path):
    trainer = make_trainer("optim.warmup_steps=2", "optim.cosine_steps=3", "optim.lr=1e-2", "optim.min_lr=1e-3",
                           "optim.grad_clip=0.5", "model.init_std=0.1")
    cfg = trainer.cfg
    hf.save(tmp_path, cfg.model, _tensors(trainer.net))
    # five batches of one learnable sequence family (a token and its successor), shifted per step
    base = np.random.default_rng(1).integers(0, 64, size=(8, 1)) + np.arange(cfg.data.seq_len + 1)
    batches = [((base + k) % cfg.model.vocab_size).astype(np.int32)[None] for k in range(5)]
    ours = []
    for step, batch in enumerate(batches, 1):
        lr, _ = trainer.lr(step)
        ours.append(trainer.step_fn.run(batch, lr).loss)

    model = _hf_model(tmp_path).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    o = cfg.optim
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=o.lr, betas=(o.beta1, o.beta2),
                            eps=o.eps)
    theirs = []
    for step, batch in enumerate(batches, 1):
        for group in opt.param_groups:
            group["lr"] = trainer.lr(step)[0]
        tokens = torch.tensor(batch[0], dtype=torch.long)
        logits = model(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        theirs.append(float(loss.detach()))
    print("losses, this engine:", [round(x, 6) for x in ours])
    print("losses, torch AdamW:", [round(x, 6) for x in theirs])
    assert ours[-1] < ours[0] - 0.05                           # it really trained
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_a_trained_checkpoint_exported_and_loaded_back_with_init_from_gives_the_same_logits(
        cli, quiet_env, tmp_path, stdlib_corpus, make_trainer):
    import mindspore as ms

    run = tmp_path / "run"
    sets = [f'data.path="{stdlib_corpus}"', f'run.dir="{run}"', "train.steps=30"]
    args = sum((["--set", s] for s in sets), [])
    done = subprocess.run([*cli, "train", *args, "--until-step", "12"], env=quiet_env, capture_output=True,
                          text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "hf"
    done = subprocess.run([*cli, "export", str(run), "--format", "hf", "-o", str(out)], env=quiet_env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    mf = tmp_path / "mf"
    done = subprocess.run([*cli, "export", str(run / "checkpoints" / "step-00000012"), "--format", "mindformers",
                           "-o", str(mf)], env=quiet_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (mf / "model.yaml").exists() and "model.tok_embeddings.embedding_weight" in (mf / "shapes.txt").read_text()

    back = make_trainer(f'model.init_from="hf:{out}"')
    assert back.init_from_hf(str(out)) == len(list(back.net.trainable_params()))
    tokens = np.random.default_rng(2).integers(0, 512, size=(2, 32)).astype(np.int32)
    ours = back.net.logits(ms.Tensor(tokens)).asnumpy()
    with torch.no_grad():
        theirs = _hf_model(out)(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    fresh = make_trainer().net.logits(ms.Tensor(tokens)).asnumpy()
    assert np.abs(ours - fresh).max() > 1e-2                   # the weights did come from the export
    assert np.abs(ours - theirs).max() < 1e-4


def test_an_exported_run_loads_with_auto_classes_and_its_tokenizer_and_generates(cli, quiet_env, tmp_path,
                                                                                 stdlib_corpus):
    run = tmp_path / "run"
    sets = [f'data.path="{stdlib_corpus}"', f'run.dir="{run}"', "train.steps=30"]
    done = subprocess.run([*cli, "train", *sum((["--set", s] for s in sets), []), "--until-step", "3"],
                          env=quiet_env, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "hf"
    done = subprocess.run([*cli, "export", str(run), "--format", "hf", "-o", str(out)], env=quiet_env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "with the byte tokenizer" in done.stdout and "llm-pretrain:" not in done.stderr, done.stderr

    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and tokenizer.eos_token == "<|endoftext|>"
    prompt = "def main(ünïcode):"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert ids[0].tolist() == list(prompt.encode("utf-8"))                 # the ids training saw
    assert tokenizer.eos_token_id == model.config.eos_token_id == 256
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    new = generated[0, ids.shape[1]:].tolist()
    assert 1 <= len(new) <= 5 and all(0 <= t < model.config.vocab_size for t in new)
    text = tokenizer.decode(generated[0], skip_special_tokens=True)
    assert text.startswith(prompt), text
    print(f"generated {new} -> {text!r}")


def test_init_from_a_mismatched_model_is_a_config_error_naming_the_keys(make_trainer, tmp_path):
    from contracts.errors import ConfigError

    trainer = make_trainer()
    hf.save(tmp_path, trainer.cfg.model, _tensors(trainer.net))
    other = make_trainer("model.num_layers=3", "model.hidden_size=32")
    with pytest.raises(ConfigError, match="model.hidden_size = 32 but hidden_size = 64.*num_layers = 3"):
        other.init_from_hf(str(tmp_path))
