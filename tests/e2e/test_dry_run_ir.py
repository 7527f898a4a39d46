"""Issue 47: MindSpore's own dry run of the semi-auto step (`plan --dry-run`'s rank compile), run here against
stand-in CANN libraries (tests/ascend/standins.py), and the partitioned graph it saves read by the strategy
lint (tests/e2e/strategy_lint.py): the loss's divisor inserted (gradient factor 1), each gradient reduced over
its slice's replicas, each parameter sliced as the layout's strategy says. Every shipped config and layout the
strategy lint covers (shrunk the same way), at MS_SIMULATION_LEVEL=0; one at level 1 (the backend and its
memory plan). The same check fails on the step as it was (value_and_grad with has_aux: no divisor, 8x)."""
import sys
import time

import pytest

from contracts.config import load_config
from engine.layout import dry_run, parallel
from engine.layout.memory_model import Layout
from tests.e2e import strategy_lint
from tests.e2e.test_strategy_lint import LAYOUTS, _semi_auto_configs

TIMEOUT_S = 300


def _whole_and_splits(cfg):
    """Each trainable parameter's full shape, and the splits the layout's strategies give the ones it names."""
    from engine.model.causal_lm import build_model

    net = build_model(cfg, parallel.decide(cfg))
    matmuls, tp = parallel.matmul_strategies(cfg), cfg.parallel.tp
    whole, splits = {}, {}
    for name, cell in net.cells_and_names():
        for p in cell.get_parameters(expand=False):
            whole[p.name] = tuple(p.shape)
            role = name.rsplit(".", 1)[-1]
            if name.endswith("embed_tokens"):
                splits[p.name] = (tp, 1)
            elif role in matmuls and p.name.endswith(".weight") and len(p.shape) == 2:
                splits[p.name] = matmuls[role][1]
            elif len(p.shape) == 1 and "norm" in p.name:
                splits[p.name] = (1,)
    return {n: s for n, s in whole.items() if n in {p.name for p in net.trainable_params()}}, splits


def _compile(env, monkeypatch, tmp_path, path, overrides, *, level="0", command=None, rank=0):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if command:
        real = dry_run.stage_command
        monkeypatch.setattr(dry_run, "stage_command",
                            lambda *a: [sys.executable, "-m", command, *real(*a)[3:]])
    cfg = load_config(path, overrides)
    layout = Layout.of(cfg)
    started = time.perf_counter()
    done = dry_run.simulate(str(path) if path else None, overrides, layout, rank, level, TIMEOUT_S,
                            ir_dir=tmp_path / "ir" if level == "0" else None)
    print(f"level {level} compile of rank {rank}: {time.perf_counter() - started:.1f} s")
    assert done.returncode == 0, dry_run.error_line(done)
    return cfg, done


def _read(cfg, tmp_path):
    p = cfg.parallel
    return strategy_lint.read_partitioned(strategy_lint.partitioned_ir(tmp_path / "ir"), p.dp * p.tp * p.pp)


def _trainable_semi_auto_configs():
    """The strategy lint's semi-auto configs that `train` runs (not a `plan`-only recipe), pp layouts included
    (engine.training.sharded_step.PipelineStep: MindSpore 2.10 refused the step as it was, "Using pipeline
    parallel with interleave, should enable lazy_inline")."""
    for param in _semi_auto_configs():
        cfg = load_config(*param.values)
        if cfg.parallel.plan_recipe == "project":
            yield param


@pytest.mark.parametrize("path,overrides", list(_trainable_semi_auto_configs()))
def test_the_partitioned_step_divides_the_loss_and_reduces_every_gradient_over_its_replicas(
        mindspore_cpu, ascend_standins, monkeypatch, tmp_path, path, overrides):
    p = load_config(path, overrides).parallel
    # under pp the last stage's first rank: the loss and its divisor are there (the earlier stages' gradients are
    # the backward of what it sends back, so its divisor is theirs too); rank 0 otherwise
    last = (p.pp - 1) * p.dp * p.tp
    cfg, _ = _compile(ascend_standins, monkeypatch, tmp_path, path, overrides, rank=last)
    part = _read(cfg, tmp_path)
    stage = p.dp * p.tp
    if stage > 1:
        assert part.divisors, "no loss divisor (_VirtualDiv)"
    assert part.gradient_factor(stage) == 1, part.divisors
    print(f"dp {p.dp} x tp {p.tp} x pp {p.pp}: loss divisors {part.divisors} on rank {last}, gradient factor 1")
    whole, splits = _whole_and_splits(cfg)
    if p.pp > 1:       # the rank holds its stage's parameters; the others' are left whole and never trained here
        stages = parallel.cell_stages(cfg)
        mine = {n for n in whole if any(n.startswith(c + ".") and s == p.pp - 1 for c, s in stages.items())}
        whole = {n: s for n, s in whole.items() if n in mine}
    assert strategy_lint.partition_problems(part, whole, splits, stage,
                                            p.dp if p.optimizer_shard else 1) == []
    # the global norm, the same on every rank by construction: one all-reduce over the world of the square sums,
    # each weighted by the elements this rank holds, and nothing of HandleGlobalNormScale's (issue 47)
    # (under pp this stage's gradients: the world all-reduce adds the stages)
    assert strategy_lint.norm_problems(part, p.dp * p.tp * p.pp, len(whole)) == []
    assert part.updates == len(whole), part.updates     # the step's tail on this rank: an update per parameter


def test_the_step_as_it_was_has_no_loss_divisor_and_sums_gradients_over_the_stage(
        mindspore_cpu, ascend_standins, monkeypatch, tmp_path):
    """Before issue 47's fix the loss was value_and_grad's auxiliary output: the pass found no loss, inserted no
    _VirtualDiv, and every gradient was the sum over the stage's devices (8x at dp 4 x tp 2); and the global norm
    was left to HandleGlobalNormScale's search."""
    seven_b = next(p for p in _semi_auto_configs() if p.id == "llama-7b")      # dp 4 x tp 2, shrunk
    cfg, _ = _compile(ascend_standins, monkeypatch, tmp_path, *seven_b.values, command="tests.ascend.old_step")
    part = _read(cfg, tmp_path)
    stage = cfg.parallel.dp * cfg.parallel.tp
    assert stage == 8 and part.divisors == [] and part.gradient_factor(stage) == 8
    found = strategy_lint.partition_problems(part, {}, {}, stage)
    assert found and found[0].startswith("no loss divisor (_VirtualDiv)") and "factor 8" in found[0]
    # and its norm was the compiler's: grad_scale-marked square sums, rescaled and all-reduced by
    # HandleGlobalNormScale after its depth-limited search, no all-reduce of the step's own
    norm = strategy_lint.norm_problems(part, stage, len(_whole_and_splits(cfg)[0]))
    assert any("HandleGlobalNormScale rescaled" in n for n in norm) and any("all-reduce over the world" in n
                                                                            for n in norm), norm


def test_a_stage_compiles_through_the_backend_and_reports_its_peak_memory(mindspore_cpu, ascend_standins,
                                                                         monkeypatch, tmp_path):
    """MS_SIMULATION_LEVEL=1: the kernel-by-kernel backend builds the step (no data-dependent branch left) and
    the memory pool reports its peak, which `plan --dry-run` prints beside the estimate."""
    _, done = _compile(ascend_standins, monkeypatch, tmp_path, None, LAYOUTS["tp"], level="1")
    peak = dry_run.peak_bytes(done.stdout + done.stderr)
    assert peak and peak > 0
    print(f"peak: {peak / 2 ** 20:.0f} MiB")
