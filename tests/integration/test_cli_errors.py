"""Bad input reaches the user as one line and a documented exit code, before MindSpore is loaded."""
import json
import subprocess
import sys

import pytest

BAD_FILES = {
    "wrong_type.toml": "[train]\nsteps = \"many\"\n",
    "unknown_key.toml": "[train]\nstep = 10\n",
    "unknown_section.toml": "[trainer]\nsteps = 10\n",
    "out_of_range.toml": "[optim]\nbeta2 = 1.5\n",
    "bf16_on_cpu.toml": "[train]\nprecision = \"bf16\"\n",
    "tp_on_cpu.toml": "[parallel]\ntp = 2\n",
    "pp_on_cpu.toml": "[parallel]\npp = 2\npipeline_microbatches = 2\n",
    "batch_not_divisible.toml": "[train]\nglobal_batch = 10\nmicro_batch = 4\n",
    "heads_not_dividing.toml": "[model]\nhidden_size = 100\nnum_heads = 3\n",
    "seq_too_long.toml": "[data]\nseq_len = 4096\n",
    "not_toml.toml": "this is = = not toml\n",
    "section_not_table.toml": "train = 5\n",
    "dp_without_ranks.toml": "[parallel]\ndp = 2\n[train]\nmicro_batch = 4\n",
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_config_exits_78_with_one_line(tmp_path, cli, quiet_env, name):
    path = tmp_path / name
    path.write_text(BAD_FILES[name])
    proc = subprocess.run([*cli, "train", "--config", str(path)], capture_output=True, text=True,
                          env=quiet_env, timeout=120)
    assert proc.returncode == 78, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llm-pretrain: config error: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_bad_override_exits_78(cli, quiet_env):
    proc = subprocess.run([*cli, "train", "--set", "train.steps=-3"], capture_output=True, text=True,
                          env=quiet_env, timeout=60)
    assert proc.returncode == 78 and "train.steps = -3" in proc.stderr


def test_missing_config_file_exits_78(tmp_path, cli, quiet_env):
    proc = subprocess.run([*cli, "train", "--config", str(tmp_path / "absent.toml")], capture_output=True,
                          text=True, env=quiet_env, timeout=60)
    assert proc.returncode == 78 and "does not exist" in proc.stderr


def test_usage_error_exits_2(cli, quiet_env):
    proc = subprocess.run([*cli, "trian"], capture_output=True, text=True, env=quiet_env, timeout=60)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_config_command_never_loads_mindspore(quiet_env):
    code = ("import sys, cli.main; rc = cli.main.main(['config', '--set', 'train.steps=5']);"
            "assert 'mindspore' not in sys.modules, 'mindspore was imported'; sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=quiet_env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "\nsteps = 5\n" in proc.stdout and "# resolved by `llm-pretrain config`; trajectory hash " in proc.stdout


def test_config_prints_toml_that_reads_back_equal_and_json_on_request(tmp_path, cli, quiet_env):
    import json

    from contracts.config import config_hash, load_config

    sets = ["--set", "train.steps=7", "--set", 'run.name="x"']
    toml = subprocess.run([*cli, "config", *sets], capture_output=True, text=True, env=quiet_env, timeout=60)
    (tmp_path / "resolved.toml").write_text(toml.stdout)
    expected = load_config(None, [sets[1], sets[3]])
    assert toml.returncode == 0 and load_config(tmp_path / "resolved.toml") == expected
    as_json = subprocess.run([*cli, "config", "--json", *sets], capture_output=True, text=True, env=quiet_env,
                             timeout=60)
    assert json.loads(as_json.stdout)["config_hash"] == config_hash(expected)


@pytest.mark.parametrize("command", [["logs", "{run}"], ["logs", "{run}", "--json"], ["status", "{run}", "--json"],
                                     ["config"], ["checkpoints", "list", "{run}"]])
def test_a_closed_pipe_ends_a_printing_command_quietly(tmp_path, cli, quiet_env, command):
    """`llm-pretrain logs RUN | head -1`: the reader goes away; no traceback, no exit 70."""
    import json

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "state.json").write_text(json.dumps({"status": "finished", "log_dir": str(run / "logs")}))
    line = json.dumps({"ts": "2026-11-30T00:00:00.000Z", "level": "info", "event": "progress", "run": "r",
                       "generation": 1, "step": 1, "loss": 2.5, "detail": "x" * 200})
    (run / "logs" / "events.jsonl").write_text((line + "\n") * 20000)         # ~6 MB: more than a pipe holds
    args = [a.format(run=run) for a in command]
    proc = subprocess.Popen([*cli, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=quiet_env)
    proc.stdout.close()             # the reader is gone before the first line (`head` already had its fill)
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert proc.returncode in (0, -13), err                                     # done, or SIGPIPE like `yes`
    assert "Traceback" not in err and "BrokenPipe" not in err and "internal error" not in err


@pytest.mark.parametrize("command", [["status", "/etc"], ["logs", "/etc"], ["checkpoints", "list", "/etc"],
                                     ["pause", "/etc"], ["status", "no-such-run"]])
def test_a_directory_that_is_not_a_run_is_a_usage_error(cli, quiet_env, tmp_path, command):
    proc = subprocess.run([*cli, *command], capture_output=True, text=True, env=quiet_env, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and ("not a run" in proc.stderr or "no run" in proc.stderr)


def test_checkpoints_show_of_a_missing_step_names_the_steps_there_are(tmp_path, cli, quiet_env):
    from tests.integration.test_checkpoint_store import _save

    for step in (3, 6):
        _save(tmp_path / "run" / "checkpoints", step)
    for action in ("show", "verify"):
        proc = subprocess.run([*cli, "checkpoints", action, str(tmp_path / "run"), "--step", "9999"],
                              capture_output=True, text=True, env=quiet_env, timeout=60)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
            f"llm-pretrain: no committed checkpoint at step 9999 in {tmp_path / 'run' / 'checkpoints'}; "
            "there are: 3, 6"]


def test_a_drill_for_a_run_whose_daemon_has_drills_off_is_refused_with_78(tmp_path, cli, quiet_env):
    from contracts.config import load_config, to_toml

    run = tmp_path / "run"
    (run / "control").mkdir(parents=True)
    (run / "config.resolved.toml").write_text(to_toml(load_config(None)))     # drills off, as by default
    proc = subprocess.run([*cli, "inject", "nan", str(run)], capture_output=True, text=True, env=quiet_env,
                          timeout=60)
    assert proc.returncode == 78 and "health.allow_fault_injection" in proc.stderr
    assert not list((run / "control").iterdir())                                # nothing left to wait


@pytest.mark.parametrize("args,code,message", [
    (["chaos", "--start"], 78, "fault injection is off for this run"),
    (["chaos", "--start", "--set", "health.allow_fault_injection=true", "--faults", "disk-full",
      "--disk-full-max-bytes", "4096"], 78, "disk-full would fill"),
    (["chaos"], 2, "name a live run (RUN), or pass --start"),
    (["chaos", "RUNDIR"], 2, "no config.resolved.toml: no daemon has run here"),
    (["chaos", "--faults", "crash,boom", "--start"], 2, "unknown fault(s) boom"),
    (["chaos", "--duration", "10d", "--start"], 2, "is not a duration"),
])
def test_chaos_refuses_before_any_fault_with_one_line(tmp_path, cli, quiet_env, args, code, message):
    run = tmp_path / "run"
    (run / "control").mkdir(parents=True)
    args = [str(run) if a == "RUNDIR" else a for a in args]
    proc = subprocess.run([*cli, *args, "--set", f'run.dir="{run}"'] if "--start" in args else [*cli, *args],
                          capture_output=True, text=True, env=quiet_env, timeout=60, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in run.iterdir()) == ["control"]          # nothing started, nothing written


@pytest.mark.parametrize("args", [["pause", "RUN"], ["stop", "RUN", "--reason", "x"], ["checkpoint", "RUN"],
                                  ["inject", "nan", "RUN"]])
def test_a_request_with_no_daemon_running_is_refused_with_69_unless_queued(tmp_path, cli, quiet_env, args):
    import fcntl
    import os

    run = tmp_path / "run"
    (run / "control").mkdir(parents=True)
    (run / "daemon.lock").write_text("12345\n")          # a dead daemon's lock: the file, no flock
    base = [*cli, *(str(run) if a == "RUN" else a for a in args)]
    proc = subprocess.run(base, capture_output=True, text=True, env=quiet_env, timeout=60)
    assert proc.returncode == 69, proc.stderr
    assert "no daemon is running" in proc.stderr and "--queue" in proc.stderr and "Traceback" not in proc.stderr
    assert not list((run / "control").iterdir())                                  # nothing left to wait
    assert subprocess.run([*base, "--queue"], capture_output=True, env=quiet_env, timeout=60).returncode == 0
    assert len(list((run / "control").iterdir())) == 1
    fd = os.open(run / "daemon.lock", os.O_RDWR)                   # a live holder (as the daemon holds it)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert subprocess.run(base, capture_output=True, env=quiet_env, timeout=60).returncode == 0
    finally:
        os.close(fd)
    assert len(list((run / "control").iterdir())) == 2


@pytest.mark.parametrize("args,code,message", [
    (["config", "--config", "/proc/self/mem"], 78, "cannot read config file '/proc/self/mem': Input/output error"),
    (["prepare-data", "--input", "INPUT", "--output", "/proc/x"], 73, "cannot create the corpus at '/proc/x'"),
    (["config", "--set", 'data.path="MISSING"'], 65, "is not a prepared corpus: manifest.json is missing"),
    (["run", "--set", 'data.path="MISSING"', "--set", 'run.dir="RUN"'], 65, "is not a prepared corpus"),
])
def test_bad_paths_are_one_line_and_a_documented_code_never_70(tmp_path, cli, quiet_env, args, code, message):
    text = tmp_path / "in.txt"
    text.write_text("some text\n")
    subst = {"INPUT": str(text), "MISSING": str(tmp_path / "no-corpus"), "RUN": str(tmp_path / "run")}
    args = [next((a.replace(k, v) for k, v in subst.items() if k in a), a) for a in args]
    proc = subprocess.run([*cli, *args], capture_output=True, text=True, env=quiet_env, timeout=120, cwd=tmp_path)
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt"]              # nothing created


@pytest.mark.parametrize("tokenizer,message", [
    ('{"vocab": {"a": 0}}', "is JSON but not a Hugging Face tokenizer.json (it is an object with keys vocab;"),
    ("[1, 2]", "is JSON but not a Hugging Face tokenizer.json (it is a JSON list;"),
    ("vocab = 3", "is not JSON (Expecting value: line 1 column 1"),
    (None, "input '/dev/zero' is a character device, not a text file or a directory"),
])
def test_prepare_data_says_what_is_wrong_with_an_input_or_a_tokenizer(tmp_path, cli, quiet_env, tokenizer, message):
    (tmp_path / "in.txt").write_text("some text\n")
    args = ["--input", str(tmp_path / "in.txt")]
    if tokenizer is None:
        args = ["--input", "/dev/zero"]
    else:
        (tmp_path / "tok.json").write_text(tokenizer)
        args += ["--tokenizer", str(tmp_path / "tok.json")]
    proc = subprocess.run([*cli, "prepare-data", *args, "--output", str(tmp_path / "corpus")], capture_output=True,
                          text=True, env=quiet_env, timeout=120)
    assert proc.returncode == 65 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "corpus").exists()


def test_a_corpus_the_model_cannot_embed_is_refused_by_config_and_run_before_any_rank(tmp_path, cli, quiet_env):
    (tmp_path / "in.txt").write_text("some text to tokenize, byte by byte\n" * 50)
    prep = subprocess.run([*cli, "prepare-data", "--input", str(tmp_path / "in.txt"), "--output",
                           str(tmp_path / "corpus")], capture_output=True, text=True, env=quiet_env, timeout=120)
    assert prep.returncode == 0, prep.stderr
    sets = ["--set", f'data.path="{tmp_path / "corpus"}"', "--set", "model.vocab_size=128",
            "--set", f'run.dir="{tmp_path / "run"}"']
    for command in ("config", "run"):
        proc = subprocess.run([*cli, command, *sets], capture_output=True, text=True, env=quiet_env, timeout=120)
        assert proc.returncode == 65, (command, proc.stderr)
        assert "has a vocabulary of 257 tokens but model.vocab_size = 128" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "logs").exists()                     # no rank was started


