"""What `llm-pretrain export` writes, in process: the byte tokenizer as a tokenizer.json that encodes
exactly as ByteTokenizer does, the run's tokenizer found from the checkpoint (or a reason, never a
guess), modes 0644/0755 under systemd's umask, and an export directory that is complete or absent.
No processes, no MindSpore (checkpoints come from checkpointing.ShardWriter)."""
import dataclasses
import hashlib
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from checkpointing import layout
from checkpointing.writer import ShardWriter
from contracts.config import ModelConfig
from contracts.errors import DataError
from engine.data.tokenizer import BYTE_EOS_TOKEN, ByteTokenizer, HFTokenizer, hf_tokenizer_files
from engine.interop import hf, mindformers

M = ModelConfig(vocab_size=300, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16,
                max_seq_len=32)
TEXTS = ["plain ASCII, with punctuation: {}[]()<>!?", "  leading spaces\tand tabs\r\nand CRLF\n",
         "ünïcödé café, 日本語のテキスト, emoji 🎉🚀, RTL שלום", "\x00\x01\x7f control bytes", ""]


def write_checkpoint(root: Path, step: int, *, data: dict | None = None, m: ModelConfig = M) -> Path:
    """A committed one-rank checkpoint of model m whose run_state records data.* as training does."""
    rng = np.random.default_rng(step)
    tensors = {"model.embed_tokens.weight": rng.normal(size=(m.vocab_size, m.hidden_size)).astype(np.float32),
               "model.norm.weight": np.ones(m.hidden_size, np.float32),
               "lm_head.weight": rng.normal(size=(m.vocab_size, m.hidden_size)).astype(np.float32),
               "optimizer.m.model.norm.weight": np.zeros(m.hidden_size, np.float32)}   # not exported
    data = {"source": "prepared", "path": "", "seq_len": 16, "seed": 1} if data is None else data
    trajectory = {"model": dataclasses.asdict(m), "data": data}
    writer = ShardWriter(root, rank=0, world=1, low_priority=False)
    writer.save(step, tensors, run_state={"step": step, "trajectory": trajectory})
    assert writer.wait(60) and writer.last_error is None, writer.last_error
    return layout.step_dir(root, step)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_json_encodes_exactly_our_ids_and_decodes_back(text):
    from tokenizers import Tokenizer

    ours = ByteTokenizer()
    tok = Tokenizer.from_str(ours.to_tokenizers().to_str())          # what the exported tokenizer.json holds
    assert tok.get_vocab_size(with_added_tokens=True) == ours.vocab_size == 257
    assert tok.token_to_id(BYTE_EOS_TOKEN) == ours.eos_id == 256
    expected = [*ours.encode(text).tolist(), ours.eos_id]            # a document as prepare-data stores it
    ids = tok.encode(text + BYTE_EOS_TOKEN, add_special_tokens=False).ids
    assert ids == expected
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids, skip_special_tokens=False) == text + BYTE_EOS_TOKEN


def test_byte_tokenizer_json_covers_every_byte_one_id_each():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(ByteTokenizer().to_tokenizers().to_str())
    every = bytes(range(256)).decode("latin-1")                      # U+0000..U+00FF: 1 or 2 UTF-8 bytes each
    assert tok.encode(every).ids == list(every.encode("utf-8"))
    assert tok.encode(every * 3 + BYTE_EOS_TOKEN + every).ids == [*(every * 3).encode(), 256, *every.encode()]
    assert sorted(tok.get_vocab().values()) == list(range(257))


def test_tokenizer_config_names_the_fast_tokenizer_and_its_eos():
    files = hf_tokenizer_files("{}", BYTE_EOS_TOKEN, model_max_length=32)
    assert sorted(files) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads(files["tokenizer_config.json"])
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["eos_token"] == BYTE_EOS_TOKEN
    assert config["model_max_length"] == 32 and config["clean_up_tokenization_spaces"] is False
    assert json.loads(files["special_tokens_map.json"]) == {"eos_token": BYTE_EOS_TOKEN}


def _modes(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory.parent)): stat.S_IMODE(p.stat().st_mode)
            for p in [directory, *directory.rglob("*")]}


