"""Checkpoints with real training workers: bit-exact resume, stop signals, kills, full and read-only disks."""
import json
import os
import random
import signal
import subprocess
import time

import numpy as np
import pytest

from checkpointing import layout, reader
from tests.e2e.cluster import Cluster, events, run_cluster


def sets(*overrides):
    return sum((["--set", o] for o in overrides), [])


def _train(cli, env, cwd, *args, timeout=300):
    proc = subprocess.run([*cli, "train", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    return proc, events(proc.stdout)


def _losses(evs):
    return {e["step"]: e["loss"] for e in evs if e["kind"] == "step"}


@pytest.fixture
def base(stdlib_corpus):
    # fp32, 40 steps in all; the stop comes from --until-step, so the schedule is the same in both runs
    return [f'data.path="{stdlib_corpus}"', "train.steps=40", "checkpoint.interval_steps=10"]


def test_resume_is_bit_exact_with_one_rank(cli, quiet_env, tmp_path, base):
    straight, a = _train(cli, quiet_env, tmp_path, *sets(*base, f'run.dir="{tmp_path / "a"}"'))
    first, b1 = _train(cli, quiet_env, tmp_path, *sets(*base, f'run.dir="{tmp_path / "b"}"'), "--until-step", "20")
    # the second half with sha256 shard checksums: which checksum a save records is no part of the trajectory
    second, b2 = _train(cli, quiet_env, tmp_path, *sets(*base, f'run.dir="{tmp_path / "b"}"',
                                                         'checkpoint.checksum="sha256"'))
    assert straight.returncode == first.returncode == second.returncode == 0, second.stderr[-2000:]
    assert b1[-1]["reason"] == "until_step" and b1[-1]["step"] == 20
    ckpts = tmp_path / "b" / "checkpoints"
    for step, checksum in ((20, "crc32c"), (40, "sha256")):       # CRC32C by default
        assert set(reader.read_manifest(ckpts / layout.step_name(step))["shards"][0]) == {"file", checksum,
                                                                                       "size_bytes"}
        assert reader.verify(ckpts / layout.step_name(step)) == []
    assert [e for e in b2 if e.get("stage") == "restored"][0]["step"] == 20
    assert [e["step"] for e in b2 if e["kind"] == "step"][0] == 21
    la, lb = _losses(a), _losses(b2)
    assert [la[s] for s in range(21, 41)] == [lb[s] for s in range(21, 41)]
    assert a[-1]["params_sha256"] == b2[-1]["params_sha256"]


def test_resume_is_bit_exact_with_two_ranks_and_into_one(cli, quiet_env, tmp_path, base):
    dp2 = base + ["parallel.dp=2", "train.micro_batch=4"]
    a = run_cluster(cli, quiet_env, tmp_path, sets(*dp2, f'run.dir="{tmp_path / "a"}"'))
    run_cluster(cli, quiet_env, tmp_path, sets(*dp2, f'run.dir="{tmp_path / "b"}"') + ["--until-step", "20"])
    shard_files = sorted(p.name for p in (tmp_path / "b" / "checkpoints" / "step-00000020").iterdir())
    assert shard_files == ["manifest.json", "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    b = run_cluster(cli, quiet_env, tmp_path, sets(*dp2, f'run.dir="{tmp_path / "b"}"'))
    for rank in (0, 1):
        la, lb = _losses(a[rank]), _losses(b[rank])
        assert [la[s] for s in range(21, 41)] == [lb[s] for s in range(21, 41)]
        assert a[rank][-1]["params_sha256"] == b[rank][-1]["params_sha256"]
    # the 2-rank checkpoint of step 20 also resumes in one process (another dp world size)
    import shutil
    shutil.copytree(tmp_path / "b" / "checkpoints" / "step-00000020", tmp_path / "c" / "checkpoints" / "step-00000020")
    one, c = _train(cli, quiet_env, tmp_path, *sets(*base, f'run.dir="{tmp_path / "c"}"'))
    assert one.returncode == 0, one.stderr[-2000:]
    lc = _losses(c)
    assert min(lc) == 21 and all(lc[s] == pytest.approx(la[s], rel=1e-3) for s in range(21, 41))


def test_sigterm_checkpoints_every_rank_at_the_same_step_and_exits_0(cli, quiet_env, tmp_path, stdlib_corpus):
    args = sets(f'data.path="{stdlib_corpus}"', "train.steps=100000", "checkpoint.interval_steps=0",
                "parallel.dp=2", "train.micro_batch=4", f'run.dir="{tmp_path / "run"}"')
    cluster = Cluster(cli, quiet_env, tmp_path, args)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and sum(e["kind"] == "step" for e in cluster.events(0)) < 5:
        time.sleep(0.2)
    for w in cluster.workers:
        w.send_signal(signal.SIGTERM)
    codes = cluster.wait(120)
    assert codes == [0, 0], cluster.tail()
    ends = [cluster.events(r)[-1] for r in (0, 1)]
    assert [e["reason"] for e in ends] == ["stopped", "stopped"]
    assert ends[0]["step"] == ends[1]["step"] and ends[0]["params_sha256"] == ends[1]["params_sha256"]
    assert layout.committed_steps(tmp_path / "run" / "checkpoints") == [ends[0]["step"]]
    print(f"stopped at step {ends[0]['step']}")


def test_sigkill_of_a_training_worker_mid_save_leaves_whole_checkpoints(cli, quiet_env, tmp_path, stdlib_corpus):
    args = sets(f'data.path="{stdlib_corpus}"', "train.steps=100000", "checkpoint.interval_steps=1",
                "checkpoint.keep_last=2", f'run.dir="{tmp_path / "run"}"')
    root = tmp_path / "run" / "checkpoints"
    rng = random.Random(7)
    for trial in range(2):
        proc = subprocess.Popen([*cli, "train", *args], cwd=tmp_path, env=quiet_env, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        for line in proc.stdout:                     # a checkpoint of this generation committed
            if '"committed"' in line:
                break
        time.sleep(rng.uniform(0.0, 0.3))
        proc.kill()
        proc.wait()
        for step in layout.committed_steps(root):
            assert reader.verify(layout.step_dir(root, step)) == []
    resumed, evs = _train(cli, quiet_env, tmp_path, *args, "--until-step", str(max(layout.committed_steps(root)) + 3))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert evs[-1]["reason"] == "until_step"


def _mount(*args):
    return subprocess.run(["mount", *args], capture_output=True, text=True)


@pytest.mark.parametrize("disk", ["full", "read-only"])
def test_unwritable_checkpoints_do_not_stop_training(cli, quiet_env, tmp_path, stdlib_corpus, disk):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs or a read-only bind mount needs root")
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    if disk == "full":
        mounted = _mount("-t", "tmpfs", "-o", "size=512k", "tmpfs", str(ckpts))   # the state is ~1.9 MB
    else:
        mounted = _mount("--bind", str(ckpts), str(ckpts))
        if mounted.returncode == 0:
            mounted = _mount("-o", "remount,ro,bind", str(ckpts))
    if mounted.returncode != 0:
        subprocess.run(["umount", str(ckpts)], capture_output=True)
        pytest.skip(f"cannot mount here: {mounted.stderr.strip()}")
    try:
        proc, evs = _train(cli, quiet_env, tmp_path, *sets(f'data.path="{stdlib_corpus}"', "train.steps=12",
                                                          "checkpoint.interval_steps=4", f'run.dir="{tmp_path / "run"}"'))
        visible = sorted(p.name for p in ckpts.iterdir())
    finally:
        subprocess.run(["umount", str(ckpts)], check=True)
    assert [e["step"] for e in evs if e["kind"] == "step"] == list(range(1, 13))   # training went on
    failed = [e for e in evs if e.get("stage") == "failed"]
    assert [e["step"] for e in failed] == [4, 8, 12] and all(e["detail"] for e in failed)
    print(f"{disk}: {failed[0]['detail']}")
    assert visible == []                                                            # nothing partial visible
    assert proc.returncode == 70 and "could not be saved" in proc.stderr            # the last save failed


def test_resuming_with_a_changed_trajectory_is_refused(cli, quiet_env, tmp_path, base):
    run = f'run.dir="{tmp_path / "run"}"'
    first, _ = _train(cli, quiet_env, tmp_path, *sets(*base, run), "--until-step", "10")
    assert first.returncode == 0
    refused, _ = _train(cli, quiet_env, tmp_path, *sets(*base, run, "optim.lr=0.01"))
    assert refused.returncode == 78 and "optim.lr" in refused.stderr and "--allow-config-change" in refused.stderr
    neutral, evs = _train(cli, quiet_env, tmp_path, *sets(*base, run, "train.micro_batch=4",
                                                         "train.grad_accum_steps=2"), "--until-step", "12")
    assert neutral.returncode == 0 and evs[-1]["step"] == 12       # accumulation may change freely
    allowed, _ = _train(cli, quiet_env, tmp_path, *sets(*base, run, "optim.lr=0.01"), "--allow-config-change",
                        "--until-step", "14")
    assert allowed.returncode == 0


def test_the_daemon_trains_on_with_a_new_decay_length_only_when_allowed(cli, quiet_env, tmp_path, base):
    """`run` takes --allow-config-change as `train` does, names the keys that changed, and its ranks
    resume the old checkpoint under the new schedule."""
    run = [*base, f'run.dir="{tmp_path / "run"}"', "checkpoint.interval_steps=5"]
    daemon = lambda *args: subprocess.run([*cli, "run", "--log-format", "json", *args], capture_output=True, text=True,
                                          env=quiet_env, cwd=tmp_path, timeout=600)
    first = daemon(*sets(*run, "train.steps=10"))
    assert first.returncode == 0, first.stderr[-2000:]
    longer = sets(*run, "train.steps=15", "optim.cosine_steps=15")
    refused = daemon(*longer)
    assert refused.returncode == 78 and "optim.cosine_steps" in refused.stderr, refused.stderr[-2000:]
    assert "--allow-config-change" in refused.stderr
    allowed = daemon(*longer, "--allow-config-change")
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert "changed trajectory-defining settings (optim.cosine_steps)" in allowed.stderr
    manifest = reader.read_manifest(layout.step_dir(tmp_path / "run" / "checkpoints", 15))
    assert manifest["run_state"]["trajectory"]["optim"]["cosine_steps"] == 15


def test_a_shard_loads_with_mindspores_own_loader(mindspore_cpu, cli, quiet_env, tmp_path, base):
    proc, _ = _train(cli, quiet_env, tmp_path, *sets(*base, f'run.dir="{tmp_path / "run"}"'), "--until-step", "3")
    assert proc.returncode == 0
    path = tmp_path / "run" / "checkpoints" / "step-00000003"
    ours = reader.load_tensors(path)
    theirs = mindspore_cpu.load_checkpoint(str(path / "shard-00000-of-00001.safetensors"), format="safetensors")
    assert set(theirs) == set(ours)
    for name, param in theirs.items():
        assert np.array_equal(param.asnumpy(), ours[name]), name
    assert "model.layers.0.self_attn.q_proj.weight" in theirs and "adam_m.lm_head.weight" in theirs
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["run_state"]["data_cursor"] == 24 and manifest["run_state"]["step"] == 3


def test_a_machine_of_several_keeps_a_whole_ram_checkpoint_and_resumes_from_it_only_at_the_agreed_step(
        make_trainer, tmp_path):
    """Issue 50, item 1: each machine's RAM tier is a whole checkpoint its own ranks write (here node 1 of two,
    one rank each: its one rank writes all of it and commits); a rank resumes from it only at the step its
    machines' daemons agreed on, exactly that one (without an agreement, as under msrun alone: the disk)."""
    import checkpointing
    from engine.rank.checkpoint import TrainerCheckpoints

    root, shm, events = tmp_path / "checkpoints", tmp_path / "shm", []
    sets = ("checkpoint.memory_interval_steps=1", f'checkpoint.memory_dir="{shm}"')

    def checkpoints(trainer, **where):
        return TrainerCheckpoints(root, trainer.cfg, params=trainer.state_params(), run_state=trainer.run_state,
                                  load_run_state=trainer.load_run_state, generation=0, emit=events.append,
                                  parallelism=trainer.parallelism, supervised=True, **where)

    a = make_trainer(*sets)
    a.train_step()
    on_disk = checkpoints(a, rank=0, world=1)
    on_disk.save({"loss": 1.0})
    assert on_disk.wait() and layout.committed_steps(root) == [1]
    a.train_step()
    a.train_step()
    node1 = checkpoints(a, rank=1, world=2, local_world=1, node=1)
    node1.save({"loss": 1.0}, memory=True)
    assert node1.wait()
    memory = layout.memory_root(tmp_path, shm, 1)
    assert layout.committed_steps(memory) == [3] and not layout.committed_steps(layout.memory_root(tmp_path, shm))
    manifest = reader.read_manifest(layout.step_dir(memory, 3))
    assert [sh["file"] for sh in manifest["shards"]] == [layout.shard_name(0, 1)]     # the machine's whole state
    b = make_trainer(*sets)
    restorer = checkpoints(b, rank=1, world=2, local_world=1, node=1)
    assert restorer.restore_latest()["step"] == 1                 # no agreement: the disk's
    assert restorer.restore_latest(agreed_step=3)["step"] == 3 and b.params_sha256() == a.params_sha256()
    with pytest.raises(checkpointing.CheckpointError, match="agreed to resume from step 2.*its newest is step 1"):
        restorer.restore_latest(agreed_step=2)


def test_the_trainers_state_round_trips_through_a_checkpoint_and_retention_is_opt_in(make_trainer, tmp_path):
    """In process: TrainerCheckpoints saves what Trainer.run_state gives it, under the manifest's
    long-standing keys, and load_run_state takes it back; retention only when asked (rank 0 alone)."""
    from contracts.protocol import LrOverride
    from engine.rank.checkpoint import TrainerCheckpoints

    root, events = tmp_path / "checkpoints", []

    def checkpoints(trainer, *, retain):
        return TrainerCheckpoints(root, trainer.cfg, params=trainer.state_params(), run_state=trainer.run_state,
                                  load_run_state=trainer.load_run_state, rank=0, world=1, generation=0,
                                  emit=events.append, parallelism=trainer.parallelism, retain=retain)

    a = make_trainer("checkpoint.keep_last=1")
    a.set_skips([(40, 48)])
    a.overrides = [LrOverride(start_step=2, factor=0.5, hold_steps=3, ramp_steps=3)]
    plain = checkpoints(a, retain=False)
    for _ in range(2):
        a.train_step()
        plain.save({"loss": 1.0})
        assert plain.wait()
    assert layout.committed_steps(root) == [1, 2]
    a.train_step()
    retaining = checkpoints(a, retain=True)
    retaining.save({"loss": 1.0})
    assert retaining.wait() and layout.committed_steps(root) == [3]
    assert [e.detail for e in events if e.stage == "retired"] == ["deleted steps 1, 2"]
    saved = reader.read_manifest(layout.step_dir(root, 3))["run_state"]
    assert sorted(saved) == sorted(["version", "step", "data_cursor", "data_epoch", "skip_ranges", "lr_overrides",
                                    "quarantined_blocks", "config_hash", "trajectory", "seeds", "dp_world_size",
                                    "parallel_layout", "metrics"])
    assert saved["skip_ranges"] == [[40, 48]] and saved["step"] == 3

    b = make_trainer("checkpoint.keep_last=1")
    assert checkpoints(b, retain=False).restore_latest()["step"] == 3
    assert b.run_state() == a.run_state() and b.params_sha256() == a.params_sha256()
    assert b.train_step().loss == a.train_step().loss


def test_a_save_staged_on_several_threads_holds_the_step_it_was_taken_at(make_trainer, tmp_path, monkeypatch):
    """The blocking copy cut across threads (checkpointing.staging_copy; here even a tiny save, on three):
    the checkpoint holds the saved step's state bit for bit though the next step runs while it is written,
    and a trainer restored from it trains the same next step."""
    from checkpointing import staging_copy
    from engine.rank.checkpoint import TrainerCheckpoints

    monkeypatch.setattr(staging_copy, "MIN_PARALLEL_BYTES", 0)
    root = tmp_path / "checkpoints"

    def checkpoints(trainer):
        return TrainerCheckpoints(root, trainer.cfg, params=trainer.state_params(), run_state=trainer.run_state,
                                  load_run_state=trainer.load_run_state, rank=0, world=1, generation=0,
                                  emit=lambda e: None, parallelism=trainer.parallelism)

    a = make_trainer()
    ckpt = checkpoints(a)
    ckpt._copier = staging_copy.StagingCopier(3)
    for _ in range(2):
        a.train_step()
    ckpt.save({"loss": 1.0})
    saved = a.params_sha256()
    after = a.train_step().loss                     # while the save is written
    assert ckpt.wait() and ckpt._copier._inboxes    # its helper threads copied
    b = make_trainer("checkpoint.direct_io=false")               # written past the page cache, read back either way
    restoring = checkpoints(b)
    assert restoring.restore_latest()["step"] == 2 and ckpt.writer.direct and not restoring.writer.direct
    assert b.params_sha256() == saved
    assert b.train_step().loss == after
