"""The fused CPU kernels (engine/fused_cpu.cc), called as MindSpore calls them, through ctypes: built by
the real compiler, checked against numpy in float64, forward and backward; the same bits on any thread
count; a NaN reaches the output; the build is cached by content and fails in one clear line."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from engine import fused_cpu
from tests.cxx import cxx


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return ctypes.CDLL(str(fused_cpu.build(tmp_path_factory.mktemp("kernels"), compiler=cxx())))


def call(lib, name: str, inputs: list[np.ndarray], out_shapes: list[tuple[int, ...]], threads: int = 1):
    """Runs kernel `name` with MindSpore's aot calling convention; returns its outputs."""
    lib.LlmPretrainSetThreads(threads)
    outs = [np.full(shape, np.nan, np.float32) for shape in out_shapes]
    arrays = [np.ascontiguousarray(a, np.float32) for a in inputs] + outs
    n = len(arrays)
    dims = [(ctypes.c_int64 * max(1, a.ndim))(*a.shape) for a in arrays]
    params = (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * n)(*[a.ndim for a in arrays])
    shapes = (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(d, ctypes.POINTER(ctypes.c_int64)) for d in dims])
    dtypes = (ctypes.c_char_p * n)(*([b"float32"] * n))
    rc = getattr(lib, name)(n, params, ndims, shapes, dtypes, None, None)
    if rc != 0:
        raise RuntimeError(f"{name} returned {rc}")
    return outs


def rng(seed=0):
    return np.random.default_rng(seed)


def close(actual, expected, rtol=2e-5, atol=1e-6):
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def test_rms_norm_forward_and_backward_match_numpy(lib):
    x = rng(1).normal(size=(3, 5, 40)).astype(np.float32)
    w = rng(2).normal(1.0, 0.2, size=40).astype(np.float32)
    dy = rng(3).normal(size=x.shape).astype(np.float32)
    eps = 1e-5
    y, r = call(lib, "RmsNormFwd", [x, w, np.array([eps])], [x.shape, x.shape[:-1]])
    x64, w64, dy64 = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    r64 = 1.0 / np.sqrt((x64 ** 2).mean(-1) + eps)
    close(r, r64)
    close(y, x64 * r64[..., None] * w64)
    dx, dw = call(lib, "RmsNormBwd", [dy, x, w, r], [x.shape, w.shape])
    g = dy64 * w64
    dx64 = r64[..., None] * g - x64 * (r64 ** 3)[..., None] * (g * x64).mean(-1, keepdims=True)
    close(dx, dx64)
    close(dw, (dy64 * x64 * r64[..., None]).sum((0, 1)), rtol=1e-4)


def test_rms_norm_gradient_is_the_forwards_derivative(lib):
    """Against central differences of the forward itself, in a direction: not just the formula twice."""
    x = rng(4).normal(size=(4, 16)).astype(np.float32)
    w = rng(5).normal(1.0, 0.3, size=16).astype(np.float32)
    dy = rng(6).normal(size=x.shape).astype(np.float32)
    v = rng(7).normal(size=x.shape).astype(np.float32)
    eps, h = np.array([1e-5]), 1e-2

    def f(xx):
        return float((call(lib, "RmsNormFwd", [xx, w, eps], [x.shape, x.shape[:-1]])[0].astype(np.float64) * dy).sum())

    _, r = call(lib, "RmsNormFwd", [x, w, eps], [x.shape, x.shape[:-1]])
    dx, _ = call(lib, "RmsNormBwd", [dy, x, w, r], [x.shape, w.shape])
    numeric = (f(x + h * v) - f(x - h * v)) / (2 * h)
    assert float((dx.astype(np.float64) * v).sum()) == pytest.approx(numeric, rel=2e-3)


