"""`llm-pretrain chaos` against two real MindSpore ranks (issue 13): six faults — kill -9 of a
rank, SIGSTOP, a hang, a kill -9 of the daemon, a full disk — driven into one run by the product's
own soak command; every one detected and recovered from, no fault costing more than one checkpoint
interval of steps, and the final parameters bit-identical to an uninterrupted run's."""
import json
import subprocess

from tests.e2e.cluster import mount_tmpfs

INTERVAL = 25


def test_a_soak_of_six_crash_faults_recovers_each_and_stays_bit_exact(cli, quiet_env, tmp_path, stdlib_corpus):
    run = tmp_path / "run"
    mount_tmpfs(run, "64m")                  # the disk-full fault needs the run on a small filesystem
    report_path = tmp_path / "report.json"
    sets = [f'data.path="{stdlib_corpus}"', "train.steps=700", f"checkpoint.interval_steps={INTERVAL}",
            "checkpoint.keep_last=2", "parallel.dp=2", "train.micro_batch=4", f'run.dir="{run}"',
            "run.compile_cache=false", "health.allow_fault_injection=true", "health.restart_backoff_initial_s=0.2",
            "health.hang_floor_s=3"]
    try:
        done = subprocess.run([*cli, "chaos", "--start", *sum((["--set", s] for s in sets), []),
                               "--faults", "crash,sigstop,hang,daemon-kill,disk-full", "--max-faults", "6",
                               "--mean-interval", "1s", "--duration", "15m", "--seed", "4", "--reference",
                               "--report", str(report_path)],
                              cwd=tmp_path, env=quiet_env, capture_output=True, text=True, timeout=1200)
    finally:
        subprocess.run(["umount", "-l", str(run)], capture_output=True)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    faults = report["faults"]
    assert len(faults) == 6 and {f["fault"] for f in faults} == {"crash", "sigstop", "hang", "daemon-kill",
                                                                 "disk-full"}
    for f in faults:
        assert f["error"] is None and f["recovery_s"] is not None and f["detection_s"] is not None, f
        assert 0 <= f["lost_steps"] <= INTERVAL, f            # never more than one checkpoint interval
    assert all(f["lost_steps"] == 0 for f in faults if f["fault"] == "disk-full")
    assert all(f["detection_s"] < 30 for f in faults)
    assert report["finished"] and report["final_step"] == 700 and report["daemon_exit_code"] == 0
    assert report["daemon_starts"] == 1 + sum(f["fault"] == "daemon-kill" for f in faults)
    assert report["bit_exact"] is True and report["params_sha256"] == report["reference_sha256"]
    assert 0 < report["goodput"] < 1
