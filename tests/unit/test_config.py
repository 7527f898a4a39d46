import dataclasses
from pathlib import Path

import pytest

from contracts.config import Config, config_from_dict, config_hash, load_config, parse_override
from contracts.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_the_shipped_tiny_config():
    assert load_config(ROOT / "configs" / "tiny.toml") == Config()


@pytest.mark.parametrize("name", ["tiny", "small-20m", "llama-7b", "llama-13b"])
def test_shipped_configs_are_valid(name):
    cfg = load_config(ROOT / "configs" / f"{name}.toml")
    assert cfg.run.name == name


def test_ascend_presets_use_bf16_recompute_and_model_parallelism():
    for name in ("llama-7b", "llama-13b"):
        cfg = load_config(ROOT / "configs" / f"{name}.toml")
        assert (cfg.train.device, cfg.train.precision, cfg.train.recompute) == ("ascend", "bf16", True)
        assert cfg.parallel.tp > 1
    assert load_config(ROOT / "configs" / "llama-13b.toml").parallel.pp == 2


BAD = [
    # (overrides, words the one-line message must contain)
    (['train.steps="ten"'], ["train.steps", "integer"]),
    (["train.steps=0"], ["train.steps", ">= 1"]),
    (["model.foo=1"], ["unknown key model.foo", "hidden_size"]),
    (["bogus.key=1"], ["unknown section [bogus]"]),
    (['train.precision="bf16"'], ['train.precision = "bf16"', 'train.device = "ascend"', '"fp32" or "fp16"']),
    (["parallel.tp=2"], ["parallel.tp", "ascend", "data parallel"]),
    (["parallel.pp=2"], ["parallel.pp", "ascend"]),
    (['checkpoint.checksum="md5"'], ["checkpoint.checksum", "'md5'", "'crc32c', 'sha256'"]),
    (["parallel.optimizer_shard=true"], ["parallel.optimizer_shard", "ascend"]),
    (["train.global_batch=12"], ["train.global_batch = 12", "micro_batch (8)", "= 8"]),
    (["parallel.dp=2"], ["train.global_batch = 8", "parallel.dp (2)", "= 16"]),
    (['train.device="gpu"'], ["train.device", "'cpu'", "'ascend'"]),
    (["model.num_heads=3"], ["model.hidden_size = 64", "divisible by model.num_heads = 3"]),
    (["model.num_kv_heads=3"], ["model.num_kv_heads = 3", "divide"]),
    (["data.seq_len=1024"], ["data.seq_len = 1024", "model.max_seq_len = 256"]),
    (["optim.lr=-1.0"], ["optim.lr", "range"]),
    (["optim.min_lr=1.0"], ["optim.min_lr", "range"]),
    (["train.recompute=1"], ["train.recompute", "boolean"]),
    (['model.arch="mamba"'], ["model.arch", "'llama'", "'gpt2'"]),
    (['run.name="../etc"'], ["run.name", "letters"]),
    (["optim.lr=nan"], ["optim.lr", "finite"]),
    (["train=3"], ["malformed", "section.key=value"]),
    (["train.recompute_num_layers=3"], ["train.recompute_num_layers = 3", "model.num_layers = 2"]),
    (["health.loss_collapse_min_rel=0.0"], ["health.loss_collapse_min_rel = 0.0", "(0.0, 1.0]"]),
    (["health.loss_collapse_min_rel=1.5"], ["health.loss_collapse_min_rel = 1.5", "(0.0, 1.0]"]),
    (["run.nodes=2", "run.master_port=29500"], ["run.nodes = 2", "run.coordinator", "etcd://HOST:PORT"]),
    (['run.coordinator="http://10.0.0.1:2379"'], ["run.coordinator", "etcd://HOST:PORT"]),
    (['run.coordinator="etcd://10.0.0.1"'], ["run.coordinator", "'10.0.0.1'", "HOST:PORT"]),
    (['run.coordinator="etcd://a:2379,b:x"'], ["run.coordinator", "'b:x'"]),
    (["run.nodes=2", "run.min_nodes=3"], ["run.min_nodes = 3", "range"]),
    (['run.coordinator_prefix="runs/x"'], ["run.coordinator_prefix", "start with '/'"]),
    (["run.node_lease_ttl_s=1"], ["run.node_lease_ttl_s", "range"]),
    (["run.nodes=2", "run.master_port=1", 'run.coordinator="embedded"', 'run.coordinator_members="a,b,c"'],
     ["embedded", "run.nodes >= 3", "no embedded etcd quorum survives"]),
    (["run.nodes=3", "parallel.dp=3", "run.master_port=1", "train.global_batch=24", 'run.coordinator="embedded"',
      'run.coordinator_members="a,b"'],
     ["run.coordinator_members = 'a,b'", "first 3 (or 5)", "node i runs etcd member i"]),
    (["run.nodes=3", "parallel.dp=3", "run.master_port=1", "train.global_batch=24", 'run.coordinator="embedded"',
      'run.coordinator_members="a,b:1,c"'], ["run.coordinator_members", "'b:1' must be HOST or HOST:CLIENT_PORT:PEER_PORT"]),
    (['run.node_addr="a b"'], ["run.node_addr", "host name or address"]),
]