def _causal_softmax64(s, scale):
    t = s.shape[-1]
    z = s.astype(np.float64) * scale + np.triu(np.full((t, t), -np.inf), k=1)
    z = np.exp(z - z.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def test_causal_softmax_forward_and_backward_match_numpy(lib):
    s = rng(8).normal(size=(2, 3, 7, 7)).astype(np.float32) * 3
    dy = rng(9).normal(size=s.shape).astype(np.float32)
    scale = 0.35
    (y,) = call(lib, "CausalSoftmaxFwd", [s, np.array([scale])], [s.shape])
    y64 = _causal_softmax64(s, scale)
    close(y, y64)
    assert (y[..., np.triu_indices(7, 1)[0], np.triu_indices(7, 1)[1]] == 0).all()   # exactly, as a -1e9 mask
    (ds,) = call(lib, "CausalSoftmaxBwd", [y, dy, np.array([scale])], [s.shape])
    dy64 = dy.astype(np.float64)
    close(ds, scale * y64 * (dy64 - (dy64 * y64).sum(-1, keepdims=True)))


def test_causal_softmax_refuses_scores_that_are_not_square(lib):
    with pytest.raises(RuntimeError, match="returned 1"):
        call(lib, "CausalSoftmaxFwd", [np.zeros((2, 4, 5)), np.array([1.0])], [(2, 4, 5)])


@pytest.mark.parametrize("name", ["RopeFwd", "RopeBwd"])
def test_rope_refuses_tables_that_do_not_fit(lib, name):
    x = np.zeros((2, 5, 8))
    for cos, sin in [(np.zeros((4, 8)), np.zeros((5, 8))), (np.zeros((5, 8)), np.zeros((5, 6)))]:
        with pytest.raises(RuntimeError, match="returned 1"):
            call(lib, name, [x, cos, sin], [x.shape])
    with pytest.raises(RuntimeError, match="returned 1"):
        call(lib, name, [np.zeros((2, 5, 7)), np.zeros((5, 7)), np.zeros((5, 7))], [(2, 5, 7)])


def test_swiglu_forward_and_backward_match_numpy(lib):
    g = rng(10).normal(size=(6, 33)).astype(np.float32) * 4
    u = rng(11).normal(size=g.shape).astype(np.float32)
    d = rng(12).normal(size=g.shape).astype(np.float32)
    (out,) = call(lib, "SwiGluFwd", [g, u], [g.shape])
    g64, u64, d64 = g.astype(np.float64), u.astype(np.float64), d.astype(np.float64)
    sig = 1 / (1 + np.exp(-g64))
    close(out, g64 * sig * u64)
    dg, du = call(lib, "SwiGluBwd", [g, u, d], [g.shape, g.shape])
    close(du, d64 * g64 * sig)
    close(dg, d64 * u64 * (sig + g64 * sig * (1 - sig)))


def test_the_kernels_exp_is_float_exact_over_its_whole_range(lib):
    """SwiGLU's sigmoid goes through the kernels' own vectorised exp: ~1 ulp wherever exp is finite
    in float32, silu -> 0 and x at the far ends, NaN kept."""
    g = np.concatenate([np.linspace(-87, 87, 200_001), [-1e4, 1e4, np.inf, -np.inf, np.nan]]).astype(np.float32)
    (out,) = call(lib, "SwiGluFwd", [g, np.ones_like(g)], [g.shape])
    g64 = g[:-5].astype(np.float64)
    np.testing.assert_allclose(out[:-5], g64 / (1 + np.exp(-g64)), rtol=1e-6, atol=1e-37)
    assert abs(out[-5]) < 1e-30 and out[-4] == 1e4 and out[-3] == np.inf and np.isnan(out[-1])


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], -1)


