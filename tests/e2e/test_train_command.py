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
    # by hand on a terminal: lines for people, not JSON
    screen = _on_a_terminal([*cli, "train", "--set", "train.steps=6", "--set", "train.log_interval_steps=2"],
                            cwd=tmp_path, env=quiet_env)
    assert "step 6/6" in screen and "loss " in screen and "tokens/s" in screen, screen[-2000:]
    assert "compiling the step" in screen and "checkpoint step 6 committed" in screen and "finished at step 6" in screen
    assert '{"' not in screen


def _on_a_terminal(cmd, **kw) -> str:
    """What `cmd` writes to stdout when stdout is a pseudo-terminal (it exits 0)."""
    import os
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=follower, stderr=subprocess.DEVNULL, **kw)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:                  # EIO: the terminal's other end is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=300) == 0
    return b"".join(chunks).decode(errors="replace")


def test_msrun_launches_train_as_mindspore_users_do(quiet_env, tmp_path, stdlib_corpus):
    """msrun starts the same command as the scheduler (MS_ROLE=MS_SCHED) and as each worker: `train`
    must be the scheduler there, or the cluster never forms. Both workers see the same global losses."""
    import sys
    from pathlib import Path

    import pytest

    from daemon.processes.mindspore_env import free_port

    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "msrun").exists() or not (bin_dir / "llm-pretrain").exists():
        pytest.skip("msrun or the installed llm-pretrain script is not in this environment")
    run = tmp_path / "run"
    cmd = [str(bin_dir / "msrun"), "--worker_num", "2", "--local_worker_num", "2", "--master_port",
           str(free_port()), "--join", "True", "--log_dir", str(tmp_path / "msrun_log"), str(bin_dir / "llm-pretrain"),
           "train", "--set", "train.steps=20", "--set", f'run.dir="{run}"', "--set", f'data.path="{stdlib_corpus}"',
           "--set", "parallel.dp=2", "--set", "train.micro_batch=4", "--set", "train.log_interval_steps=1"]
    env = dict(quiet_env, PATH=f"{bin_dir}:{quiet_env.get('PATH', '')}")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    losses = []
    for rank in (0, 1):
        lines = (tmp_path / "msrun_log" / f"worker_{rank}.log").read_text().splitlines()
        losses.append([json.loads(l)["loss"] for l in lines if l.startswith("{") and '"kind": "step"' in l])
    assert len(losses[0]) == 20 and losses[0] == losses[1]
    assert (run / "checkpoints" / "step-00000020" / "manifest.json").exists()


def test_a_rank_killed_by_sigsegv_writes_its_python_stack_to_its_log(cli, quiet_env, tmp_path):
    """A crash in MindSpore's C++ (SIGSEGV, SIGBUS, SIGABRT...) leaves the operator where it was: the
    Python stack of every thread on stderr (the rank's log under the daemon), then the signal's death."""
    import signal
    import time

    proc = subprocess.Popen([*cli, "train", "--set", "train.steps=100000"], cwd=tmp_path, env=quiet_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline()                 # its first event: training has begun
    time.sleep(1)
    proc.send_signal(signal.SIGSEGV)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGSEGV, err[-2000:]
    assert "Fatal Python error: Segmentation fault" in err and "engine/rank/trainer.py" in err, err[-2000:]
