"""The pieces between a decision and the next generation: the recovery directive, rollback of the
checkpoint directory, control files, fault drills, memory-cgroup discovery, detector rewind."""
import json
import os

import pytest

from checkpointing import layout
from contracts.config import config_from_dict, load_config, to_toml, with_changes
from contracts.errors import ConfigError
from contracts.protocol import LrOverride, RecoveryDirective
from daemon.judging import policy
from daemon.judging.health import HealthMonitor
from daemon.judging.incidents import Incident, IncidentRecord, Kind, Rollback
from daemon.judging.policy import RunHistory, merge_recovery
from daemon.processes import control, memcg
from contracts.drills import Drills
from tests.unit.steps import step_event

CFG = load_config(None)
CUT = LrOverride(start_step=51, factor=0.5, hold_steps=200, ramp_steps=200)


def _rollback(**kw):
    base = dict(reason="r", checkpoint_step=50, skip=(400, 424), lr_overrides=(CUT,))
    return Rollback(**{**base, **kw})


def test_recovery_round_trips_through_json():
    r = RecoveryDirective(checkpoint_step=50, skip_ranges=((1, 2), (5, 9)), lr_overrides=(CUT,), loss_scale=1024.0,
                 loss_scale_cap=1024.0, loss_scale_cap_until_step=1050)
    assert RecoveryDirective.from_json(r.to_json()) == r


def test_skip_ranges_accumulate_and_the_lr_list_is_the_policys():
    first = merge_recovery(None, _rollback())
    assert first.skip_ranges == ((400, 424),) and first.lr_overrides == (CUT,) and first.loss_scale_cap is None
    deeper = LrOverride(start_step=31, factor=0.25, hold_steps=200, ramp_steps=200)
    second = merge_recovery(first, _rollback(checkpoint_step=30, skip=(300, 310), lr_overrides=(deeper,)))
    assert second.checkpoint_step == 30 and second.skip_ranges == ((400, 424), (300, 310))
    assert second.lr_overrides == (deeper,)


def test_a_storm_keeps_the_lr_cut_in_force_and_a_later_cut_keeps_the_scale_cap():
    first = merge_recovery(None, _rollback())
    storm = merge_recovery(first, _rollback(skip=None, lr_overrides=(), loss_scale=4096.0,
                                                    loss_scale_cap_until_step=1050))
    assert storm.lr_overrides == (CUT,) and storm.loss_scale == storm.loss_scale_cap == 4096.0
    later = merge_recovery(storm, _rollback(checkpoint_step=60))
    assert later.loss_scale is None and later.loss_scale_cap == 4096.0 and later.loss_scale_cap_until_step == 1050


def test_config_changes_are_validated_and_the_resolved_file_reads_back_equal():
    cfg = with_changes(CFG, {"train.micro_batch": 4, "train.grad_accum_steps": 2, "train.recompute": True})
    assert (cfg.train.micro_batch, cfg.train.grad_accum_steps, cfg.train.recompute) == (4, 2, True)
    with pytest.raises(ConfigError, match="global_batch"):
        with_changes(CFG, {"train.micro_batch": 4})
    import tomllib
    odd = with_changes(cfg, {"run.master_addr": 'host"\\x', "optim.weight_decay": 1e-7, "run.dir": "/tmp/ü"})
    assert config_from_dict(tomllib.loads(to_toml(odd, ["a comment"]))) == odd


def test_roll_back_renames_later_checkpoints_and_replaces_an_older_rolled_back_copy(tmp_path):
    for step in (10, 20, 30):
        (layout.step_dir(tmp_path, step)).mkdir()
        (layout.step_dir(tmp_path, step) / "manifest.json").write_text(str(step))
    (tmp_path / layout.LATEST).write_text("step-00000030\n")
    (tmp_path / "step-00000030.rolledback").mkdir()
    assert layout.roll_back(tmp_path, 10) == [20, 30]
    assert layout.committed_steps(tmp_path) == [10] and not (tmp_path / layout.LATEST).exists()
    assert (tmp_path / "step-00000030.rolledback" / "manifest.json").read_text() == "30"
    assert layout.roll_back(tmp_path, 10) == []


