"""Resuming: train.steps may grow (the checkpoints' lr schedule is kept), any other trajectory change
is refused before anything starts, naming the keys."""
import json

import pytest

from checkpointing.writer import FORMAT, VERSION
from contracts.config import config_hash, load_config, trajectory_dict
from contracts.errors import ConfigError
from engine.rank.resume_check import check_resume
from engine.training.schedule import base_lr_at


def _checkpoint(root, cfg, step=200):
    d = root / f"step-{step:08d}"
    d.mkdir(parents=True)
    state = {"step": step, "config_hash": config_hash(cfg), "trajectory": trajectory_dict(cfg)}
    (d / "manifest.json").write_text(json.dumps({"format": FORMAT, "version": VERSION, "shards": [],
                                                 "run_state": state}))


def test_more_steps_keep_the_schedule_and_train_on_at_the_floor(tmp_path):
    first = load_config(None, ["train.steps=200"])
    _checkpoint(tmp_path, first)
    longer, note = check_resume(load_config(None, ["train.steps=400"]), tmp_path)
    assert longer.train.steps == 400 and longer.cosine_steps == first.cosine_steps
    assert config_hash(longer) == config_hash(first)
    assert "lr schedule of the checkpoints is kept" in note and "train at optim.min_lr" in note
    o = longer.optim
    lr = lambda cfg, s: base_lr_at(s, lr=o.lr, min_lr=o.min_lr, warmup_steps=o.warmup_steps,
                                   cosine_steps=cfg.cosine_steps)
    assert [lr(longer, s) for s in range(1, 201)] == [lr(first, s) for s in range(1, 201)]
    assert lr(longer, 201) == lr(longer, 400) == pytest.approx(o.min_lr)


def test_the_same_config_resumes_without_a_note_and_no_checkpoint_needs_nothing(tmp_path):
    cfg = load_config(None)
    assert check_resume(cfg, tmp_path / "none") == (cfg, None)
    _checkpoint(tmp_path, cfg)
    assert check_resume(cfg, tmp_path) == (cfg, None)


@pytest.mark.parametrize("change,key", [("optim.lr=0.01", "optim.lr"), ("data.seed=7", "data.seed"),
                                        ("optim.cosine_steps=500", "optim.cosine_steps")])
def test_a_trajectory_change_is_refused_naming_the_key(tmp_path, change, key):
    _checkpoint(tmp_path, load_config(None))
    with pytest.raises(ConfigError, match=rf"other trajectory-defining settings \({key}\)"):
        check_resume(load_config(None, [change]), tmp_path)
    check_resume(load_config(None, [change]), tmp_path, allow_config_change=True)


def test_a_checkpoint_that_does_not_look_complete_is_passed_over(tmp_path):
    _checkpoint(tmp_path, load_config(None, ["optim.lr=0.01"]), step=100)
    _checkpoint(tmp_path, load_config(None), step=200)
    (tmp_path / "step-00000200" / "manifest.json").write_text("{")     # the ranks will quarantine it
    with pytest.raises(ConfigError, match="step-00000100"):
        check_resume(load_config(None), tmp_path)
