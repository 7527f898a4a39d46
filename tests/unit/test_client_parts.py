"""llm_pretrain_client's pure parts (docs/bring-your-own-script.md): which samples a step trains on with skip
ranges, each rank's share, the spike drill's bad data; what the client says it reports; a script run outside the
daemon; and the import rule that lets it install alone into a script's environment."""
import ast
import sys
from pathlib import Path

import numpy as np
import pytest

from llm_pretrain_client import Client, data_plan

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_skip_ranges_are_stepped_over_and_later_samples_keep_their_order():
    skips = data_plan.merged([(40, 48), (16, 24), (20, 30)])
    assert skips == [(16, 30), (40, 48)]
    indices = [data_plan.index_of(p, skips) for p in range(0, 30)]
    assert indices == [*range(0, 16), *range(30, 40), *range(48, 52)]
    assert data_plan.step_range(3, 8, skips) == (30, 38)          # positions 16..23 -> 30..37
    assert data_plan.step_range(4, 8, skips) == (38, 54)          # 24..31 -> 38, 39, then 48..53: the range spans it
    assert data_plan.step_range(1, 8, []) == (0, 8)


def test_each_rank_takes_its_contiguous_share_of_a_step():
    assert list(data_plan.rank_positions(2, 8, 0, 2)) == [8, 9, 10, 11]
    assert list(data_plan.rank_positions(2, 8, 1, 2)) == [12, 13, 14, 15]


class _Samples:
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return np.full(4, i % 50, np.int32), np.float32(i)


def test_the_supervised_source_resumes_skips_and_reads_the_drills_bad_data_by_index():
    corrupt_steps = {4}
    source = data_plan.SupervisedSource(_Samples(), step_of=lambda: 2, global_batch=4, rank=1, world=2, steps=5,
                                        skips=lambda: [(12, 16)], corrupt=lambda s: s in corrupt_steps,
                                        vocab_size=50)
    assert len(source) == 3 * 2                                   # steps 3, 4, 5; two samples each on rank 1
    step3 = [source[0], source[1]]                                # positions 10, 11: before the skip
    assert [float(s[1]) for s in step3] == [10.0, 11.0]
    step5 = [source[4], source[5]]                                # positions 18, 19 -> indices 22, 23
    assert [float(s[1]) for s in step5] == [22.0, 23.0]
    bad, again = source[2], source[2]                             # step 4: bad token ids, the same when reread
    assert float(bad[1]) == 18.0 and not np.array_equal(bad[0], np.full(4, 18, np.int32))
    assert np.array_equal(bad[0], again[0]) and bad[0].dtype == np.int32 and bad[0].max() < 50
    with pytest.raises(IndexError):
        source[6]


def test_a_script_run_outside_the_daemon_trains_its_steps_and_touches_nothing(tmp_path):
    client = Client(steps=3, env={})
    assert not client.supervised and client.restore([]) == 0
    steps = []
    while client.training:
        plan = client.begin_step()
        steps.append(plan.step)
        assert plan.poison == 1.0 and not plan.corrupt
        if not client.end_step(1.0):
            break
    client.finish()
    assert steps == [1, 2, 3] and not any(tmp_path.iterdir())


def test_what_a_client_says_it_reports_follows_what_the_script_gave_it():
    client = Client(steps=3, env={})
    assert client.reports == ["loss"]
    client.source(_Samples())
    assert client.reports == ["loss", "data_position", "skip_data"]
    assert Client(steps=1, grad_norm=True, loss_scale=True, env={}).reports == ["loss", "grad_norm", "loss_scale"]


def test_a_supervised_client_reads_the_run_it_was_handed(tmp_path):
    from contracts.config import load_config, to_toml

    cfg = load_config(None, [f'run.dir="{tmp_path}"', "train.steps=7", "train.global_batch=8",
                             "script.command='train.py'"])
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    client = Client(env={"LLM_PRETRAIN_CONFIG": str(tmp_path / "config.toml"), "LLM_PRETRAIN_GENERATION": "3"})
    assert client.supervised and client.total_steps == 7 and client.global_batch == 8 and client.generation == 3
    with pytest.raises(RuntimeError, match="restore"):            # a supervised script must resume first
        client.begin_step()


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "llm_pretrain_client").glob("*.py")), ids=lambda p: p.name)
def test_the_client_imports_mindspore_numpy_and_the_shared_packages_only(path):
    """Never the daemon or the engine: client/pyproject.toml installs it with contracts, checkpointing and
    durable alone, into a script's environment that has none of the daemon's dependencies."""
    allowed = {"__future__", "mindspore", "numpy", "contracts", "checkpointing", "durable", "llm_pretrain_client"}
    if path.name == "mindformers.py":           # the MindFormers callback: imported inside its functions only
        allowed.add("mindformers")
        top = {n.split(".")[0] for n in _top_level_imports(path)}
        assert "mindformers" not in top, "import mindformers inside functions: the client installs without it"
    assert all(n in sys.stdlib_module_names or n in allowed for n in _imports(path)), _imports(path)


