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
        # each rank's own loss and gradient norm, learnt by both through the same sum: their mean is the loss
        assert a["rank_losses"] == b["rank_losses"] and a["rank_grad_norms"] == b["rank_grad_norms"]
        assert len(a["rank_losses"]) == 2 and sum(a["rank_losses"]) / 2 == pytest.approx(a["loss"], rel=1e-6)
        assert all(0 < g < float("inf") for g in a["rank_grad_norms"]) and a["rank_losses"][0] != a["rank_losses"][1]
    end0, end1 = r0[-1], r1[-1]
    assert end0["kind"] == end1["kind"] == "exit"
    assert end0["params_sha256"] == end1["params_sha256"], "ranks ended with different parameters"
    # the same global batch split over two ranks follows the single-process trajectory
    for a, s in zip(steps0, [e for e in alone if e["kind"] == "step"]):
        assert a["loss"] == pytest.approx(s["loss"], rel=2e-4), a["step"]


def test_the_shared_memory_sum_trains_exactly_as_mindspores_all_reduce(cli, quiet_env, tmp_path, stdlib_corpus):
    """Two local CPU ranks under msrun (MindSpore's cluster) sum their gradients through /dev/shm with
    parallel.local_reduce (the default); with it off they use MindSpore's AllReduce: the same losses, grad norms and parameters, to the bit,
    with gradient accumulation too (the finishing graph's buffer)."""
    from tests.e2e.cluster import Cluster

    runs = {}
    for local in (True, False):
        args = ["--set", f'data.path="{stdlib_corpus}"', "--set", "train.steps=8", "--set", "parallel.dp=2",
                "--set", "train.micro_batch=2", "--set", "train.grad_accum_steps=2",
                "--set", f"parallel.local_reduce={str(local).lower()}", "--set", f'run.dir="{tmp_path / str(local)}"']
        workdir = tmp_path / f"w{local}"
        workdir.mkdir()
        cluster = Cluster(cli, quiet_env, workdir, args)
        assert cluster.wait() == [0, 0], cluster.tail()
        said = [log.read_text() for log in cluster.logs]
        assert all(("through shared memory" in text) == local for text in said), said
        # parallel.bind_cores binds a local group only: under msrun, binding is msrun's (--bind_core)
        assert not any("runs on cores" in text for text in said), said
        runs[local] = [cluster.events(r) for r in range(2)]
    for rank in range(2):
        shm, ms_ = ([(e["loss"], e["grad_norm"]) for e in runs[k][rank] if e["kind"] == "step"] for k in (True, False))
        assert len(shm) == 8 and shm == ms_
        slots = [[(e["rank_losses"], e["rank_grad_norms"]) for e in runs[k][rank] if e["kind"] == "step"]
                 for k in (True, False)]
        assert slots[0] == slots[1] and len(slots[0][0][0]) == 2
        assert runs[True][rank][-1]["params_sha256"] == runs[False][rank][-1]["params_sha256"]
