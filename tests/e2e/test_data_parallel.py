"""Two real MindSpore ranks over the dynamic cluster (msrun's environment), one compute thread each."""
import json
import subprocess
import sys

import pytest

from daemon.cluster import SCHEDULER, WORKER, free_port, process_env

STEPS = 15


def _lines(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _run_cluster(cli, env, workdir, overrides, ranks=2):
    port = free_port()
    common = dict(sched_host="127.0.0.1", sched_port=port, worker_num=ranks, local_worker_num=ranks)
    sched = subprocess.Popen([sys.executable, "-m", "engine.scheduler"], cwd=workdir,
                             env=process_env(env, role=SCHEDULER, **common),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = []
    for rank in range(ranks):
        args = [*cli, "train", *sum((["--set", o] for o in overrides), [])]
        workers.append(subprocess.Popen(args, cwd=workdir, env=process_env(env, role=WORKER, node_id=rank, **common),
                                        stdout=subprocess.PIPE, stderr=open(workdir / f"rank{rank}.log", "w"),
                                        text=True))
    try:
        outs = [w.communicate(timeout=300)[0] for w in workers]
        assert sched.wait(timeout=60) == 0
    finally:
        for p in [*workers, sched]:
            if p.poll() is None:
                p.kill()
    assert [w.returncode for w in workers] == [0] * ranks, [(workdir / f"rank{r}.log").read_text()[-2000:]
                                                           for r in range(ranks)]
    return [_lines(o) for o in outs]


def test_two_ranks_stay_identical_and_match_one_process(cli, quiet_env, tmp_path, stdlib_corpus):
    env = quiet_env
    data = f'data.path="{stdlib_corpus}"'
    ranks = _run_cluster(cli, env, tmp_path, [data, f"train.steps={STEPS}", "parallel.dp=2", "train.micro_batch=4"])
    single = subprocess.run([*cli, "train", "--set", data, "--set", f"train.steps={STEPS}"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]
    alone = _lines(single.stdout)

    r0, r1 = ranks
    steps0 = [e for e in r0 if e["kind"] == "step"]
    steps1 = [e for e in r1 if e["kind"] == "step"]
    assert [e["step"] for e in steps0] == list(range(1, STEPS + 1))
    for a, b in zip(steps0, steps1):
        # loss and grad norm are global: all-reduced, bit-identical on both ranks
        assert (a["loss"], a["grad_norm"], a["sample_start"], a["sample_end"]) == \
               (b["loss"], b["grad_norm"], b["sample_start"], b["sample_end"])
        assert (a["rank"], b["rank"]) == (0, 1)
    end0, end1 = r0[-1], r1[-1]
    assert end0["kind"] == end1["kind"] == "exit"
    assert end0["params_sha256"] == end1["params_sha256"], "ranks ended with different parameters"
    # the same global batch split over two ranks follows the single-process trajectory
    for a, s in zip(steps0, [e for e in alone if e["kind"] == "step"]):
        assert a["loss"] == pytest.approx(s["loss"], rel=2e-4), a["step"]
