"""The CPU's memory-lean forms of the model (explicit broadcasts, Softmax's own gradient, rotate-half
as a matmul) and its fused C++ kernels (engine/model/fused_cpu.py: RMSNorm, causal softmax, SwiGLU, RoPE)
compute what the plain forms compute: the same loss and the same gradients."""
import numpy as np
import pytest

from contracts.config import load_config
from engine.layout.parallel import decide
from tests.cxx import cxx

pytestmark = pytest.mark.e2e


def _loss_and_grads(cfg, explicit: bool, tokens: np.ndarray, fused: bool = False):
    import mindspore as ms
    from mindspore import Tensor

    from engine.model.causal_lm import CausalLM

    net = CausalLM(cfg.model, seed=cfg.train.seed, compute_dtype=cfg.train.precision,
                   recompute_layers=cfg.recompute_layers, explicit_broadcast=explicit, fused_kernels=fused)
    assert net.fused == fused
    params = net.trainable_params()
    fn = ms.jit(ms.value_and_grad(net, None, params))
    loss, grads = fn(Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:]))
    return float(loss.asnumpy()), {p.name: g.asnumpy() for p, g in zip(params, grads)}


@pytest.mark.parametrize("overrides", [
    [],
    ['model.arch="gpt2"', "model.num_kv_heads=4"],
    ["train.recompute=true"],
], ids=["llama", "gpt2", "llama-recompute"])
def test_explicit_broadcast_forms_give_the_plain_forms_loss_and_gradients(mindspore_cpu, overrides):
    cfg = load_config(None, overrides)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, cfg.model.vocab_size, size=(4, cfg.data.seq_len + 1), dtype=np.int32)
    plain_loss, plain = _loss_and_grads(cfg, False, tokens)
    lean_loss, lean = _loss_and_grads(cfg, True, tokens)
    assert lean_loss == pytest.approx(plain_loss, rel=1e-6)
    assert lean.keys() == plain.keys()
    for name, g in plain.items():
        np.testing.assert_allclose(lean[name], g, rtol=1e-4, atol=1e-7, err_msg=name)
    # not vacuous: every parameter has a gradient somewhere away from zero
    assert all(np.abs(g).max() > 0 for g in plain.values())


@pytest.mark.parametrize("overrides", [
    [],
    ["train.recompute=true"],
    ["model.num_kv_heads=4", "model.num_layers=3", "data.seq_len=48"],
], ids=["llama", "llama-recompute", "mha-3-layers"])
def test_fused_kernels_give_the_plain_forms_loss_and_gradients(mindspore_cpu, overrides):
    cxx()
    cfg = load_config(None, overrides)
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, cfg.model.vocab_size, size=(4, cfg.data.seq_len + 1), dtype=np.int32)
    plain_loss, plain = _loss_and_grads(cfg, False, tokens)
    fused_loss, fused = _loss_and_grads(cfg, True, tokens, fused=True)
    assert fused_loss == pytest.approx(plain_loss, rel=1e-6)
    for name, g in plain.items():
        np.testing.assert_allclose(fused[name], g, rtol=1e-4, atol=1e-6 * np.abs(g).max(), err_msg=name)
    assert all(np.abs(g).max() > 0 for g in plain.values())


def test_the_cpu_model_uses_the_fused_kernels_unless_told_not_to(mindspore_cpu):
    cxx()
    from engine.model.causal_lm import build_model

    fused, plain = load_config(None, []), load_config(None, ["train.fused_kernels=false"])
    assert build_model(fused, decide(fused)).fused
    assert not build_model(plain, decide(plain)).fused


def test_rotate_half_matrix_is_rotate_half(mindspore_cpu):
    from mindspore import Tensor

    from engine.model.causal_lm import rotate_half, rotate_half_matrix

    x = np.random.default_rng(3).normal(size=(2, 3, 5, 8)).astype(np.float32)
    by_matrix = x.reshape(-1, 8) @ rotate_half_matrix(8)
    expected = rotate_half(Tensor(x)).asnumpy().reshape(-1, 8)
    np.testing.assert_array_equal(by_matrix, expected)


def test_without_a_compiler_training_runs_mindspores_own_ops_and_says_so_once(cli, quiet_env, tmp_path):
    """And fused kernels are not part of the trajectory: a run saved with them resumes without them."""
    import json
    import subprocess

    cxx()
    sets = ["--set", "data.source=synthetic", "--set", "train.steps=6", "--set", "checkpoint.interval_steps=3",
            "--set", f'run.dir="{tmp_path / "run"}"']
    first = subprocess.run([*cli, "train", *sets, "--until-step", "3"], capture_output=True, text=True,
                           env=quiet_env, cwd=tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "fused CPU kernels unavailable" not in first.stderr
    env = dict(quiet_env, CXX="no-such-cxx")
    second = subprocess.run([*cli, "train", *sets], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    said = [line for line in second.stderr.splitlines() if "fused CPU kernels unavailable" in line]
    assert len(said) == 1 and "no-such-cxx" in said[0] and "train.fused_kernels = false" in said[0]
    steps = [json.loads(line) for line in second.stdout.splitlines() if line.startswith("{")]
    assert [e["step"] for e in steps if e.get("kind") == "step"] == [4, 5, 6]
