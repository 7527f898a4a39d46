"""The corpus format: atomic commit, verification on open, the packed token stream and its samples."""

import numpy as np
import pytest

from contracts.config import load_config
from contracts.errors import DataError
from engine.data.corpus import Corpus, CorpusWriter, iter_documents
from engine.data.order import CorpusSource, open_source

BYTE = {"kind": "byte", "vocab_size": 257, "eos_id": 256}


def _write(path, docs, shard_tokens=10, tokenizer=BYTE):
    w = CorpusWriter(path, tokenizer=tokenizer, shard_tokens=shard_tokens)
    for d in docs:
        w.add_document(np.append(np.asarray(d, dtype=np.uint32), tokenizer["eos_id"]))
    return w.commit({"specs": ["test"]})


DOCS = [list(range(1, 8)), list(range(20, 33)), [40, 41]]


def test_written_corpus_reads_back_across_shards(tmp_path):
    out = _write(tmp_path / "c", DOCS)
    corpus = Corpus(out)
    assert corpus.num_tokens == sum(len(d) + 1 for d in DOCS) == 25
    assert len(corpus.manifest["shards"]) == 3 and corpus.dtype == np.uint16
    assert [d.tolist() for d in iter_documents(corpus)] == DOCS
    assert corpus.tokens(8, 12).tolist() == [20, 21, 22, 23]                        # inside shard 0
    assert corpus.tokens(9, 11).tolist() == corpus.tokens(0, 25)[9:11].tolist()     # across a boundary
    assert not list(tmp_path.glob("c.tmp-*"))


def test_large_vocabulary_uses_uint32(tmp_path):
    big = {"kind": "hf", "vocab_size": 70000, "eos_id": 69999}
    corpus = Corpus(_write(tmp_path / "c", [[65535, 65536, 1]], tokenizer=big))
    assert corpus.dtype == np.uint32 and corpus.tokens(0, 4).tolist() == [65535, 65536, 1, 69999]


def test_an_existing_output_is_refused_and_kept(tmp_path):
    out = _write(tmp_path / "c", DOCS)
    before = (out / "manifest.json").read_text()
    with pytest.raises(DataError, match="already exists"):
        CorpusWriter(out, tokenizer=BYTE, shard_tokens=10)
    assert (out / "manifest.json").read_text() == before


def test_aborted_write_leaves_nothing(tmp_path):
    w = CorpusWriter(tmp_path / "c", tokenizer=BYTE, shard_tokens=10)
    w.add_document(np.arange(30, dtype=np.uint32))
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_empty_corpus_is_refused_and_leaves_nothing(tmp_path):
    w = CorpusWriter(tmp_path / "c", tokenizer=BYTE, shard_tokens=10)
    with pytest.raises(DataError, match="no text"):
        w.commit({})
    assert list(tmp_path.iterdir()) == []


def test_stale_temporaries_of_dead_writers_are_removed(tmp_path):
    (tmp_path / "c.tmp-999999999").mkdir()
    _write(tmp_path / "c", DOCS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_truncated_shard_is_named(tmp_path):
    out = _write(tmp_path / "c", DOCS)
    shard = out / "tokens-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match="tokens-00001.bin.*bytes but the manifest says"):
        Corpus(out)


def test_tampered_shard_of_a_version_1_corpus_fails_its_sha256_at_open(tmp_path):
    import json

    out = _write(tmp_path / "c", DOCS)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["version"] = 1
    del manifest["block_bytes"]
    for shard in manifest["shards"]:
        del shard["crc32c"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    shard = out / "tokens-00002.bin"
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="tokens-00002.bin.*sha256"):
        Corpus(out)
    Corpus(out, verify_checksums=False)   # an operator may opt out of hashing a huge corpus


@pytest.mark.parametrize("damage,message", [
    (lambda d: (d / "manifest.json").unlink(), "manifest.json is missing"),
    (lambda d: (d / "manifest.json").write_text("{"), "not valid JSON"),
    (lambda d: (d / "manifest.json").write_text('{"format": "x"}'), "not an llm-pretrain corpus"),
    (lambda d: (d / "tokens-00000.bin").unlink(), "is missing"),
])
def test_broken_corpus_directories(tmp_path, damage, message):
    out = _write(tmp_path / "c", DOCS)
    damage(out)
    with pytest.raises(DataError, match=message):
        Corpus(out)


def test_samples_pack_across_documents_and_cover_an_epoch(tmp_path):
    corpus = Corpus(_write(tmp_path / "c", DOCS))
    src = CorpusSource(corpus, seq_len=4, seed=3)
    assert src.samples_per_epoch == 6                        # (25 - 1) // 4
    epoch = src.batch(np.arange(6))
    stream = corpus.tokens(0, 25)
    starts = sorted(src.starts(np.arange(6)).tolist())
    assert starts == [0, 4, 8, 12, 16, 20]
    for row, start in zip(epoch, src.starts(np.arange(6))):
        assert row.tolist() == stream[start:start + 5].tolist()   # seq_len + 1 tokens, eos ids inside
    assert not np.array_equal(src.starts(np.arange(6)), src.starts(np.arange(6, 12)))  # next epoch reshuffles


def test_sequence_longer_than_corpus_is_a_data_error(tmp_path):
    corpus = Corpus(_write(tmp_path / "c", [[1, 2, 3]]))
    with pytest.raises(DataError, match="fewer than one sequence"):
        CorpusSource(corpus, seq_len=64, seed=0)


def test_corpus_vocabulary_must_fit_the_model(tmp_path):
    out = _write(tmp_path / "c", DOCS)
    with pytest.raises(DataError, match="model.vocab_size = 200"):
        open_source(load_config(None, [f'data.path="{out}"', "model.vocab_size=200", "data.seq_len=4"]))
