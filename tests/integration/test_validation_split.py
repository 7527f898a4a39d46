"""prepare-data's validation split: documents held out by a hash of each, a corpus of their own inside the
corpus, named in its manifest, never in the training stream."""
import json
import subprocess

import numpy as np
import pytest

from engine.data.corpus import Corpus


def _documents(corpus: Corpus, eos: int) -> list[bytes]:
    tokens = np.concatenate([np.asarray(m) for m in corpus._maps]) if corpus._maps else np.zeros(0)
    cuts = np.flatnonzero(tokens == eos)
    return [tokens[a + 1 if i else 0:b + 1].tobytes() for i, (a, b) in enumerate(zip([-1, *cuts[:-1]], cuts))]


def _prepare(cli, env, tmp_path, name, *extra):
    texts = tmp_path / "texts"
    texts.mkdir(exist_ok=True)
    for i in range(200):
        (texts / f"doc-{i:03d}.txt").write_text(f"document {i}: " + "some words to train on. " * (5 + i % 7))
    return subprocess.run([*cli, "prepare-data", "--input", str(texts), "--output", str(tmp_path / name),
                           "--log-format", "json", *extra], capture_output=True, text=True, env=env, timeout=300)


def test_a_validation_fraction_holds_documents_out_of_training_deterministically(tmp_path, cli, quiet_env):
    done = _prepare(cli, quiet_env, tmp_path, "a", "--validation-fraction", "0.2")
    assert done.returncode == 0, done.stderr
    corpus = Corpus(tmp_path / "a")
    split = corpus.manifest["validation"]
    held_out = Corpus(corpus.validation_path)
    assert split["path"] == "validation" and split["fraction"] == 0.2
    assert split["documents"] == held_out.manifest["documents"] and split["tokens"] == held_out.num_tokens
    assert corpus.manifest["documents"] + split["documents"] == 200
    assert 20 <= split["documents"] <= 60                           # about a fifth, by hash
    eos = corpus.tokenizer["eos_id"]
    train, val = _documents(corpus, eos), _documents(held_out, eos)
    assert len(train) == corpus.manifest["documents"] and len(val) == split["documents"]
    assert not set(train) & set(val)                                # no document on both sides
    # the same inputs, another worker count: the same split
    again = _prepare(cli, quiet_env, tmp_path, "b", "--validation-fraction", "0.2", "--workers", "1")
    assert again.returncode == 0, again.stderr
    assert sorted(_documents(Corpus(Corpus(tmp_path / "b").validation_path), eos)) == sorted(val)
    # without a fraction there is no split
    plain = _prepare(cli, quiet_env, tmp_path, "c")
    assert plain.returncode == 0 and "validation" not in json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert Corpus(tmp_path / "c").validation_path is None


@pytest.mark.parametrize("fraction,message", [("1", "--validation-fraction = 1 is out of range"),
                                              ("-0.1", "--validation-fraction = -0.1 is out of range"),
                                              ("1e-9", "held out none of the 200 documents")])
def test_a_fraction_that_holds_out_nothing_or_everything_is_refused(tmp_path, cli, quiet_env, fraction, message):
    done = _prepare(cli, quiet_env, tmp_path, "out", "--validation-fraction", fraction)
    assert done.returncode == 65 and message in done.stderr, done.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.tmp-*"))
