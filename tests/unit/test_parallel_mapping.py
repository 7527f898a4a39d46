import pytest

from engine.config import load_config
from engine.parallel import layer_stages, matmul_strategies, parallel_context

ASCEND = ['train.device="ascend"', 'train.precision="bf16"']


@pytest.mark.parametrize("layers,pp,expected", [
    (4, 1, [0, 0, 0, 0]), (4, 2, [0, 0, 1, 1]), (5, 2, [0, 0, 0, 1, 1]), (40, 4, [0] * 10 + [1] * 10 + [2] * 10 + [3] * 10),
])
def test_layers_fill_stages_in_contiguous_balanced_blocks(layers, pp, expected):
    assert layer_stages(layers, pp) == expected


def test_cpu_is_plain_data_parallel():
    ctx = parallel_context(load_config(None, ["parallel.dp=2", "train.micro_batch=4"]))
    assert ctx == {"parallel_mode": "data_parallel", "gradients_mean": True, "device_num": 2}


def test_ascend_tp_pp_is_semi_auto_with_stages_and_sharded_optimizer():
    cfg = load_config(None, ASCEND + ["parallel.dp=1", "parallel.tp=2", "parallel.pp=2",
                                      "parallel.pipeline_microbatches=2", "parallel.optimizer_shard=true"])
    ctx = parallel_context(cfg)
    assert ctx["parallel_mode"] == "semi_auto_parallel"
    assert (ctx["device_num"], ctx["pipeline_stages"], ctx["enable_parallel_optimizer"]) == (4, 2, True)


def test_megatron_column_and_row_strategies():
    cfg = load_config(None, ASCEND + ["parallel.dp=2", "parallel.tp=2", "train.micro_batch=4"])
    s = matmul_strategies(cfg)
    assert s["q_proj"] == ((2, 1), (2, 1))      # weight rows (output features) split across tp
    assert s["down_proj"] == ((2, 2), (1, 2))   # input features split, partial sums all-reduced
