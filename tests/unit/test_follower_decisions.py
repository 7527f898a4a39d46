"""A node that does not decide applies the decider's decision with the decider's view of the run: a
checkpoint committed after the decision (the next generation's, on a loaded cluster where this node
applies it seconds later) counts neither as progress nor as a rollback target here."""
import io
import json

from contracts.config import load_config
from daemon.acting import decisions
from daemon.judging.incidents import Incident, Kind
from daemon.processes.run_files import RunFiles
from daemon.records.eventlog import EventLog
from daemon.records.ledger import Ledger
from daemon.records.metrics import Metrics
from daemon.records.notify import Notifier


def _commit_in(root, step):
    d = root / f"step-{step:08d}"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"format": "llm-pretrain-checkpoint", "version": 1, "step": step,
                                                 "shards": [], "tensors": {}}))


def _commit(run, step):
    _commit_in(run / "checkpoints", step)


def _node(tmp_path, rank):
    cfg = load_config(None, [f'run.dir="{tmp_path / "run"}"', "run.nodes=2", f"run.node_rank={rank}",
                             "parallel.dp=2", "train.micro_batch=4", 'run.coordinator="etcd://127.0.0.1:2379"',
                             "run.master_port=29500"])
    files = RunFiles(cfg, {})
    files.node_dir.mkdir(parents=True, exist_ok=True)
    out = io.StringIO()
    ledger = Ledger(files.node_dir, EventLog(None, "r", stream=out), Metrics("r"), Notifier({}), total_steps=100)
    return cfg, files, ledger, out


def test_a_follower_applying_a_crash_loop_halt_late_agrees_with_the_decider(tmp_path):
    run = tmp_path / "run"
    _commit(run, 10)
    nodes = [_node(tmp_path, r) for r in (0, 1)]
    for _, _, ledger, _ in nodes:                  # two restarts without a new checkpoint so far, on both
        ledger.state.set_last_committed(10)
        ledger.state.restarts_without_progress = 2
    crash = Incident(kind=Kind.CRASH, first_step=12, last_step=12, rank=1, detail="rank 1: exit code 1")
    cfg, files, ledger, _ = nodes[0]
    decided = decisions.decide_and_record(crash, ledger=ledger, files=files, cfg=cfg, base_cfg=cfg)
    assert decided.action.to_dict()["type"] == "halt"          # the third restart without progress
    _commit(run, 20)                               # committed after the decision, before node 1 applied it
    cfg1, files1, ledger1, out1 = nodes[1]
    published = {"record": decided.record.to_dict(), "config_changes": {}, "recovery": None,
                 "resume_step": decided.resume_step}
    applied = decisions.apply_published(published, ledger=ledger1, files=files1, cfg=cfg1, base_cfg=cfg1)
    assert applied.action.to_dict() == decided.action.to_dict()
    assert ledger1.state.restarts_without_progress == ledger.state.restarts_without_progress == 3
    assert "decision_mismatch" not in out1.getvalue()


def test_a_finished_run_says_its_last_step_when_the_last_step_datagrams_were_dropped(tmp_path):
    """A rank drops a step datagram its daemon cannot take in time (a full socket queue on a loaded
    machine); its exit event still says where it ended, and status's last step is that step."""
    from daemon.judging import watch
    from daemon.records.state import RunState
    _, files, ledger, _ = _node(tmp_path, 0)
    ledger.state.note_progress({"step": 8, "loss": 2.5, "tokens_per_s": 100.0})
    assert decisions.end_as(watch.Finished(12), ledger, stop_code=0, stop_reason=None) == 0
    saved = RunState.load(files.node_dir).last_progress
    assert saved["step"] == 12 and saved["loss"] == 2.5 and ledger.metrics.step == 12


def test_a_crash_after_new_ram_checkpoints_is_no_restart_without_progress(tmp_path):
    """With the RAM tier every few steps, a rank lost 30 steps after a restart made progress though no disk
    checkpoint came between: no backoff, no count toward giving up (it counted, and a third such crash halted)."""
    run = tmp_path / "run"
    _commit(run, 10)
    cfg = load_config(None, [f'run.dir="{run}"', "checkpoint.memory_interval_steps=1",
                             f'checkpoint.memory_dir="{tmp_path / "shm"}"'])
    files = RunFiles(cfg, {})
    files.node_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(files.node_dir, EventLog(None, "r", stream=io.StringIO()), Metrics("r"), Notifier({}),
                    total_steps=100)
    ledger.state.set_last_committed(12)            # the last generation resumed from the RAM tier's step 12
    ledger.state.restarts_without_progress = 2
    _commit_in(files.memory_root(), 40)            # ... and trained to 41, its RAM tier committing
    crash = Incident(kind=Kind.CRASH, first_step=41, last_step=41, rank=0, detail="rank 0: killed by signal 9")
    decided = decisions.decide_and_record(crash, ledger=ledger, files=files, cfg=cfg, base_cfg=cfg)
    assert decided.action.to_dict()["type"] == "restart" and decided.resume_step == 40
    assert ledger.state.restarts_without_progress == 0
    assert decisions.Backoff(cfg.health).delay_s(decided, ledger.state.restarts_without_progress) == 0.0
    again = Incident(kind=Kind.CRASH, first_step=41, last_step=41, rank=0, detail="rank 0: killed by signal 9")
    decisions.decide_and_record(again, ledger=ledger, files=files, cfg=cfg, base_cfg=cfg)
    assert ledger.state.restarts_without_progress == 1       # nothing newer than step 40 since: no progress


def test_a_follower_counts_progress_by_the_ram_step_the_decider_agreed(tmp_path):
    """Several machines: the decider judges progress by the agreed RAM step; a follower counts as it did."""
    run = tmp_path / "run"
    _commit(run, 10)
    nodes = [_node(tmp_path, r) for r in (0, 1)]
    for _, _, ledger, _ in nodes:                  # resumed from the agreed RAM step 12 after two restarts
        ledger.state.set_last_committed(12)
        ledger.state.restarts_without_progress = 2
    crash = Incident(kind=Kind.CRASH, first_step=41, last_step=41, rank=1, detail="rank 1: exit code 1")
    cfg, files, ledger, _ = nodes[0]
    decided = decisions.decide_and_record(crash, ledger=ledger, files=files, cfg=cfg, base_cfg=cfg, common=[30, 40])
    assert decided.action.to_dict()["type"] == "restart" and decided.resume_step == 40
    published = {"record": decided.record.to_dict(), "config_changes": {}, "recovery": None,
                 "resume_step": decided.resume_step, "progress_step": decided.progress_step}
    cfg1, files1, ledger1, out1 = nodes[1]
    applied = decisions.apply_published(published, ledger=ledger1, files=files1, cfg=cfg1, base_cfg=cfg1)
    assert applied.action.to_dict() == decided.action.to_dict()
    assert ledger1.state.restarts_without_progress == ledger.state.restarts_without_progress == 0
    assert ledger1.state.last_committed_step == ledger.state.last_committed_step == 40
    assert "decision_mismatch" not in out1.getvalue()