def test_control_requests_are_consumed_in_order_and_garbage_is_reported(tmp_path):
    d = control.ControlDir(tmp_path)
    (tmp_path / "checkpoint").write_text("")
    os.utime(tmp_path / "checkpoint", ns=(1, 1))
    (tmp_path / "stop.2").write_text('{"reason": "maintenance"}')
    (tmp_path / ".inject.tmp").write_text("half written")
    (tmp_path / "pause").write_text("[1, 2]")
    (tmp_path / "frobnicate").write_text("")
    out = d.take()
    requests = [(r.name, r.body) for r in out if isinstance(r, control.Request)]
    assert requests[0] == ("checkpoint", {}) and ("stop", {"reason": "maintenance"}) in requests
    rejected = {r.file: r.reason for r in out if isinstance(r, control.Rejected)}
    assert set(rejected) == {"pause", "frobnicate"} and "JSON object" in rejected["pause"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".inject.tmp", ".pause.rejected", "frobnicate"]
    assert d.take() == []                            # the unknown file is reported once


def test_the_cli_writes_requests_that_the_daemon_reads(tmp_path):
    control.write_request(tmp_path, "inject", {"fault": "nan", "rank": 1})
    control.write_request(tmp_path, "inject", {"fault": "spike", "rank": 0})
    bodies = [r.body for r in control.ControlDir(tmp_path).take()]
    assert bodies == [{"fault": "nan", "rank": 1}, {"fault": "spike", "rank": 0}]


def test_a_world_writable_control_directory_is_refused(tmp_path):
    control.ensure(tmp_path / "control")
    assert (tmp_path / "control").stat().st_mode & 0o777 == 0o750 & ~_umask()
    (tmp_path / "control").chmod(0o777)
    with pytest.raises(control.ControlDirError, match="world-writable"):
        control.ensure(tmp_path / "control")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_drills_fire_on_their_steps_on_their_rank_only():
    logged = []
    d = Drills(rank=1, allowed=True, env={}, log=logged.append)
    d.add(1, {"fault": "nan", "rank": 1, "at_step": 12, "steps": 2}, applied_after_step=5)
    d.add(2, {"fault": "spike", "rank": 1}, applied_after_step=5)          # from the next step, 8 steps
    d.add(3, {"fault": "nan", "rank": 0}, applied_after_step=5)            # another rank's
    got = {step: d.before_step(step) for step in range(6, 16)}
    assert [s for s, (poison, _) in got.items() if poison != poison] == [12, 13]
    assert [s for s, (_, corrupt) in got.items() if corrupt] == list(range(6, 14))
    assert d.pending == []


def test_drills_are_refused_unless_allowed_and_oom_needs_a_limit():
    logged = []
    Drills(rank=0, allowed=False, env={}, log=logged.append).add(1, {"fault": "crash"}, 3)
    assert "allow_fault_injection = false" in logged[0]
    d = Drills(rank=0, allowed=True, env={}, log=logged.append)
    d.add(2, {"fault": "oom", "rank": 0}, 3)
    d.before_step(4)                                  # no limit: refused, not an allocation
    assert "without a memory limit" in logged[-1]
    d.add(3, {"fault": "melt", "rank": 0}, 3)
    assert "unknown fault 'melt'" in logged[-1]


def test_memory_cgroup_discovery_v1_and_v2(tmp_path):
    v1 = "4:memory:/process_api/abc\n0::/\n"
    (tmp_path / "memory" / "process_api" / "abc").mkdir(parents=True)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("max")
    assert memcg.locate(tmp_path, v1) == (1, tmp_path / "memory" / "process_api" / "abc")
    v2_root = tmp_path / "v2"
    (v2_root / "system.slice" / "llm-pretrain.service").mkdir(parents=True)
    (v2_root / "system.slice" / "llm-pretrain.service" / "cgroup.controllers").write_text("cpu io memory pids\n")
    assert memcg.locate(v2_root, "0::/system.slice/llm-pretrain.service\n") == (
        2, v2_root / "system.slice" / "llm-pretrain.service")
    (v2_root / "system.slice" / "llm-pretrain.service" / "cgroup.controllers").write_text("cpu pids\n")
    with pytest.raises(memcg.CgroupError, match="Delegate=yes"):
        memcg.locate(v2_root, "0::/system.slice/llm-pretrain.service\n")


