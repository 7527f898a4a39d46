"""`llm-pretrain export` as an operator runs it against a run directory: an existing output refused
as prepare-data refuses one (exit 65) unless --overwrite, and a one-line warning, naming both
steps, when the run's newest checkpoint is unusable and an older one is exported instead.
Checkpoints come from checkpointing.ShardWriter (no MindSpore)."""
import json
import subprocess

from tests.unit.test_export_files import write_checkpoint


def _export(cli, env, *args):
    return subprocess.run([*cli, "export", *map(str, args)], capture_output=True, text=True, env=env, timeout=120)


def _messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("llm-pretrain:")]


def test_an_existing_output_is_refused_with_prepare_datas_message_unless_overwrite(cli, quiet_env, tmp_path):
    run = tmp_path / "run"
    write_checkpoint(run / "checkpoints", 4)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("not an export")
    for fmt in ("hf", "mindformers"):
        refused = _export(cli, quiet_env, run, "--format", fmt, "-o", out)
        assert refused.returncode == 65, refused.stderr
        assert _messages(refused.stderr) == [f"llm-pretrain: data error: output {str(out)!r} already exists; "
                                             "choose another directory or pass --overwrite"], refused.stderr
        assert [p.name for p in out.iterdir()] == ["notes.txt"]
    done = _export(cli, quiet_env, run, "--format", "hf", "-o", out, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "special_tokens_map.json",
                                                     "tokenizer.json", "tokenizer_config.json"]
    assert "with the byte tokenizer" in done.stdout
    done = _export(cli, quiet_env, run, "--format", "mindformers", "-o", out, "--overwrite")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["llama.safetensors", "model.yaml", "shapes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]      # no .tmp-/.old- left behind


def test_a_corrupt_newest_checkpoint_warns_naming_both_steps_and_exports_the_older(cli, quiet_env, tmp_path):
    run = tmp_path / "run"
    write_checkpoint(run / "checkpoints", 4)
    newest = write_checkpoint(run / "checkpoints", 8)
    shard = next(newest.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])      # truncated, as by a full disk
    done = _export(cli, quiet_env, run, "--format", "hf", "-o", tmp_path / "hf")
    assert done.returncode == 0, done.stderr
    warnings = [line for line in _messages(done.stderr) if "warning" in line]
    assert len(warnings) == 1 and "step 8, failed verification" in warnings[0], done.stderr
    assert "exported step 4 instead" in warnings[0]
    assert "step-00000004" in done.stdout and newest.is_dir()              # exported the older; set nothing aside

    newest.rename(newest.with_name("step-00000008.corrupt"))                # as the ranks set a corrupt one aside
    done = _export(cli, quiet_env, run, "--format", "mindformers", "-o", tmp_path / "mf")
    assert done.returncode == 0, done.stderr
    assert _messages(done.stderr) == ["llm-pretrain: warning: the newest checkpoint, step 8, was set aside as "
                                      "step-00000008.corrupt; exported step 4 instead"], done.stderr

    explicit = _export(cli, quiet_env, run / "checkpoints" / "step-00000004", "--format", "hf", "-o", tmp_path / "x")
    assert explicit.returncode == 0 and not _messages(explicit.stderr), explicit.stderr   # asked for: no warning


def test_no_tokenizer_files_when_the_run_has_none_said_in_one_line(cli, quiet_env, tmp_path):
    run = tmp_path / "run"
    write_checkpoint(run / "checkpoints", 3, data={"source": "synthetic", "path": ""})
    done = _export(cli, quiet_env, run, "--format", "hf", "-o", tmp_path / "hf")
    assert done.returncode == 0, done.stderr
    assert _messages(done.stderr) == ["llm-pretrain: no tokenizer files exported: the run trained on synthetic "
                                      'data (data.source = "synthetic"): it has no tokenizer'], done.stderr
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    assert "eos_token_id" not in json.loads((tmp_path / "hf" / "config.json").read_text())
