"""The input pipeline through mindspore.dataset: resumable, rank-sharded, skipping exactly."""
import json
import subprocess

import numpy as np
import pytest

from engine.data.corpus import Corpus
from engine.data.feed import feed
from engine.data.order import CorpusSource, rank_slice


@pytest.fixture(scope="module")
def source(stdlib_corpus):
    return CorpusSource(Corpus(stdlib_corpus), seq_len=16, seed=7)


def _batches(source, *, steps, cursor=0, rank=0, dp=1, accum=1, global_batch=8, skips=()):
    share = lambda indices: rank_slice(indices, rank, dp=dp, grad_accum_steps=accum)
    return list(feed(source, cursor=cursor, steps=steps, share=share, global_batch=global_batch, skips=skips,
                     prefetch_steps=2))


def test_resuming_at_any_cursor_yields_the_same_batches(mindspore_cpu, source):
    skips = [(30, 45)]
    whole = _batches(source, steps=12, skips=skips)
    for k in (1, 5, 9):
        resumed = _batches(source, steps=12 - k, cursor=whole[k - 1].cursor_after, skips=skips)
        for a, b in zip(whole[k:], resumed):
            assert np.array_equal(a.batch, b.batch)
            assert (a.sample_start, a.sample_end) == (b.sample_start, b.sample_end)


def test_ranks_interleaved_equal_the_single_rank_order(mindspore_cpu, source):
    single = _batches(source, steps=6)
    ranks = [_batches(source, steps=6, rank=r, dp=2, accum=2) for r in range(2)]
    for step, one in enumerate(single):
        r0, r1 = ranks[0][step], ranks[1][step]
        assert r0.batch.shape == (2, 2, 17)
        joined = np.concatenate([r0.batch.reshape(-1, 17), r1.batch.reshape(-1, 17)])
        assert np.array_equal(joined, one.batch.reshape(-1, 17))


def test_an_epoch_covers_every_sample_once_then_reshuffles(stdlib_corpus):
    src = CorpusSource(Corpus(stdlib_corpus), seq_len=4096, seed=1)
    n = src.samples_per_epoch
    epoch0 = src.starts(np.arange(n))
    assert sorted(epoch0.tolist()) == list(range(0, n * 4096, 4096))
    assert not np.array_equal(epoch0, src.starts(np.arange(n, 2 * n)))


def test_skip_ranges_are_skipped_exactly(mindspore_cpu, source):
    plain = _batches(source, steps=8)
    skipping = _batches(source, steps=6, skips=[(16, 32)])        # steps 3 and 4 of the plain run
    assert [(f.sample_start, f.sample_end) for f in skipping][:3] == [(0, 8), (8, 16), (32, 40)]
    for a, b in zip(plain[:2] + plain[4:], skipping):
        assert np.array_equal(a.batch, b.batch)


def _corrupt(corpus_dir, tmp_path):
    import shutil

    copy = tmp_path / "corpus"
    shutil.copytree(corpus_dir, copy)
    shard = copy / "tokens-00000.bin"
    with open(shard, "r+b") as f:               # one bit of every 1 MiB block: the first batch reads one
        for offset in range(1000, shard.stat().st_size, 1 << 20):
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x01]))
    return copy


def test_train_stops_at_the_first_batch_that_reads_a_tampered_block_with_exit_65(cli, quiet_env, stdlib_corpus,
                                                                                 tmp_path):
    bad = _corrupt(stdlib_corpus, tmp_path)
    proc = subprocess.run([*cli, "train", "--set", f'data.path="{bad}"', "--set", "train.steps=2"],
                          capture_output=True, text=True, env=quiet_env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 65, proc.stderr[-2000:]
    assert "shard tokens-00000.bin block" in proc.stderr and "CRC32C" in proc.stderr
    assert "Traceback" not in proc.stderr
    fault = [json.loads(l) for l in proc.stdout.splitlines() if '"kind": "data_fault"' in l]
    assert fault and fault[0]["step"] == 1 and len(fault[0]["blocks"]) == fault[0]["corpus_blocks"]


def test_train_refuses_a_sequence_longer_than_the_corpus(cli, quiet_env, tmp_path):
    (tmp_path / "tiny.txt").write_text("too short")
    prep = subprocess.run([*cli, "prepare-data", "--input", str(tmp_path / "tiny.txt"), "--output",
                           str(tmp_path / "c")], capture_output=True, text=True, env=quiet_env, timeout=120)
    assert prep.returncode == 0, prep.stderr
    proc = subprocess.run([*cli, "train", "--set", f'data.path="{tmp_path / "c"}"'], capture_output=True,
                          text=True, env=quiet_env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 65 and "fewer than one sequence" in proc.stderr, proc.stderr[-2000:]
