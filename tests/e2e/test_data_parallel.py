"""Two real MindSpore ranks over the dynamic cluster (msrun's environment), one compute thread each."""
import subprocess

import pytest

from tests.e2e.cluster import events, run_cluster

STEPS = 15


def test_two_ranks_stay_identical_and_match_one_process(cli, quiet_env, tmp_path, stdlib_corpus):
    data = f'data.path="{stdlib_corpus}"'
    sets = lambda *o: sum((["--set", x] for x in o), [])
    r0, r1 = run_cluster(cli, quiet_env, tmp_path, sets(data, f"train.steps={STEPS}", "parallel.dp=2",
                                                          "train.micro_batch=4", f'run.dir="{tmp_path / "dp"}"'))
    single = subprocess.run([*cli, "train", *sets(data, f"train.steps={STEPS}", f'run.dir="{tmp_path / "one"}"')],
                            cwd=tmp_path, env=quiet_env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]
    alone = events(single.stdout)

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