def test_a_multi_node_run_names_its_coordinator_and_keys():
    cfg = load_config(None, ["run.nodes=3", "run.node_rank=1", "run.master_port=29500", "parallel.dp=3",
                             "train.global_batch=24", 'run.coordinator="etcd://10.0.0.1:2379,10.0.0.2:2379"'])
    from contracts.config import coordinator_endpoints

    assert coordinator_endpoints(cfg.run.coordinator) == [("10.0.0.1", 2379), ("10.0.0.2", 2379)]
    assert cfg.run.key_prefix == "/llm-pretrain/tiny/" and cfg.run.quorum == 3
    assert load_config(None, ['run.coordinator_prefix="/team/a"', "run.nodes=1"]).run.key_prefix == "/team/a/"


def test_an_embedded_etcd_is_reached_at_its_members_clients():
    from contracts.config import run_endpoints

    cfg = load_config(None, ["run.nodes=4", "parallel.dp=4", "run.master_port=29500", "train.global_batch=32",
                             'run.coordinator="embedded"', 'run.coordinator_members="10.0.0.1,10.0.0.2,h3:2479:2480"'])
    assert run_endpoints(cfg.run) == [("10.0.0.1", 2379), ("10.0.0.2", 2379), ("h3", 2479)]


@pytest.mark.parametrize("overrides,layers", [
    ([], 0), (["train.recompute=true"], 2), (["train.recompute=true", "train.recompute_num_layers=1"], 1),
    (["train.recompute_num_layers=1"], 0),
])
def test_recompute_layers(overrides, layers):
    assert load_config(None, overrides).recompute_layers == layers


