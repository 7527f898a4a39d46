"""`llm-pretrain train` as a user runs it: JSON step lines on stdout, exit 0."""
import json
import subprocess


def test_train_prints_one_json_line_per_step(cli, quiet_env, tmp_path):
    proc = subprocess.run([*cli, "train", "--set", "train.steps=4", "--set", "train.log_interval_steps=2"],
                          cwd=tmp_path, env=quiet_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [e["step"] for e in events if e["kind"] == "step"] == [2, 4]
    for e in events[:-1]:
        assert {"loss", "grad_norm", "lr", "loss_scale", "skipped", "tokens_per_s"} <= e.keys()
    assert events[-1]["kind"] == "exit" and events[-1]["reason"] == "finished"
