"""The validation loss with real MindSpore ranks: measured on the held-out split at each interval and after
the last step, never changing what is trained, reported by the daemon (events, status, metrics), and the
same number transformers computes from an export of the checkpoint."""
import json
import subprocess

import numpy as np
import pytest

from contracts.config import load_config
from tests.e2e.cluster import events


def sets(*overrides):
    return sum((["--set", o] for o in overrides), [])


@pytest.fixture(scope="module")
def split_corpus(tmp_path_factory, cli, quiet_env):
    """A small corpus of its own with a fifth of its documents held out."""
    base = tmp_path_factory.mktemp("split")
    texts = base / "texts"
    texts.mkdir()
    rng = np.random.default_rng(7)
    words = ["the", "model", "learns", "to", "predict", "next", "token", "from", "text", "data", "and", "so", "on"]
    for i in range(300):
        (texts / f"doc-{i:03d}.txt").write_text(" ".join(rng.choice(words, size=40 + i % 30)) + ".\n")
    done = subprocess.run([*cli, "prepare-data", "--input", str(texts), "--output", str(base / "corpus"),
                           "--validation-fraction", "0.2", "--log-format", "json"], capture_output=True, text=True,
                          env=quiet_env, timeout=300)
    assert done.returncode == 0, done.stderr
    return base / "corpus"


def _train(cli, env, cwd, *overrides):
    proc = subprocess.run([*cli, "train", *sets(*overrides)], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return events(proc.stdout)


def test_validation_is_measured_at_each_interval_and_never_changes_the_training(cli, quiet_env, tmp_path,
                                                                                split_corpus):
    common = [f'data.path="{split_corpus}"', "train.steps=20", "train.eval_batches=3"]
    evaluated = _train(cli, quiet_env, tmp_path, *common, "train.eval_interval_steps=8", f'run.dir="{tmp_path / "a"}"')
    evals = [e for e in evaluated if e["kind"] == "eval"]
    assert [e["step"] for e in evals] == [8, 16, 20]                     # each interval, and after the last step
    for e in evals:
        assert np.isfinite(e["loss"]) and abs(e["perplexity"] - np.exp(e["loss"])) < 1e-6 * e["perplexity"]
        assert e["sequences"] == 3 * 8 and e["tokens"] == 3 * 8 * 64
    assert evals[-1]["loss"] < evals[0]["loss"]                          # it learned, and that shows held out
    plain = _train(cli, quiet_env, tmp_path, *common, "train.eval_interval_steps=0", f'run.dir="{tmp_path / "b"}"')
    assert not [e for e in plain if e["kind"] == "eval"]
    steps = lambda evs: [(e["step"], e["loss"]) for e in evs if e["kind"] == "step"]
    assert steps(evaluated) == steps(plain)                              # bit-identical training
    assert evaluated[-1]["params_sha256"] == plain[-1]["params_sha256"]


def test_the_daemon_reports_the_validation_loss_in_events_status_and_metrics(cli, quiet_env, tmp_path, split_corpus):
    run, textfile = tmp_path / "run", tmp_path / "metrics.prom"
    proc = subprocess.run([*cli, "run", "--log-format", "json", *sets(
        f'data.path="{split_corpus}"', "train.steps=12", "train.eval_interval_steps=6", f'run.dir="{run}"',
        "parallel.dp=2", "train.micro_batch=4", f'run.metrics_textfile="{textfile}"')],
        capture_output=True, text=True, env=quiet_env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = [json.loads(line) for line in (run / "logs" / "events.jsonl").read_text().splitlines()]
    validations = [e for e in logged if e["event"] == "validation"]
    assert [e["step"] for e in validations] == [6, 12]                   # rank 0 measured, once per interval
    status = json.loads(subprocess.run([*cli, "status", str(run), "--json"], capture_output=True, text=True,
                                       env=quiet_env, timeout=60).stdout)
    assert status["validation"]["step"] == 12 and status["validation"]["loss"] == validations[-1]["loss"]
    assert f'llm_pretrain_validation_loss{{run="run"}} {validations[-1]["loss"]!r}' in textfile.read_text()


def test_an_export_computes_the_same_validation_loss_with_transformers(cli, quiet_env, tmp_path, split_corpus):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from engine.data import order

    overrides = [f'data.path="{split_corpus}"', "train.steps=10", "train.eval_interval_steps=10",
                 f'run.dir="{tmp_path / "run"}"']
    (final,) = [e for e in _train(cli, quiet_env, tmp_path, *overrides) if e["kind"] == "eval"]
    exported = subprocess.run([*cli, "export", str(tmp_path / "run"), "--format", "hf", "-o", str(tmp_path / "hf")],
                              capture_output=True, text=True, env=quiet_env, timeout=300)
    assert exported.returncode == 0, exported.stderr
    cfg = load_config(None, overrides)
    batches = order.validation_batches(cfg, order.open_source(cfg))
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    losses = []
    with torch.no_grad():
        for batch in batches:
            tokens = torch.tensor(batch, dtype=torch.long)
            logits = model(tokens[:, :-1]).logits
            losses.append(float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                                  tokens[:, 1:].reshape(-1))))
    theirs = float(np.mean(losses))
    print(f"validation loss: this engine {final['loss']:.6f}, transformers {theirs:.6f}")
    assert abs(final["loss"] - theirs) < 1e-4