def test_the_packages_the_client_ships_with_import_nothing_beyond_them():
    """What client/pyproject.toml installs must be whole: the shared packages' own imports stay inside it."""
    shipped = {"contracts", "checkpointing", "durable"}
    third_party = {"numpy", "safetensors", "crc32c"}            # client/pyproject.toml's dependencies
    for package in shipped:
        for path in (ROOT / package).glob("*.py"):
            outside = {n for n in _imports(path) if n not in sys.stdlib_module_names and n != "__future__"}
            assert outside <= shipped | third_party, (path, outside)
    text = (ROOT / "client" / "pyproject.toml").read_text()
    assert all(f'"{d}"' in text for d in third_party) and all(f'"{p}"' in text for p in shipped)


def test_the_mindformers_module_imports_without_mindspore_or_mindformers_and_reads_their_step_outputs():
    """llm_pretrain_client.mindformers (docs/bring-your-own-script.md#mindformers): its pure parts load where neither
    is installed; MFTrainOneStepCell's outputs by name, its global norm left out when it does not clip (None)."""
    from llm_pretrain_client import mindformers as mf

    assert mf.mindformers_fields(1.5) == {"loss": 1.5}
    assert mf.mindformers_fields((1.5, False, 1024.0, 3e-3, None)) == {"loss": 1.5, "overflow": False,
                                                                       "loss_scale": 1024.0, "lr": 3e-3}
    assert mf.mindformers_fields((1.5, False, 1.0, 3e-3, 0.7, "local", "size"))["grad_norm"] == 0.7
    assert mf.mindformers_fields((1.5, True, 8.0)) == {"loss": 1.5, "overflow": True, "loss_scale": 8.0}
    assert mf.mindformers_fields((1.5, 0.2), ("loss", "grad_norm")) == {"loss": 1.5, "grad_norm": 0.2}


def test_prepare_sets_mindformers_data_skip_to_the_step_the_client_resumes_after(tmp_path):
    from contracts.config import load_config, to_toml
    from llm_pretrain_client import mindformers as mf

    config = {"resume_training": True, "load_checkpoint": "/old/ckpt", "ignore_data_skip": True,
              "callbacks": [{"type": "MFLossMonitor"}]}
    assert mf.prepare(config, env={}) == 0                    # outside the daemon: from the start, MindFormers' own
    assert config["data_skip_steps"] == 0 and not config["resume_training"] and not config["ignore_data_skip"]
    assert config["load_checkpoint"] == "/old/ckpt"           # resume off; pretrained weights kept on a first start
    assert config["checkpoint"] == {"load_path": "", "no_load_optim": True}
    assert config["callbacks"] == [{"type": "MFLossMonitor"}, {"type": "LlmPretrainSupervisor", "data_skip_steps": 0}]

    cfg = load_config(None, [f'run.dir="{tmp_path}"', "train.steps=7", "script.command='train.py'"])
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    env = {"LLM_PRETRAIN_CONFIG": str(tmp_path / "config.toml")}
    assert mf.resume_step(env) == 0                           # supervised, before the first checkpoint
    config = {"callbacks": [{"type": "LlmPretrainSupervisor", "seq_len": 16}]}
    assert mf.prepare(config, env=env) == 0 and config["callbacks"] == [{"type": "LlmPretrainSupervisor",
                                                                          "seq_len": 16, "data_skip_steps": 0}]
    from checkpointing.writer import ShardWriter                # a checkpoint of the client's format at step 6
    from llm_pretrain_client.store import FORMAT

    writer = ShardWriter(tmp_path / "checkpoints", rank=0, world=1)
    writer.save(6, {"w": np.ones(3, np.float32)}, run_state={"format": FORMAT, "step": 6, "dp_world_size": 1},
                versions={})
    assert writer.wait() and writer.last_error is None
    assert mf.resume_step(env) == 6 and mf.prepare(config, env=env) == 6
    assert config["data_skip_steps"] == 6 and config["callbacks"][0]["data_skip_steps"] == 6
    config = {"load_checkpoint": "/pretrained", "checkpoint": {"load_path": "/mf/ckpt", "no_load_optim": False}}
    assert mf.prepare(config, env=env) == 6                   # a resume: MindFormers loads nothing, the client does
    assert config["load_checkpoint"] == "" and config["checkpoint"] == {"load_path": "", "no_load_optim": True}