def test_rope_forward_matches_numpy_and_its_backward_is_the_adjoint(lib):
    x = rng(13).normal(size=(2, 3, 5, 8)).astype(np.float32)
    angles = rng(14).uniform(0, 6, size=(5, 8))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    (y,) = call(lib, "RopeFwd", [x, cos, sin], [x.shape])
    x64 = x.astype(np.float64)
    close(y, x64 * cos + _rotate_half(x64) * sin)
    g = rng(15).normal(size=x.shape).astype(np.float32)
    (dx,) = call(lib, "RopeBwd", [g, cos, sin], [x.shape])
    # <rope(x), g> == <x, rope_bwd(g)> for every x: the backward is the forward's transpose
    assert float((y.astype(np.float64) * g).sum()) == pytest.approx(float((x64 * dx).sum()), rel=1e-5)


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_every_kernel_gives_the_same_bits_on_any_thread_count(lib, threads):
    """Large enough inputs that the kernels do split across threads."""
    x = rng(16).normal(size=(1000, 96)).astype(np.float32)
    w = rng(17).normal(size=96).astype(np.float32)
    s = rng(18).normal(size=(2, 3, 96, 96)).astype(np.float32)
    cos, sin = np.cos(x[:96, :32]), np.sin(x[:96, :32])
    q = rng(19).normal(size=(4, 4, 96, 32)).astype(np.float32)
    cases = [("RmsNormFwd", [x, w, np.array([1e-5])], [x.shape, x.shape[:-1]]),
             ("RmsNormBwd", [x[::-1], x, w, np.abs(x[:, 0])], [x.shape, w.shape]),
             ("CausalSoftmaxFwd", [s, np.array([0.2])], [s.shape]),
             ("CausalSoftmaxBwd", [np.abs(s), s, np.array([0.2])], [s.shape]),
             ("SwiGluFwd", [x, x[::-1]], [x.shape]),
             ("SwiGluBwd", [x, x[::-1], x * 2], [x.shape, x.shape]),
             ("RopeFwd", [q, cos, sin], [q.shape]),
             ("RopeBwd", [q, cos, sin], [q.shape])]
    for name, inputs, shapes in cases:
        one = call(lib, name, inputs, shapes, threads=1)
        many = call(lib, name, inputs, shapes, threads=threads)
        for a, b in zip(one, many):
            assert a.tobytes() == b.tobytes(), name
            assert np.isfinite(a).all(), name


def test_a_nan_reaches_the_outputs_it_touches(lib):
    x = rng(20).normal(size=(4, 8)).astype(np.float32)
    x[2, 3] = np.nan
    w = np.ones(8, np.float32)
    y, r = call(lib, "RmsNormFwd", [x, w, np.array([1e-5])], [x.shape, (4,)])
    assert np.isnan(y[2]).all() and np.isfinite(np.delete(y, 2, 0)).all()
    _, dw = call(lib, "RmsNormBwd", [np.ones_like(x), x, w, r], [x.shape, w.shape])
    assert np.isnan(dw).all()
    s = rng(21).normal(size=(1, 4, 4)).astype(np.float32)
    s[0, 3, 1] = np.nan
    (p,) = call(lib, "CausalSoftmaxFwd", [s, np.array([1.0])], [s.shape])
    assert np.isnan(p[0, 3, :4]).all() and np.isfinite(p[0, :3]).all()


def test_the_build_is_cached_by_content_and_compiler(tmp_path):
    first = fused_cpu.build(tmp_path, compiler=cxx())
    stamp = first.stat().st_mtime_ns
    assert fused_cpu.build(tmp_path) == first and first.stat().st_mtime_ns == stamp    # not rebuilt
    changed = tmp_path / "src" / "fused_cpu.cc"
    changed.parent.mkdir()
    changed.write_text(fused_cpu.SOURCE.read_text() + "\n// changed\n")
    other = fused_cpu.build(tmp_path, compiler=cxx(), source=changed)
    assert other != first and other.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == sorted([first.name, other.name])


def test_a_missing_compiler_or_a_compile_error_is_one_clear_error(tmp_path):
    with pytest.raises(fused_cpu.BuildError, match="no working C.. compiler .*no-such-cxx"):
        fused_cpu.build(tmp_path, compiler="no-such-cxx")
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    with pytest.raises(fused_cpu.BuildError, match="failed on .*broken.cc"):
        fused_cpu.build(tmp_path / "out", compiler=cxx(), source=broken)
    assert not [p for p in (tmp_path / "out").iterdir()]     # no half-written library left behind
