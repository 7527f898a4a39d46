"""`llm-pretrain prepare-data` as a user runs it: real files, real worker processes."""
import hashlib
import json
import subprocess

import pytest


def _run(cli, env, *args, timeout=120):
    return subprocess.run([*cli, "prepare-data", *args], capture_output=True, text=True, env=env, timeout=timeout)


def _digests(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture
def inputs(tmp_path):
    src = tmp_path / "in"
    (src / "docs" / "sub").mkdir(parents=True)
    (src / "docs" / "a.txt").write_text("The quick brown fox.\n" * 20)
    (src / "docs" / "b.md").write_text("# Title\n\nSome *markdown* text, ünïcödé.\n")
    (src / "docs" / "sub" / "c.py").write_text("def f(x):\n    return x + 1\n")
    (src / "docs" / "image.png").write_bytes(b"\x89PNG not text")      # not a text suffix: ignored in dirs
    (src / "records.jsonl").write_text(
        json.dumps({"text": "first record"}) + "\n" + json.dumps({"body": "no text field"}) + "\n"
        + "not json at all\n" + json.dumps({"text": "second record"}) + "\n")
    (src / "latin1.txt").write_bytes("café in latin-1: caf\xe9".encode("utf-8")[:-2] + b"caf\xe9 \xff\n")
    return src


def test_prepare_is_byte_identical_across_runs(cli, quiet_env, inputs, tmp_path):
    args = ["--input", str(inputs / "docs"), "--input", str(inputs / "*.jsonl"), "--input", str(inputs / "latin1.txt"),
            "--shard-tokens", "256", "--workers", "2"]
    first = _run(cli, quiet_env, *args, "--output", str(tmp_path / "one"))
    second = _run(cli, quiet_env, *args, "--output", str(tmp_path / "two"))
    assert first.returncode == second.returncode == 0, first.stderr
    assert _digests(tmp_path / "one") == _digests(tmp_path / "two")
    manifest = json.loads((tmp_path / "one" / "manifest.json").read_text())
    assert manifest["documents"] == 3 + 2 + 1            # three files, two good records, one latin-1 file
    assert manifest["dtype"] == "uint16" and len(manifest["shards"]) > 1
    assert manifest["tokenizer"] == {"kind": "byte", "vocab_size": 257, "eos_id": 256}
    assert manifest["inputs"]["replaced_characters"] == 2 and manifest["inputs"]["skipped_lines"] == 2
    warnings = [json.loads(l) for l in first.stderr.splitlines() if "prepare_warning" in l]
    assert any(w["file"].endswith("latin1.txt") and "2 invalid UTF-8" in w["warning"] for w in warnings)
    assert any(w["file"].endswith("records.jsonl") and "(first: line 2)" in w["warning"] for w in warnings)
    done = json.loads(first.stderr.strip().splitlines()[-1])
    assert done["event"] == "prepare_done" and done["files"] == 5


@pytest.mark.parametrize("make,args,message", [
    (lambda d: None, ["--input", "{d}/absent.txt"], "input '{d}/absent.txt' does not exist"),
    (lambda d: None, ["--input", "{d}/*.nothing"], "matches no files"),
    (lambda d: (d / "empty").mkdir(), ["--input", "{d}/empty"], "holds no text files"),
    (lambda d: (d / "blank.txt").write_text(""), ["--input", "{d}/blank.txt"], "no text"),
    (lambda d: (d / "t.txt").write_text("x"), ["--input", "{d}/t.txt", "--tokenizer", "{d}/nope.json"],
     "does not exist"),
    (lambda d: [(d / "t.txt").write_text("x"), (d / "bad.json").write_text("{}")],
     ["--input", "{d}/t.txt", "--tokenizer", "{d}/bad.json"], "is JSON but not a Hugging Face tokenizer.json (it is an "
                                                               "empty object;"),
])
def test_bad_inputs_exit_65_with_one_line_and_leave_nothing(cli, quiet_env, tmp_path, make, args, message):
    make(tmp_path)
    out = tmp_path / "out"
    proc = _run(cli, quiet_env, *[a.format(d=tmp_path) for a in args], "--output", str(out))
    assert proc.returncode == 65, proc.stderr
    lines = [l for l in proc.stderr.strip().splitlines() if l.startswith("llm-pretrain:")]
    assert len(lines) == 1 and message.format(d=tmp_path) in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))


def test_existing_output_is_refused_unless_overwrite(cli, quiet_env, inputs, tmp_path):
    out = tmp_path / "out"
    assert _run(cli, quiet_env, "--input", str(inputs / "docs"), "--output", str(out)).returncode == 0
    refused = _run(cli, quiet_env, "--input", str(inputs / "records.jsonl"), "--output", str(out))
    assert refused.returncode == 65 and "already exists" in refused.stderr
    assert json.loads((out / "manifest.json").read_text())["documents"] == 3
    replaced = _run(cli, quiet_env, "--input", str(inputs / "records.jsonl"), "--output", str(out), "--overwrite")
    assert replaced.returncode == 0
    assert json.loads((out / "manifest.json").read_text())["documents"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]


def test_hugging_face_tokenizer_json(cli, quiet_env, inputs, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog."] * 50,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    tok_path = tmp_path / "tokenizer.json"
    tok.save(str(tok_path))
    proc = _run(cli, quiet_env, "--input", str(inputs / "docs" / "a.txt"), "--tokenizer", str(tok_path),
                "--output", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["tokenizer"]["kind"] == "hf" and manifest["tokenizer"]["eos_token"] == "</s>"
    assert manifest["tokenizer"]["eos_id"] == tok.token_to_id("</s>")
    assert manifest["tokenizer"]["sha256"] == hashlib.sha256(tok_path.read_bytes()).hexdigest()
    ids = tok.encode("The quick brown fox.\n" * 20, add_special_tokens=False).ids
    assert manifest["tokens"] == len(ids) + 1


def test_stdlib_corpus_is_this_pythons_standard_library(cli, quiet_env, tmp_path):
    proc = _run(cli, quiet_env, "--input", "@stdlib", "--output", str(tmp_path / "std"), timeout=300)
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((tmp_path / "std" / "manifest.json").read_text())
    assert manifest["inputs"]["files"] > 300 and manifest["tokens"] > 1_000_000


def test_people_get_a_bar_and_lines_json_stays_for_machines(cli, quiet_env, inputs, tmp_path):
    args = ["--input", str(inputs / "docs"), "--input", str(inputs / "*.jsonl")]
    human = _run(cli, quiet_env, *args, "--output", str(tmp_path / "one"), "--log-format", "console")
    assert human.returncode == 0, human.stderr
    lines = human.stderr.splitlines()
    assert not [l for l in lines if l.startswith("{")], lines            # no JSON for people
    assert "prepare-data [" in human.stderr and "files" in human.stderr   # the bar
    assert any(l.startswith("prepare warning  ") and "records.jsonl" in l for l in lines)
    assert lines[-1].startswith("prepare done  ") and "documents=" in lines[-1]
    machine = _run(cli, quiet_env, *args, "--output", str(tmp_path / "two"), "--log-format", "json")
    assert json.loads(machine.stderr.strip().splitlines()[-1])["event"] == "prepare_done"
