"""`llm-pretrain train` as a user runs it: JSON lines on stdout, a checkpoint at the end, exit 0."""
import json
import subprocess


def test_train_prints_json_lines_and_checkpoints_at_the_end(cli, quiet_env, tmp_path):
    proc = subprocess.run([*cli, "train", "--set", "train.steps=4", "--set", "train.log_interval_steps=2"],
                          cwd=tmp_path, env=quiet_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    steps = [e for e in events if e["kind"] == "step"]
    assert [e["step"] for e in steps] == [2, 4]
    for e in steps:
        assert {"loss", "grad_norm", "lr", "loss_scale", "skipped", "tokens_per_s", "sample_start"} <= e.keys()
    assert [e["stage"] for e in events if e["kind"] == "checkpoint"] == ["staged", "written", "committed"]
    assert events[-1]["kind"] == "exit" and events[-1]["reason"] == "finished"
    assert (tmp_path / "runs" / "tiny" / "checkpoints" / "step-00000004" / "manifest.json").exists()
    again = subprocess.run([*cli, "train", "--set", "train.steps=4"], cwd=tmp_path, env=quiet_env,
                           capture_output=True, text=True, timeout=300)
    restarted = [json.loads(line) for line in again.stdout.splitlines()]
    assert again.returncode == 0 and not [e for e in restarted if e["kind"] == "step"]   # already done
    assert restarted[-1]["reason"] == "finished" and restarted[-1]["step"] == 4