def test_memory_cgroup_counters_are_read_from_both_formats(tmp_path):
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    (tmp_path / "memory.max_usage_in_bytes").write_text("123456\n")
    assert memcg.MemoryCgroup(1, tmp_path).oom_kills() == 2
    assert memcg.MemoryCgroup(1, tmp_path).peak_bytes() == 123456
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 5\noom 1\noom_kill 1\n")
    assert memcg.MemoryCgroup(2, tmp_path).oom_kills() == 1
    assert memcg.MemoryCgroup(2, tmp_path / "gone").peak_bytes() is None


def _event(step, loss, **kw):
    return step_event(step=step, loss=loss, tokens_per_s=1000.0, **kw)


def test_after_a_rollback_replayed_steps_are_judged_against_the_kept_baseline():
    m = HealthMonitor(CFG.health, precision="fp32")
    for step in range(1, 201):
        assert m.observe(_event(step, 2.0 + 0.01 * (step % 5))) == []
    assert m.observe(_event(201, 6.0)) == [] and m.observe(_event(202, 6.0)) == []
    m.rewind(180)                                  # resumed from 180: the half-seen spike is forgotten
    assert all(s <= 180 for s, _ in m.loss.history) and len(m.loss.history) >= 50
    for step in range(181, 203):
        assert m.observe(_event(step, 2.0 + 0.01 * (step % 5))) == []
    spikes = [i for step in (203, 204, 205) for i in m.observe(_event(step, 6.0))]
    assert [(i.kind, i.first_step, i.last_step) for i in spikes] == [("loss_spike", 203, 205)]


def test_a_recurrence_after_a_rollback_counts_even_if_it_starts_earlier():
    earlier = [Incident(kind=Kind.LOSS_SPIKE, first_step=300, last_step=303)]
    history = RunHistory(incidents=earlier, committed_steps=(100, 200), sample_ranges={})
    reproduced = {"triage": {"verdict": "deterministic"}}          # its rerun reproduced it
    action = policy.decide(Incident(kind=Kind.LOSS_SPIKE, first_step=290, last_step=292, evidence=reproduced), history,
                           CFG.health, CFG.train)
    assert action.lr_overrides[0].factor == 0.25


def test_incident_events_are_strict_json_even_with_non_finite_evidence(tmp_path):
    import io

    from daemon.records.eventlog import EventLog

    out = io.StringIO()
    log = EventLog(tmp_path / "events.jsonl", "r", stream=out)
    log.emit("incident", evidence={"grad_norm": float("nan"), "values": [float("inf"), 1.0]})
    log.close()
    record = json.loads(out.getvalue(), parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))
    assert record["evidence"] == {"grad_norm": "nan", "values": ["inf", 1.0]}


def test_a_device_oom_is_read_from_this_process_s_part_of_the_log_only(tmp_path):
    from daemon.processes.rank_log import oom_line

    log = tmp_path / "rank-0.log"
    log.write_text("generation 1\n[ERROR] Device(id:0) memory isn't enough and alloc failed, alloc size: 4096\n")
    start = log.stat().st_size
    assert "memory isn't enough" in oom_line(log)
    with open(log, "a") as f:
        f.write("generation 2\nRuntimeError: Parameter[2] has no default param\n")
    assert oom_line(log, start) is None


def test_a_ranks_refusal_is_its_last_own_line_in_this_process_s_part_of_the_log(tmp_path):
    from daemon.processes.rank_log import refusal_line

    log = tmp_path / "rank-0.log"
    log.write_text("generation 1\nllm-pretrain: config error: an older generation's reason\n")
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write("generation 2\nllm-pretrain: initialized 12 parameters from hf:/m\n[WARNING] noise\n"
                "llm-pretrain: data error: corpus '/c' has a vocabulary of 257 tokens but model.vocab_size = 128\n"
                "[INFO] teardown\n")
    assert refusal_line(log, start) == "data error: corpus '/c' has a vocabulary of 257 tokens but model.vocab_size = 128"
    assert refusal_line(tmp_path / "absent.log") is None
    log.write_text("no reason given\n")
    assert refusal_line(log) is None


