"""Device faults: a rank that stands out, the rotated rerun that tells the data from the device, the
quarantine it decides and the lemon list that keeps it (daemon.judging.health, daemon.judging.triage, daemon.judging.policy,
daemon.judging.quarantine, daemon.records.state)."""
import dataclasses

import pytest

from contracts.config import load_config
from contracts.errors import ConfigError
from contracts.protocol import StepEvent
from daemon.judging import policy, quarantine, watch
from daemon.judging.health import HealthMonitor
from daemon.judging.incidents import Incident, IncidentRecord, Kind, Rerun, Restart, Rollback
from daemon.judging.policy import RunHistory
from daemon.judging.triage import RerunCheck
from daemon.judging.watch import Watch
from daemon.records.state import RunState

CFG = load_config(None)
CKPTS = (50, 100, 150, 200, 250)


def event(step, norms, losses=None, generation=1, rank=0):
    losses = losses or [3.0] * len(norms)
    return StepEvent(rank=rank, generation=generation, step=step, loss=sum(losses) / len(losses),
                     grad_norm=sum(norms) / len(norms), loss_scale=1.0, lr=1e-3, lr_multiplier=1.0, skipped=False,
                     sample_start=8 * (step - 1), sample_end=8 * step, tokens=512, step_s=0.01, data_wait_s=0.0,
                     tokens_per_s=1e4, rank_losses=list(losses), rank_grad_norms=list(norms))


def test_one_ranks_gradient_norm_far_above_the_others_three_steps_in_a_row_is_an_incident():
    monitor = HealthMonitor(CFG.health, precision="fp32")
    found = [i for s in range(1, 40) for i in monitor.observe(event(s, [1.0, 1.2, 0.9, 1.1]))]
    assert found == []                                           # replicas of one model on iid shares: alike
    found = [i for s in (40, 41) for i in monitor.observe(event(s, [1.0, 40.0, 0.9, 1.1]))]
    found += monitor.observe(event(42, [1.0, 1.1, 0.9, 1.1]))   # the streak broken: nothing
    assert found == []
    found = [i for s in range(43, 46) for i in monitor.observe(event(s, [1.0, 40.0, 0.9, 1.1]))]
    [incident] = found
    assert incident.kind is Kind.RANK_OUTLIER and incident.needs_action
    assert (incident.first_step, incident.last_step, incident.rank) == (43, 45, 1)
    assert incident.evidence["ranks"] == [1]


def test_rank_outlier_steps_zero_turns_the_detector_off():
    monitor = HealthMonitor(load_config(None, ["health.rank_outlier_steps=0"]).health, precision="fp32")
    assert [i for s in range(1, 20) for i in monitor.observe(event(s, [1.0, 40.0]))] == []


def _incident(verdict=None, suspects=(1,), ranks=2, rotate=0, kind=Kind.RANK_OUTLIER):
    evidence = {"suspects": list(suspects), "ranks": ranks, "homes": {str(r): [0, r + 4] for r in range(ranks)}}
    if verdict:
        evidence["triage"] = {"verdict": verdict, "suspects": list(suspects), **({"rotate": rotate} if rotate else {})}
    return Incident(kind=kind, first_step=203, last_step=205, evidence=evidence)


def decide(incident, cfg=CFG, **history):
    return policy.decide(incident, RunHistory(committed_steps=CKPTS, **history), cfg.health, cfg.train)


def test_a_reproduced_incident_that_points_at_some_ranks_is_rerun_again_with_the_shares_rotated():
    first = decide(_incident())
    assert isinstance(first, Rerun) and first.rotate == 0
    second = decide(_incident("deterministic"))
    assert isinstance(second, Rerun) and second.rotate == 1 and second.checkpoint_step == 200
    assert "rotated" in second.reason


@pytest.mark.parametrize("suspects,ranks", [((), 2), ((0, 1), 2), ((0,), 1)])
def test_nothing_to_rotate_decides_on_the_row_at_once(suspects, ranks):
    """No suspect, every rank a suspect, or one replica: a rotation could not tell, the row decides."""
    action = decide(_incident("deterministic", suspects, ranks))
    assert isinstance(action, Rollback) and action.skip is None and action.lr_overrides      # lr cut
    assert not action.exclude


