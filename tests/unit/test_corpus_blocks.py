"""Per-block CRC32C checksums: a corpus altered after it was prepared is caught by the batch that
first reads the altered block, naming the shard and the block; quarantined blocks are never read."""

import json

import crc32c
import numpy as np
import pytest

from contracts.errors import DataError
from engine.data.corpus import Corpus, CorpusWriter
from engine.data.corpus_blocks import CorruptBlockError, RunningBlocks
from engine.data.order import CorpusSource, step_samples

pytestmark = pytest.mark.unit

BYTE = {"kind": "byte", "vocab_size": 257, "eos_id": 256}
BLOCK = 4096                       # bytes: 2048 uint16 tokens


def _corpus(path, *, tokens=40_000, shard_tokens=10_000, seed=0):
    rng = np.random.default_rng(seed)
    w = CorpusWriter(path, tokenizer=BYTE, shard_tokens=shard_tokens, block_bytes=BLOCK)
    for _ in range(tokens // 500):
        w.add_document(np.append(rng.integers(0, 256, 499), 256))
    return w.commit({"specs": ["test"]})


def _zero_block(out, file, block):
    with open(out / file, "r+b") as f:
        f.seek(block * BLOCK)
        f.write(bytes(BLOCK // 2))    # half a block of zeros: same size, other bytes


def test_running_checksums_match_one_pass_over_each_block():
    data = np.random.default_rng(1).integers(0, 255, 10_000, dtype=np.uint8).tobytes()
    blocks = RunningBlocks(4096)
    for a, b in [(0, 17), (17, 4000), (4000, 4096), (4096, 9000), (9000, 10_000)]:
        blocks.update(data[a:b])
    assert blocks.finish() == [crc32c.crc32c(data[i:i + 4096]) for i in range(0, 10_000, 4096)]


def test_manifest_carries_one_checksum_per_block(tmp_path):
    out = _corpus(tmp_path / "c")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["version"] == 2 and manifest["block_bytes"] == BLOCK
    for shard in manifest["shards"]:
        raw = (out / shard["file"]).read_bytes()
        assert shard["crc32c"] == [crc32c.crc32c(raw[i:i + BLOCK]) for i in range(0, len(raw), BLOCK)]


def test_a_block_altered_after_open_fails_at_the_batch_that_reads_it(tmp_path):
    out = _corpus(tmp_path / "c")
    src = CorpusSource(Corpus(out), seq_len=63, seed=0)          # opens fine: no whole-corpus hash
    per_epoch = src.samples_per_epoch
    _zero_block(out, "tokens-00002.bin", 3)
    bad_lo = 2 * 10_000 + 3 * (BLOCK // 2)
    starts = src.starts(np.arange(per_epoch))
    touches = (starts < bad_lo + BLOCK // 2) & (starts + 64 > bad_lo)
    first_bad = int(np.flatnonzero(touches)[0])
    src.batch(np.arange(first_bad))                              # everything before it reads clean
    with pytest.raises(CorruptBlockError) as caught:
        src.batch(np.array([first_bad]))
    err = caught.value
    assert [(b.file, b.block) for b in err.bad] == [("tokens-00002.bin", 3)]
    assert err.bad[0].expected != err.bad[0].actual and err.corpus_blocks == 4 * 5
    assert "tokens-00002.bin block 3" in str(err) and isinstance(err, DataError)


def test_the_whole_shard_is_checked_once_a_block_fails(tmp_path):
    out = _corpus(tmp_path / "c")
    src = CorpusSource(Corpus(out), seq_len=63, seed=0)
    for block in (0, 4):
        _zero_block(out, "tokens-00001.bin", block)
    with pytest.raises(CorruptBlockError) as caught:
        src.batch(np.arange(src.samples_per_epoch))
    assert [(b.file, b.block) for b in caught.value.bad] == [("tokens-00001.bin", 0), ("tokens-00001.bin", 4)]


def test_blocks_are_verified_once_per_epoch(tmp_path):
    out = _corpus(tmp_path / "c")
    src = CorpusSource(Corpus(out), seq_len=63, seed=0)
    n = src.samples_per_epoch
    src.batch(np.arange(n))                    # epoch 0 verifies every block
    _zero_block(out, "tokens-00000.bin", 1)
    src.batch(np.arange(n))                    # already verified this epoch: not read again
    with pytest.raises(CorruptBlockError):
        src.batch(np.arange(n, 2 * n))         # epoch 1 checks again


def test_verify_checksums_off_reads_without_checking(tmp_path):
    out = _corpus(tmp_path / "c")
    _zero_block(out, "tokens-00000.bin", 0)
    checked = CorpusSource(Corpus(out), seq_len=63, seed=0)
    n = checked.samples_per_epoch
    with pytest.raises(CorruptBlockError):        # the alteration is one a check catches ...
        checked.batch(np.arange(n))
    src = CorpusSource(Corpus(out, verify_checksums=False), seq_len=63, seed=0)
    rows = src.batch(np.arange(n))                # ... read here unchecked, as the bytes now are
    stream = np.concatenate([np.fromfile(out / f"tokens-0000{i}.bin", dtype="<u2") for i in range(4)])
    starts = src.starts(np.arange(n))
    np.testing.assert_array_equal(rows, stream[starts[:, None] + np.arange(64)])
    assert not rows[starts == 0].any()            # the sample at the start of the zeroed half block


def test_quarantined_blocks_are_passed_over_in_the_same_order_on_every_rank(tmp_path):
    out = _corpus(tmp_path / "c")
    src = CorpusSource(Corpus(out), seq_len=63, seed=0)
    _zero_block(out, "tokens-00002.bin", 3)
    src.quarantine([("tokens-00002.bin", 3)])
    n = src.samples_per_epoch
    cursor, seen = 0, []
    while cursor < n:                          # one epoch, step by step, as the feed takes it
        step = step_samples(cursor, global_batch=8, excluded=src.excluded)
        src.batch(step.indices)                # never reads the bad block: no error
        seen.extend(step.indices.tolist())
        cursor = step.cursor_after
    bad_lo = 2 * 10_000 + 3 * (BLOCK // 2)
    starts = src.starts(np.arange(n))
    excluded = set(np.flatnonzero((starts < bad_lo + BLOCK // 2) & (starts + 64 > bad_lo)).tolist())
    assert excluded and not excluded & set(seen)
    assert set(range(n)) - excluded <= set(seen)
    # deterministic: the same cursor and quarantine give the same steps (every rank computes them)
    again = step_samples(0, global_batch=8, excluded=src.excluded)
    assert again.indices.tolist() == seen[:8]


def test_quarantine_names_a_missing_shard_clearly(tmp_path):
    src = CorpusSource(Corpus(_corpus(tmp_path / "c")), seq_len=63, seed=0)
    with pytest.raises(DataError, match="no shard 'tokens-00099.bin'"):
        src.quarantine([("tokens-00099.bin", 0)])


@pytest.mark.parametrize("block_bytes", [0, 1000, 4097])
def test_block_size_must_be_a_multiple_of_4096(tmp_path, block_bytes):
    with pytest.raises(DataError, match="multiple of 4096"):
        CorpusWriter(tmp_path / "c", tokenizer=BYTE, shard_tokens=10, block_bytes=block_bytes)
