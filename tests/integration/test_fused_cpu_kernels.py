"""The fused CPU kernels (engine/model/fused_cpu.cc), called as MindSpore calls them, through ctypes: built by
the real compiler, checked against numpy in float64, forward and backward; the same bits on any thread
count; a NaN reaches the output; the build is cached by content and fails in one clear line."""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from engine.model import fused_cpu
from tests.cxx import cxx


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    built = ctypes.CDLL(str(fused_cpu.build(tmp_path_factory.mktemp("kernels"), compiler=cxx())))
    built.LlmPretrainThreadsFor.restype = ctypes.c_int64
    return built


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
    """Inputs large enough that every kernel does split across `threads` threads (checked: a kernel
    starts threads only for ~1M elements of work a thread)."""
    x = rng(16).normal(size=(20480, 256)).astype(np.float32)
    w = rng(17).normal(size=256).astype(np.float32)
    s = rng(18).normal(size=(16, 5, 256, 256)).astype(np.float32)
    q = rng(19).normal(size=(8, 8, 2560, 32)).astype(np.float32)
    cos, sin = np.cos(q[0, 0]), np.sin(q[0, 1])
    grads = [x[:, :100], x[:7, 100:], x[:, 56:]]
    shapes = [g.shape for g in grads]
    one_scale = np.array([1 / 8.0])
    cases = [("RmsNormFwd", [x, w, np.array([1e-5])], [x.shape, x.shape[:-1]], (x.shape[0], x.size)),
             ("RmsNormBwd", [x[::-1], x, w, np.abs(x[:, 0])], [x.shape, w.shape], (x.shape[0] // 64, x.size)),
             ("CausalSoftmaxFwd", [s, np.array([0.2])], [s.shape], (s.size // 256, s.size * 4)),
             ("CausalSoftmaxBwd", [np.abs(s), s, np.array([0.2])], [s.shape], (s.size // 256, s.size)),
             ("SwiGluFwd", [x, x[::-1]], [x.shape], (x.size, x.size * 4)),
             ("SwiGluBwd", [x, x[::-1], x * 2], [x.shape, x.shape], (x.size, x.size * 4)),
             ("RopeFwd", [q, cos, sin], [q.shape], (q.size // 32, q.size)),
             ("RopeBwd", [q, cos, sin], [q.shape], (q.size // 32, q.size)),
             ("ClipGrads", [np.array([3.0]), one_scale, np.array([0.5]), *grads], [*shapes, (1,)],
              (sum(g.size for g in grads) // 65536, sum(g.size for g in grads)))]
    for name, inputs, out_shapes, (items, work) in cases:
        lib.LlmPretrainSetThreads(threads)
        assert lib.LlmPretrainThreadsFor(ctypes.c_int64(items), ctypes.c_int64(work)) == threads, name
        one = call(lib, name, inputs, out_shapes, threads=1)
        many = call(lib, name, inputs, out_shapes, threads=threads)
        for a, b in zip(one, many):
            assert a.tobytes() == b.tobytes(), name
            assert np.isfinite(a).all(), name


def _clip(parts, shapes, inv, clip, lib):
    return call(lib, "ClipGrads", [np.array([float(len(parts))]), np.array([inv]), np.array([clip]), *parts],
                [*shapes, (1,)])


def test_clip_grads_unscales_measures_and_clips_as_numpy_does(lib):
    grads = [rng(30).normal(size=shape).astype(np.float32) * 1024 for shape in [(64, 32), (32,), (7, 3, 5)]]
    shapes = [g.shape for g in grads]
    flat64 = np.concatenate([g.ravel() for g in grads]).astype(np.float64) / 1024
    norm64 = np.sqrt((flat64 ** 2).sum())
    for clip, coef in [(1.0, min(1.0, 1.0 / (norm64 + 1e-6))), (1e9, 1.0), (0.0, 1.0)]:
        *out, norm = _clip(grads, shapes, 1 / 1024, clip, lib)
        assert norm.shape == (1,) and norm[0] == pytest.approx(norm64, rel=1e-6)
        for g, o in zip(grads, out):
            close(o, g.astype(np.float64) / 1024 * coef, rtol=1e-6, atol=0)
    assert coef == 1.0 and norm64 > 1.0          # the first case did clip


def test_clip_grads_cuts_one_flat_buffer_into_the_parameters_shapes(lib):
    """The data-parallel step hands it the summed flat buffer; the one-rank step each gradient: same bits."""
    grads = [rng(31).normal(size=shape).astype(np.float32) for shape in [(300, 70), (70,), (1, 9), (70, 300)]]
    shapes = [g.shape for g in grads]
    flat = np.concatenate([g.ravel() for g in grads])
    per_param = _clip(grads, shapes, 0.5, 1.0, lib)
    from_flat = _clip([flat], shapes, 0.5, 1.0, lib)
    for a, b in zip(per_param, from_flat):
        assert a.tobytes() == b.tobytes()
    reverse = _clip([flat[:5], flat[5:]], [flat.shape], 0.5, 1.0, lib)    # and back into one buffer
    assert reverse[0].tobytes() == np.concatenate([o.ravel() for o in per_param[:-1]]).tobytes()


def test_clip_grads_gives_a_non_finite_norm_for_any_nan_or_inf_and_refuses_mismatched_sizes(lib):
    for bad in (np.nan, np.inf):
        grads = [np.ones((4, 4), np.float32), np.ones(3, np.float32)]
        grads[1][2] = bad
        *_, norm = _clip(grads, [(4, 4), (3,)], 1.0, 1.0, lib)
        assert not np.isfinite(norm[0])
    with pytest.raises(RuntimeError, match="ClipGrads returned 2"):
        _clip([np.ones(5, np.float32)], [(4,)], 1.0, 1.0, lib)


@pytest.mark.parametrize("wide", ["-mavx2", "-mavx512f"])
def test_the_avx2_and_avx512_libraries_give_the_baseline_librarys_bits(tmp_path, wide):
    """Machines that share a cache directory may build for different ISAs: their numbers must agree."""
    if wide.removeprefix("-m") not in Path("/proc/cpuinfo").read_text().split():
        pytest.skip(f"this CPU has no {wide.removeprefix('-m').upper()}")
    base = ctypes.CDLL(str(fused_cpu.build(tmp_path / "base", compiler=cxx(), isa=())))
    avx2 = ctypes.CDLL(str(fused_cpu.build(tmp_path / "wide", compiler=cxx(), isa=(wide,))))
    x = rng(40).normal(size=(203, 67)).astype(np.float32) * 4
    s = rng(41).normal(size=(3, 37, 37)).astype(np.float32) * 8
    cases = [("SwiGluFwd", [x, x[::-1]], [x.shape]), ("SwiGluBwd", [x, x[::-1], x * 2], [x.shape, x.shape]),
             ("CausalSoftmaxFwd", [s, np.array([0.3])], [s.shape]),
             ("RmsNormFwd", [x, x[0], np.array([1e-5])], [x.shape, x.shape[:-1]])]
    for name, inputs, shapes in cases:
        for a, b in zip(call(base, name, inputs, shapes), call(avx2, name, inputs, shapes)):
            assert a.tobytes() == b.tobytes(), name


def test_isa_flags_name_avx2_on_an_x86_cpu_that_has_it_and_avx512_only_when_asked(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n\nprocessor\t: 1\n")
    assert fused_cpu.isa_flags(info, machine="x86_64") == ("-mavx2",)
    assert fused_cpu.isa_flags(info, machine="aarch64") == ()
    info.write_text("flags\t\t: fpu sse sse2 avx\n")
    assert fused_cpu.isa_flags(info, machine="x86_64") == ()
    info.write_text("flags\t\t: fpu sse sse2 avx avx2 avx512f avx512bw avx512vl\n")
    assert fused_cpu.isa_flags(info, machine="x86_64") == ("-mavx2",)
    assert fused_cpu.isa_flags(info, machine="x86_64", widest=True) == ("-mavx512f",)
    info.write_text("flags\t\t: fpu sse sse2 avx avx2\n")
    assert fused_cpu.isa_flags(info, machine="x86_64", widest=True) == ("-mavx2",)
    assert fused_cpu.isa_flags(tmp_path / "missing", machine="x86_64") == ()


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
