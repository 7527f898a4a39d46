"""The CPU's memory-lean forms of the model (explicit broadcasts, Softmax's own gradient, rotate-half
as a matmul) compute what the plain forms compute: the same loss and the same gradients."""
import numpy as np
import pytest

from engine.config import load_config

pytestmark = pytest.mark.e2e


def _loss_and_grads(cfg, explicit: bool, tokens: np.ndarray):
    import mindspore as ms
    from mindspore import Tensor

    from engine.model import CausalLM

    net = CausalLM(cfg.model, seed=cfg.train.seed, compute_dtype=cfg.train.precision,
                   recompute_layers=cfg.recompute_layers, explicit_broadcast=explicit)
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


def test_rotate_half_matrix_is_rotate_half(mindspore_cpu):
    from mindspore import Tensor

    from engine.model import rotate_half, rotate_half_matrix

    x = np.random.default_rng(3).normal(size=(2, 3, 5, 8)).astype(np.float32)
    by_matrix = x.reshape(-1, 8) @ rotate_half_matrix(8)
    expected = rotate_half(Tensor(x)).asnumpy().reshape(-1, 8)
    np.testing.assert_array_equal(by_matrix, expected)
