"""`[script]` (a user's training script as the ranks) in the config, and what the daemon says of what it reports."""
import pytest

from contracts.config import config_hash, load_config
from contracts.errors import ConfigError
from contracts.protocol import PhaseEvent
from daemon.judging import script_reports, watch
from daemon.judging.health import HealthMonitor
from daemon.records.state_rebuild import state_from_events

pytestmark = pytest.mark.unit


def test_the_command_is_split_as_a_shell_would_and_the_engine_s_hash_is_unchanged():
    cfg = load_config(None, ["script.command=\"train.py --name 'my run' --lr 3e-4\""])
    assert cfg.script.argv == ["train.py", "--name", "my run", "--lr", "3e-4"]
    engine = load_config(None)
    assert engine.script.argv == []
    assert config_hash(engine) == "0e9d64f72bd22d72"      # the tiny default's hash before [script] existed
    assert config_hash(cfg) != config_hash(engine)
    other_env = load_config(None, ["script.command=\"train.py --name 'my run' --lr 3e-4\"", "script.python=/opt/py",
                                   "script.cwd=/srv"])
    assert config_hash(other_env) == config_hash(cfg)       # another interpreter or directory, the same trajectory


@pytest.mark.parametrize("overrides, named", [
    (["script.command=\"train.py 'unclosed\""], "cannot be split"),
    (["script.command=\"  \""], "holds no argument"),
    (["script.python=/opt/py"], "need script.command"),
])
def test_a_script_section_that_cannot_run_is_one_config_error(overrides, named):
    with pytest.raises(ConfigError, match=named):
        load_config(None, overrides)


def test_a_script_s_model_is_not_this_project_s_to_check():
    with pytest.raises(ConfigError, match="exceeds model.max_seq_len"):
        load_config(None, ["data.seq_len=4096"])
    assert load_config(None, ["data.seq_len=4096", "script.command=train.py"]).data.seq_len == 4096


def test_what_a_script_lacks_names_the_detectors_it_turns_off():
    said = script_reports.describe(["loss", "lr", "something-new"])
    assert said["reports"] == ["loss", "lr"]
    assert said["missing"] == ["grad_norm", "loss_scale", "data_position", "skip_data"]
    assert "grad-norm spike" in said["off"]["grad_norm"] and said["detail"].startswith("the script reports no grad_norm")
    assert script_reports.describe(list(script_reports.WITHOUT)) == {
        "reports": list(script_reports.WITHOUT), "missing": [], "off": {}, "detail": ""}


def test_the_watch_passes_on_what_the_watched_rank_reports_and_the_engine_s_ranks_say_nothing():
    cfg = load_config(None, ["parallel.dp=2", "train.micro_batch=4"])
    w = watch.Watch(cfg, generation=1, ranks=(0, 1), now=0.0, log_paths={0: "r0", 1: "r1"},
                    monitor=HealthMonitor(cfg.health, precision="fp32"))
    w.on_event(PhaseEvent(rank=0, generation=1, phase="compile"), 1.0)        # the engine: reports None
    w.on_event(PhaseEvent(rank=1, generation=1, phase="compile", reports=["loss"]), 1.0)   # not the watched rank
    w.on_event(PhaseEvent(rank=0, generation=1, phase="compile", reports=["loss", "lr"]), 1.0)
    assert [e for e in w.drain() if isinstance(e, watch.ScriptReports)] == [watch.ScriptReports(("loss", "lr"))]


def test_a_state_rebuilt_from_the_events_keeps_the_last_thing_the_script_said():
    events = [{"event": "script_reports", "reports": ["loss"], "ts": "2026-12-06T07:00:00.000Z"},
              {"event": "script_reports", "reports": ["loss", "grad_norm"], "ts": "2026-12-06T07:01:00.000Z"}]
    state, _ = state_from_events(events)
    assert state.script_reports == script_reports.describe(["loss", "grad_norm"])


def test_a_script_that_cannot_skip_data_is_rolled_back_with_the_lr_cut_and_no_skip_claimed():
    from daemon.judging import policy
    from daemon.judging.incidents import Incident, Kind, Restart, Rollback

    cfg = load_config(None)
    spike = Incident(kind=Kind.LOSS_SPIKE, first_step=203, last_step=205,
                     evidence={"triage": {"verdict": "deterministic"}})
    ranges = {s: (8 * (s - 1), 8 * s) for s in range(1, 400)}
    can = policy.decide(spike, policy.RunHistory(committed_steps=(100, 150), sample_ranges=ranges, script=True),
                        cfg.health, cfg.train)
    cannot = policy.decide(spike, policy.RunHistory(committed_steps=(100, 150), sample_ranges=ranges, script=True,
                                                    can_skip=False), cfg.health, cfg.train)
    assert isinstance(can, Rollback) and can.skip == (8 * 202, 8 * 205)
    assert isinstance(cannot, Rollback) and cannot.skip is None and cannot.lr_overrides == can.lr_overrides
    assert "cannot skip data" in cannot.reason
    oom = policy.decide(Incident(kind=Kind.OOM, first_step=10, last_step=10), policy.RunHistory(script=True),
                        cfg.health, cfg.train)
    assert isinstance(oom, Restart) and not oom.config_changes      # the script's batch is not the daemon's