def test_a_fault_that_stayed_with_its_rank_quarantines_its_device_and_rolls_back_uncut():
    action = decide(_incident("device", rotate=1))
    assert isinstance(action, Rollback) and action.exclude == (1,)
    assert action.checkpoint_step == 150 and action.skip is None and action.lr_overrides == ()
    assert action.exclude_for_s == CFG.health.quarantine_probation_s


def test_a_fault_that_followed_the_data_is_decided_on_its_row():
    action = decide(_incident("data", rotate=1, kind=Kind.LOSS_SPIKE),
                    sample_ranges={s: (8 * (s - 1), 8 * s) for s in range(1, 300)})
    assert isinstance(action, Rollback) and not action.exclude
    assert action.skip == (8 * 202, 8 * 205) and action.lr_overrides


def test_a_straggler_set_to_exclude_quarantines_its_device():
    cfg = load_config(None, ['health.straggler_action="exclude"'])
    straggler = Incident(kind=Kind.STRAGGLER, first_step=230, last_step=230, rank=3)
    action = decide(straggler, cfg)
    assert isinstance(action, Rollback) and action.exclude == (3,) and action.checkpoint_step == 250
    assert isinstance(decide(straggler), Restart)


def test_a_replica_mismatch_quarantines_the_odd_replica_when_it_can_be_told():
    odd = Incident(kind=Kind.REPLICA_MISMATCH, first_step=300, last_step=300,
                   evidence={"last_agreed_step": 200, "odd_ranks": [2], "tie": False})
    assert decide(odd).exclude == (2,)
    tie = dataclasses.replace(odd, evidence={**odd.evidence, "odd_ranks": [0, 1], "tie": True})
    assert decide(tie).exclude == ()


def _rotated(rerun_norms, suspects=(1,)):
    check = RerunCheck({"kind": "rank_outlier", "first_step": 10, "last_step": 12, "checkpoint_step": 5,
                        "rotate": 1, "suspects": list(suspects)}, rtol=0.0)
    verdicts = [check.observe(event(s, rerun_norms)) for s in (10, 11, 12)]
    return verdicts, check.evidence(3)


def test_the_rotated_rerun_says_device_when_the_same_rank_stands_out_and_data_when_another_does():
    verdicts, evidence = _rotated([1.0, 40.0])
    assert verdicts == [None, None, "device"] and evidence["rerun_suspects"] == [1]
    verdicts, evidence = _rotated([40.0, 1.0])
    assert verdicts[-1] == "data" and evidence["rerun_suspects"] == [0] and evidence["if_data"] == [0]
    assert _rotated([1.0, 1.0])[0][-1] == "data"                  # gone: cannot be told, the row decides


def test_the_watch_names_where_a_suspect_runs_and_what_a_rotation_needs():
    cfg = load_config(None, ["parallel.dp=2", "train.micro_batch=4"])
    w = Watch(cfg, generation=1, ranks=(0, 1), now=0.0, monitor=HealthMonitor(cfg.health, precision="fp32"),
              homes={"0": [0, 4], "1": [0, 6]})
    for s in range(1, 4):
        for r in (0, 1):
            w.on_event(event(s, [1.0, 40.0], rank=r), s * 0.1)
    incident = w.tick(1.0).incident
    assert incident.kind is Kind.RANK_OUTLIER
    assert incident.evidence["suspects"] == [1] and incident.evidence["ranks"] == 2
    assert incident.evidence["homes"] == {"1": [0, 6]}


def test_a_device_quarantined_by_a_decision_is_on_the_lemon_list_until_its_probation_ends(tmp_path):
    state = RunState()
    action = decide(_incident("device", rotate=1))
    state.apply_incident(IncidentRecord(incident=_incident("device", rotate=1), generation=3, unix_s=1000.0,
                                        action=action))
    entry = state.lemons["node 0 device 5"]
    assert entry["quarantined_until_unix_s"] == 1000.0 + CFG.health.quarantine_probation_s
    assert quarantine.excluded_devices(state.lemons, 0, 1001.0) == {5}
    assert quarantine.excluded_devices(state.lemons, 0, 1000.0 + CFG.health.quarantine_probation_s) == set()
    state.save(tmp_path)
    assert RunState.load(tmp_path).lemons == state.lemons            # a restarted daemon keeps it