def test_hf_export_of_an_embedded_corpus_run_has_the_byte_tokenizer_and_modes_0644_under_umask_0027(tmp_path):
    ckpt = write_checkpoint(tmp_path / "run" / "checkpoints", 4)
    old = os.umask(0o027)
    try:
        info = hf.export(ckpt, tmp_path / "out" / "hf")
        mf = mindformers.export(ckpt, tmp_path / "out" / "mf")
    finally:
        os.umask(old)
    out = tmp_path / "out" / "hf"
    assert info["tokenizer"] == "byte" and info["tokenizer_note"] is None
    assert info["tensors"] == 3 and mf["tensors"] == 3                 # model.* and lm_head, no optimizer state
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "special_tokens_map.json",
                                                     "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 256
    for directory in (out, tmp_path / "out" / "mf"):
        modes = _modes(directory)
        assert all(mode == (0o755 if (tmp_path / "out" / p).is_dir() else 0o644) for p, mode in modes.items()), modes
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["hf", "mf"]    # no .tmp-/.old- left


def test_existing_output_is_refused_unless_overwrite_which_replaces_it_whole(tmp_path):
    ckpt = write_checkpoint(tmp_path / "run" / "checkpoints", 4)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match=r"output '.*out' already exists; choose another directory or pass "
                                        r"--overwrite"):
        hf.export(ckpt, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    hf.export(ckpt, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]
    empty = tmp_path / "empty"
    empty.mkdir()
    hf.export(ckpt, empty)                                           # an empty directory is used, as prepare-data does
    assert (empty / "config.json").exists()


def test_a_failed_export_leaves_neither_a_directory_nor_a_temporary(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with hf.output_directory(out) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("disk full, say")
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with hf.output_directory(out, overwrite=True) as tmp:
            raise RuntimeError("midway")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "old.txt").read_text() == "old"


def test_an_unknowable_tokenizer_is_skipped_with_the_reason(tmp_path):
    synthetic = write_checkpoint(tmp_path / "a", 1, data={"source": "synthetic", "path": ""})
    info = hf.export(synthetic, tmp_path / "out-a")
    assert info["tokenizer"] is None and "synthetic" in info["tokenizer_note"]
    assert not (tmp_path / "out-a" / "tokenizer.json").exists()
    assert "eos_token_id" not in json.loads((tmp_path / "out-a" / "config.json").read_text())
    gone = write_checkpoint(tmp_path / "b", 1, data={"source": "prepared", "path": str(tmp_path / "nope")})
    info = hf.export(gone, tmp_path / "out-b")
    assert info["tokenizer"] is None and "cannot read the manifest of its corpus" in info["tokenizer_note"]
    assert str(tmp_path / "nope") in info["tokenizer_note"]


def _bpe(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog."] * 20,
                            trainers.BpeTrainer(vocab_size=280, special_tokens=["<unk>", "</s>"]))
    tok.save(str(path))
    return path


def test_a_tokenizer_json_corpus_has_its_file_copied_unless_it_changed(tmp_path):
    described = HFTokenizer(_bpe(tmp_path / "tok.json")).describe()
    assert described["path"] == str((tmp_path / "tok.json").resolve())
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_text(json.dumps({"tokenizer": described}))
    ckpt = write_checkpoint(tmp_path / "run", 2, data={"source": "prepared", "path": str(corpus)})
    info = hf.export(ckpt, tmp_path / "out")
    assert info["tokenizer"] == "hf" and info["tokenizer_note"] is None
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tmp_path / "tok.json").read_bytes()
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == described["eos_id"]

    (tmp_path / "tok.json").write_text((tmp_path / "tok.json").read_text().replace("lazy", "busy"))
    assert hashlib.sha256((tmp_path / "tok.json").read_bytes()).hexdigest() != described["sha256"]
    info = hf.export(ckpt, tmp_path / "out2")
    assert info["tokenizer"] is None and "changed since its corpus" in info["tokenizer_note"]
    assert not (tmp_path / "out2" / "tokenizer.json").exists()


def test_passed_over_names_the_newest_failed_or_quarantined_step_and_the_exported_one(tmp_path):
    root = tmp_path / "checkpoints"
    older, newest = write_checkpoint(root, 4), write_checkpoint(root, 8)
    assert hf.passed_over(newest) is None
    shard = next(newest.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])
    note = hf.passed_over(older)
    assert note.startswith("the newest checkpoint, step 8, failed verification (shard-00000-of-00001.safetensors: "
                           "100 bytes, manifest says") and note.endswith("; exported step 4 instead")
    newest.rename(root / "step-00000008.corrupt")
    assert hf.passed_over(older) == ("the newest checkpoint, step 8, was set aside as step-00000008.corrupt; "
                                     "exported step 4 instead")