def test_a_crashed_ranks_error_is_the_last_exception_of_its_traceback(tmp_path):
    from daemon.processes.rank_log import error_line

    log = tmp_path / "rank-0.log"
    log.write_text("generation 1\nRuntimeError: an older generation's\n")
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write('{"kind": "phase", "phase": "restore"}\nTraceback (most recent call last):\n'
                '  File "/x/hf.py", line 40, in _header\n    return json.loads(raw)\n'
                "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)\n"
                "[WARNING] DEVICE(1,7f,python):2026-12-06 teardown\n")
    assert error_line(log, start) == "json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)"
    log.write_text("llm-pretrain: internal error: see above\n")
    assert error_line(log) == "internal error: see above"
    log.write_text("killed\n")
    assert error_line(log) is None


def test_the_control_directory_watcher_flags_a_new_request(tmp_path):
    import time

    d = control.ControlDir(tmp_path)
    kind = d.watch()
    try:
        assert kind in ("InotifyObserver", "PollingObserver")
        assert not d.changed()
        control.write_request(tmp_path, "checkpoint", {})
        deadline = time.monotonic() + 60
        while not d.changed():
            assert time.monotonic() < deadline, "the watcher never noticed the request"
            time.sleep(0.02)
    finally:
        d.close()


def test_status_tells_state_progress_eta_incident_and_last_request(tmp_path):
    from cli import status as status_cli
    from daemon.records.state import RunState

    state = RunState(status="running", generation=2, restarts=1, daemon_pid=os.getpid(), total_steps=1000,
                     last_progress={"step": 400, "loss": 2.5, "tokens": 512, "tokens_per_s": 1024.0,
                                    "unix_s": 995.0, "mean_step_s": 0.5},
                     incidents=[IncidentRecord(
                         incident=Incident(kind=Kind.LOSS_SPIKE, first_step=300, last_step=303), generation=1,
                         unix_s=900.0, action=Rollback("roll back to 280", checkpoint_step=280, skip=None,
                                                       lr_overrides=()))],
                     last_control={"name": "checkpoint", "unix_s": 990.0, "reason": "before upgrade"})
    state.save(tmp_path)
    layout.step_dir(tmp_path / "checkpoints", 380).mkdir(parents=True)
    s = status_cli.summary(tmp_path, now=os.stat(layout.step_dir(tmp_path / "checkpoints", 380)).st_mtime + 30)
    assert (s["status"], s["step"], s["eta_s"]) == ("running", 400, 300.0)     # 600 steps x 0.5 s
    assert s["last_checkpoint"]["step"] == 380 and s["last_checkpoint"]["age_s"] == 30.0
    text = status_cli.render(s)
    assert "400 / 1000" in text and "loss_spike at step 300 -> rollback" in text and "5m00s" in text
    assert "checkpoint" in text and "before upgrade" in text
    json.dumps(s)                                  # what `status --json` prints
    state.checkpoints_failing_since = 390
    state.recovery = RecoveryDirective(checkpoint_step=280, skip_ranges=((10, 20),))
    state.save(tmp_path)
    s = status_cli.summary(tmp_path)
    assert "FAILING since step 390" in status_cli.render(s)
    assert json.loads(json.dumps(s))["recovery"]["skip_ranges"] == [[10, 20]]
    state.daemon_pid = 0
    state.save(tmp_path)
    assert status_cli.summary(tmp_path)["status"] == "running (daemon not running)"