def test_one_machine_trains_on_the_devices_left_with_the_same_global_batch():
    cfg = load_config(None, ["parallel.dp=4", "train.micro_batch=4", "train.global_batch=16"])
    assert quarantine.machine_devices(cfg, {}) == (0, 1, 2, 3)
    assert quarantine.machine_devices(cfg, {quarantine.VISIBLE: "4,5,6,7"}) == (4, 5, 6, 7)
    shaped, left = quarantine.without_devices(cfg, {}, (4, 5, 6, 7), {5})
    assert left == (4, 6) and shaped.run.devices == "4,6"          # 3 ranks cannot split 16 samples evenly
    assert (shaped.parallel.dp, shaped.train.micro_batch, shaped.train.grad_accum_steps) == (2, 4, 2)
    shaped, left = quarantine.without_devices(cfg, {}, (4, 5, 6, 7), {5, 6})
    assert left == (4, 7) and shaped.parallel.dp == 2
    assert "cannot train" in quarantine.without_devices(cfg, {}, (0, 1, 2, 3), {0, 1, 2, 3})


def test_run_devices_must_name_one_device_per_rank():
    with pytest.raises(ConfigError, match="run.devices"):
        load_config(None, ["parallel.dp=2", "train.micro_batch=4", 'run.devices="0,1,2"'])
    with pytest.raises(ConfigError, match="distinct device ids"):
        load_config(None, ["parallel.dp=2", "train.micro_batch=4", 'run.devices="1,1"'])
    assert load_config(None, ["parallel.dp=2", "train.micro_batch=4", 'run.devices="6,7"']).run.devices == "6,7"


def test_transient_faults_on_one_device_quarantine_it_at_the_threshold_and_a_rebuild_keeps_it(tmp_path):
    import io
    import json

    from daemon.records.eventlog import EventLog
    from daemon.records.ledger import Ledger
    from daemon.records.metrics import Metrics
    from daemon.records.notify import Notifier
    from daemon.records.state_rebuild import read_events, state_from_events

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    ledger = Ledger(run, EventLog(run / "logs" / "events.jsonl", "r", stream=io.StringIO()), Metrics("r"),
                    Notifier({}), total_steps=100)
    health = load_config(None, ["health.transient_faults_to_quarantine=2"]).health
    for step in (30, 60):
        ledger.triaged("transient", step, {"verdict": "transient", "first_step": step, "suspects": [1],
                                            "homes": {"1": [0, 5]}}, health)
    entry = ledger.state.lemons["node 0 device 5"]
    assert len(entry["faults"]) == 2 and entry["quarantines"] == 1
    assert quarantine.excluded_devices(ledger.state.lemons, 0, entry["faults"][-1]["unix_s"] + 1) == {5}
    [said] = [json.loads(l) for l in (run / "logs" / "events.jsonl").read_text().splitlines()
              if '"quarantined"' in l]
    assert said["device"] == 5 and "2 transient faults" in said["detail"]
    rebuilt, _ = state_from_events(read_events(run / "logs" / "events.jsonl"))
    assert rebuilt.lemons["node 0 device 5"]["quarantines"] == 1
    assert len(rebuilt.lemons["node 0 device 5"]["faults"]) == 2


def test_one_machine_regroups_when_a_quarantined_devices_probation_ends():
    from daemon.acting.peers import Alone

    alone = Alone({})
    alone.left_out = {1}
    alone.lemons = {"node 0 device 1": {"node": 0, "device": 1, "quarantined_until_unix_s": 4e9}}
    assert alone.hear(1, 0.0) is None                                   # still on probation
    alone.lemons["node 0 device 1"]["quarantined_until_unix_s"] = 1.0    # over
    assert alone.hear(1, 0.0) == watch.Regroup(None, (1,))
    assert alone.hear(1, 0.0) is None and alone.back == {1}