@pytest.mark.parametrize("overrides,words", BAD, ids=[b[0][0] for b in BAD])
def test_bad_config_names_key_and_allowed_values(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_ascend_accepts_what_cpu_refuses():
    cfg = load_config(None, ['train.device="ascend"', 'train.precision="bf16"', "parallel.tp=2",
                             "parallel.dp=1", "parallel.sp=true", "train.micro_batch=1",
                             "train.grad_accum_steps=8"])
    assert cfg.parallel.world_size == 2


def test_tp_must_divide_heads():
    with pytest.raises(ConfigError, match="model.num_kv_heads = 2 must be divisible by parallel.tp = 4"):
        load_config(None, ['train.device="ascend"', "parallel.tp=4"])


def test_pipeline_needs_enough_microbatches():
    with pytest.raises(ConfigError, match="pipeline_microbatches = 1 must be >= parallel.pp = 2"):
        load_config(None, ['train.device="ascend"', "parallel.pp=2"])


@pytest.mark.parametrize("text,expected", [
    ("train.steps=50", ("train", "steps", 50)),
    ("optim.lr=1e-4", ("optim", "lr", 1e-4)),
    ("train.device=ascend", ("train", "device", "ascend")),          # bare strings need no quotes
    ('run.name="a b"', ("run", "name", "a b")),
    ("train.recompute=true", ("train", "recompute", True)),
])
def test_override_values_are_read_as_toml(text, expected):
    assert parse_override(text) == expected


def test_int_is_accepted_where_a_number_is_expected():
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_file_then_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[train]\nsteps = 7\n[optim]\nlr = 0.01\n")
    cfg = load_config(f, ["train.steps=9"])
    assert (cfg.train.steps, cfg.optim.lr, cfg.model) == (9, 0.01, Config().model)


@pytest.mark.parametrize("override,changes", [
    ("train.micro_batch=4", False), ("train.grad_accum_steps=2", False), ("train.recompute=true", False),
    ("run.name=other", False), ("checkpoint.interval_steps=7", False), ('checkpoint.checksum="sha256"', False), ("train.log_interval_steps=5", False),
    ("model.hidden_size=128", True), ("optim.lr=1e-3", True), ("data.seed=1", True), ("train.seed=9", True),
    ("model.vocab_size=1024", True), ("data.seq_len=32", True),
])
def test_config_hash_covers_exactly_the_trajectory(override, changes):
    base = load_config(None)
    extra = [override]
    if override == "train.micro_batch=4":
        extra.append("train.grad_accum_steps=2")
    if override == "train.grad_accum_steps=2":
        extra.append("train.micro_batch=4")
    assert (config_hash(load_config(None, extra)) != config_hash(base)) is changes


def test_config_round_trips_through_dict():
    cfg = load_config(None, ["model.tie_embeddings=true"])
    assert config_from_dict(cfg.to_dict()) == cfg


def test_run_paths_follow_systemd_directories():
    run = Config().run
    assert str(run.resolved_dir({})) == "runs/tiny"
    assert str(run.resolved_log_dir({})) == "runs/tiny/logs"
    env = {"STATE_DIRECTORY": "/var/lib/llm-pretrain", "LOGS_DIRECTORY": "/var/log/llm-pretrain"}
    assert str(run.resolved_dir(env)) == "/var/lib/llm-pretrain/tiny"
    assert str(run.resolved_log_dir(env)) == "/var/log/llm-pretrain/tiny"


def test_every_field_is_documented_where_declared():
    source = (ROOT / "contracts" / "config.py").read_text()
    for section in dataclasses.fields(Config):
        for field in dataclasses.fields(section.default):
            line = next(l for l in source.splitlines() if l.strip().startswith(f"{field.name}:"))
            assert "#" in line, f"{section.name}.{field.name} is undocumented"


def test_an_elastic_shape_keeps_the_global_batch_growing_accumulation_and_shrinking_the_micro_batch_if_needed():
    from contracts.elastic import shape_on

    assert shape_on(3, ranks_per_node=1, model_parallel=1, global_batch=12, micro_batch=4).grad_accum_steps == 1
    two = shape_on(2, ranks_per_node=1, model_parallel=1, global_batch=12, micro_batch=4)
    assert (two.dp, two.micro_batch, two.grad_accum_steps) == (2, 3, 2)
    four = shape_on(2, ranks_per_node=8, model_parallel=4, global_batch=64, micro_batch=2)   # tp x pp in a node
    assert (four.dp, four.micro_batch, four.grad_accum_steps) == (4, 2, 8)
    assert shape_on(1, ranks_per_node=2, model_parallel=4, global_batch=8, micro_batch=1) is None   # half a replica
    assert shape_on(2, ranks_per_node=1, model_parallel=1, global_batch=9, micro_batch=3) is None


def test_min_nodes_below_nodes_is_refused_up_front_when_a_smaller_cluster_cannot_keep_the_global_batch():
    multi = ["run.nodes=3", 'run.coordinator="etcd://h:2379"', "run.master_port=29500", "parallel.dp=3"]
    assert load_config(None, [*multi, "train.global_batch=12", "train.micro_batch=4", "run.min_nodes=2"]).run.quorum == 2
    with pytest.raises(ConfigError) as e:
        load_config(None, [*multi, "train.global_batch=9", "train.micro_batch=3", "run.min_nodes=2"])
    assert "run.min_nodes = 2" in str(e.value) and "2 of run.nodes = 3" in str(e.value)
    load_config(None, [*multi, "train.global_batch=9", "train.micro_batch=3"])     # no shrinking: no constraint


@pytest.mark.parametrize("sets,name", [
    ([], "tiny"),
    (['run.dir="/data/exp-7"'], "exp-7"),
    (['run.dir="/data/exp 7/"'], "exp-7"),
    (['run.dir="/data/.hidden"'], "hidden"),
    (['run.dir="/data/exp-7"', 'run.name="mine"'], "mine"),
])
def test_a_run_given_a_directory_and_no_name_is_named_after_the_directory(sets, name):
    """Its metrics and events are labelled with it: not "tiny" whatever the directory."""
    assert load_config(None, sets).run.name == name
    assert load_config(ROOT / "configs" / "tiny.toml", sets).run.name == name


def test_a_derived_name_is_written_out_and_read_back_unchanged(tmp_path):
    from contracts.config import to_toml

    cfg = load_config(None, ['run.dir="/data/exp-7"'])
    (tmp_path / "resolved.toml").write_text(to_toml(cfg, []))
    again = load_config(tmp_path / "resolved.toml", ['run.dir="/elsewhere/copy"'])
    assert again.run.name == "exp-7"                   # a resolved config names it: the name stays


def test_a_run_of_several_machines_keeps_the_name_it_is_given_whatever_each_ones_directory():
    multi = ["run.nodes=2", "parallel.dp=2", "train.micro_batch=4", "run.master_port=29500", 'run.coordinator="etcd://h:2379"']
    assert load_config(None, [*multi, 'run.dir="/data/exp-7"']).run.name == "tiny"


@pytest.mark.parametrize("overrides,rows", [
    (["train.micro_batch=2", "train.grad_accum_steps=4"], 2),
    (["parallel.pp=2", "parallel.pipeline_microbatches=2", "train.micro_batch=4", "train.grad_accum_steps=2"], 2),
])
def test_sequence_parallel_is_refused_with_more_than_one_sequence_per_micro_step(overrides, rows):
    """Under sp the row-parallel outputs are split over dp x tp blocks of the flattened tokens: the residual's
    (dp, tp) split only with one sequence per dp rank in a micro-step; otherwise every layer redistributes."""
    base = ['train.device="ascend"', 'train.precision="bf16"', "parallel.tp=2", "parallel.dp=1", "parallel.sp=true",
            "train.global_batch=8"]
    with pytest.raises(ConfigError) as e:
        load_config(None, base + overrides)
    assert f"this layout has {rows}" in str(e.value) and "train.grad_accum_steps" in str(e.value)
    assert "\n" not in str(e.value)
    fixed = [o for o in overrides if "micro_batch=" not in o and "grad_accum" not in o]
    per_micro = 2 if "parallel.pp=2" in overrides else 1
    load_config(None, base + fixed + [f"train.micro_batch={per_micro}", f"train.grad_accum_steps={8 // per_micro}"])


def test_the_checksums_a_config_allows_are_those_the_checkpoint_writer_knows():
    from checkpointing import checksums
    from contracts.config import CHECKPOINT_CHECKSUMS

    assert set(CHECKPOINT_CHECKSUMS) == set(checksums.ALGORITHMS)