@pytest.mark.parametrize("current,incidents,expected", [
    (100, [], {80, 90, 100}),            # hold 3 + margin 10: horizon 87 -> 80 settled; 90 and 100 may become it
    (60, [], {40, 50, 60}),
    (15, [], {10}),                      # nothing at or before the horizon (2) yet; 10 may become it
    (100, [(76, 85)], {60, 90, 100}),    # 70 and 80 lie within a rolled-back incident's margin: not healthy
])
def test_the_daemon_protects_what_a_later_rollback_may_need(current, incidents, expected):
    from daemon.processes.run_files import protected_steps

    records = [IncidentRecord(incident=Incident(kind=Kind.LOSS_SPIKE, first_step=a, last_step=b), generation=1,
                              unix_s=0.0, action=Rollback("r", checkpoint_step=0, skip=None, lr_overrides=()))
               for a, b in incidents]
    committed = [s for s in (10, 20, 30, 40, 50, 60, 70, 80, 90, 100) if s <= current]
    assert protected_steps(committed, records, CFG, current_step=current) == expected


def test_both_kinds_of_peers_implement_the_seam_the_supervisor_is_typed_against():
    import inspect

    from daemon import supervisor
    from daemon.acting import peers
    from daemon.machines.nodes import Nodes

    seam = {name: inspect.signature(f) for name, f in vars(peers.Peers).items()
            if callable(f) and not name.startswith("_")}
    assert len(seam) == 14 and isinstance(vars(peers.Peers)["is_leader"], property)
    for kind in (peers.Alone, Nodes):
        for name, signature in seam.items():
            assert name in dir(kind), f"{kind.__name__} lacks {name}"
            assert list(inspect.signature(getattr(kind, name)).parameters) == list(signature.parameters), \
                f"{kind.__name__}.{name}{inspect.signature(getattr(kind, name))} is not the seam's {name}{signature}"
        assert "is_leader" in dir(kind)
    assert "self.peers: peers.Peers" in inspect.getsource(supervisor.Supervisor.__init__)


def test_a_memory_cgroup_this_user_cannot_create_in_is_refused_at_the_start(tmp_path, monkeypatch):
    v1 = "4:memory:/process_api/abc\n0::/\n"
    parent = tmp_path / "memory" / "process_api" / "abc"
    parent.mkdir(parents=True)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("max")
    monkeypatch.setattr(memcg.os, "access", lambda path, mode: str(path) != str(parent))   # as an unprivileged user sees it
    with pytest.raises(memcg.CgroupError, match="cannot create memory cgroups under .*permission denied.*needs root"):
        memcg.locate(tmp_path, v1)


@pytest.mark.parametrize("nodes, disk, memory, expected", [
    (1, [10, 20], [21, 24], 24),       # the RAM tier's newest: what the ranks restore
    (1, [10, 20], [18], 20),           # older than the disk's: the disk's
    (1, [10, 20], [], 20),             # a wiped RAM tier (a reboot)
    (2, [10, 20], [24], 20),           # several machines resume from the disk
])
def test_the_step_reported_is_the_one_the_ranks_resume_from(tmp_path, nodes, disk, memory, expected):
    """Restart and rollback events, generation_start and the systemd STATUS line said the disk's newest (say 20)
    while one machine's ranks restored the RAM tier's (24)."""
    from checkpointing.writer import FORMAT, VERSION
    from daemon.processes.run_files import RunFiles

    sets = [f'run.dir="{tmp_path / "run"}"', f'checkpoint.memory_dir="{tmp_path / "shm"}"']
    if nodes > 1:
        sets += [f"run.nodes={nodes}", "parallel.dp=2", "train.micro_batch=4", 'run.coordinator="etcd://127.0.0.1:2379"',
                 "run.master_port=29500"]
    (tmp_path / "run").mkdir()
    files = RunFiles(load_config(None, sets), {})
    manifest = {"format": FORMAT, "version": VERSION, "shards": []}
    for root, steps in ((files.ckpt_root, disk), (layout.memory_root(files.run_dir, tmp_path / "shm"), memory)):
        for s in steps:
            layout.step_dir(root, s).mkdir(parents=True)
            (layout.step_dir(root, s) / layout.MANIFEST).write_text(json.dumps(manifest))
    assert files.committed_step() == 20 and files.resume_step() == expected