def test_an_init_from_whose_config_differs_is_refused_by_config_and_run_before_any_rank(tmp_path, cli, quiet_env):
    from contracts.config import load_config
    from engine.interop.hf import hf_config

    hf = tmp_path / "hf"
    hf.mkdir()
    config = hf_config(load_config(None, []).model)
    (hf / "config.json").write_text(json.dumps({**config, "rope_theta": 500000.0, "rms_norm_eps": 1e-3}))
    sets = ["--set", f'model.init_from="hf:{hf}"', "--set", f'run.dir="{tmp_path / "run"}"']
    for command in ("config", "run"):
        proc = subprocess.run([*cli, command, *sets], capture_output=True, text=True, env=quiet_env, timeout=120)
        assert proc.returncode == 78, (command, proc.stderr)
        assert "does not match the config" in proc.stderr and "rope_theta" in proc.stderr and "rms_norm_eps" in \
            proc.stderr, proc.stderr
    assert not (tmp_path / "run" / "logs").exists()


def test_a_validation_corpus_the_model_cannot_embed_is_refused_before_any_rank(tmp_path, cli, quiet_env):
    """The training corpus fits the model (a BPE vocabulary of at most 200 tokens, model.vocab_size = 208), the
    held-out corpus does not (bytes: 257 tokens): found by `config` and `run` in one line, not by every rank at
    its first validation."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog."] * 50,
                            trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "in.txt").write_text("The quick brown fox jumps over the lazy dog.\n" * 200)
    for name, extra in (("train", ["--tokenizer", str(tmp_path / "tokenizer.json")]), ("held-out", [])):
        prep = subprocess.run([*cli, "prepare-data", "--input", str(tmp_path / "in.txt"), "--output",
                               str(tmp_path / name), *extra], capture_output=True, text=True, env=quiet_env,
                              timeout=120)
        assert prep.returncode == 0, prep.stderr
    vocab = json.loads((tmp_path / "train" / "manifest.json").read_text())["tokenizer"].get("vocab_size")
    sets = ["--set", f'data.path="{tmp_path / "train"}"', "--set", f'data.validation_path="{tmp_path / "held-out"}"',
            "--set", f"model.vocab_size={max(int(vocab or 0), 208)}", "--set", f'run.dir="{tmp_path / "run"}"']
    for command in ("config", "run"):
        proc = subprocess.run([*cli, command, *sets], capture_output=True, text=True, env=quiet_env, timeout=120)
        assert proc.returncode == 65, (command, proc.stderr)
        assert f"corpus '{tmp_path / 'held-out'}' has a vocabulary of 257 tokens" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "logs").exists()                     # no rank was started
