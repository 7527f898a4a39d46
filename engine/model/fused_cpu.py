"""Fused CPU kernels for the LLaMA block: RMSNorm, causal softmax, SwiGLU and RoPE, one C++ kernel each
way (MindSpore Custom "aot" ops with their own gradients; the C++ is engine/model/fused_cpu.cc).

Why: on the CPU each MindSpore kernel has a fixed launch cost, and the unfused block runs dozens of them
per layer (RMSNorm alone: ReduceMean, Add, Rsqrt, two broadcasts and Muls forward, a dozen backward;
the softmax's mask, scale and gradient another eight), which is more than a small model's math.

Owns: building the library once per source, compiler and flags (g++, into the cache directory,
atomically: concurrent ranks race safely), the Custom primitives, and the intra-op thread count the
kernels use (runtime.setup sets it to MindSpore's). Without a compiler the model keeps MindSpore's
own ops, and the first rank to find that out says so once on stderr.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from durable import write_atomically

SOURCE = Path(__file__).with_name("fused_cpu.cc")
# -fno-trapping-math and -fno-math-errno let the compiler vectorise selects and sqrt; no -ffast-math:
# NaN and Inf must survive
FLAGS = ("-O3", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fno-trapping-math",
         "-fno-math-errno")
COMPILER = "g++"            # or $CXX


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo"), machine: str | None = None) -> set[str]:
    """The ISA extensions of this x86-64 CPU (`/proc/cpuinfo`'s flags); none elsewhere or unreadable."""
    import platform

    if (machine or platform.machine()) not in ("x86_64", "AMD64"):
        return set()
    try:
        return set(next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                         if line.startswith("flags")), []))
    except OSError:
        return set()


def isa_flags(cpuinfo: Path = Path("/proc/cpuinfo"), machine: str | None = None, *,
              widest: bool = False) -> tuple[str, ...]:
    """The ISA the kernels are built for: -mavx2 on an x86-64 CPU that has AVX2 (8 lanes: ~2x SSE2's 4), else
    nothing: the baseline ISA. `widest`: -mavx512f (16 lanes) where the CPU has AVX-512 — not the default: the
    kernels alone ran 10-25 % faster in it, the whole step +11 % in one sitting and -16 % in another on tiny
    (bench/vs_pytorch.py's A/B, an Intel Xeon VM): no gain this machine's noise lets one claim. Not
    -march=native: the library's cache key names its flags, so machines sharing a cache directory each get a
    library their CPU runs. No FMA (the build has -ffp-contract=off) and the reductions add eight lanes in a
    fixed order whatever the width: every library gives the baseline's bits exactly."""
    flags = cpu_flags(cpuinfo, machine)
    if widest and "avx512f" in flags:
        return ("-mavx512f",)
    return ("-mavx2",) if "avx2" in flags else ()

_threads = 1
_built: tuple[Path | None] | None = None      # (the library, or None where it failed) once tried
_kernels = None


class BuildError(RuntimeError):
    """The library could not be built (no compiler, a compile error, nowhere to write)."""


class UnwritableError(BuildError):
    """The directory for the library cannot be written."""


def set_threads(count: int) -> None:
    """The kernels' intra-op threads (MindSpore's own count for this rank)."""
    global _threads
    _threads = max(1, int(count))
    if _built is not None and _built[0] is not None:
        ctypes.CDLL(str(_built[0])).LlmPretrainSetThreads(_threads)


def threads() -> int:
    """The rank's intra-op threads, as set_threads was last told (1 before)."""
    return _threads


def cache_dir(env=os.environ) -> Path:
    from engine.data.prepare import cache_root

    return cache_root(env) / "kernels"


def build(out_dir: Path, *, compiler: str = COMPILER, source: Path = SOURCE,
          isa: tuple[str, ...] | None = None) -> Path:
    """The shared library for this source, compiler and flags under out_dir, compiled if it is not there.
    compiler: a command line ("g++", "ccache clang++"); isa: the instruction-set flags (isa_flags())."""
    cxx = shlex.split(compiler)
    flags = (*FLAGS, *(isa_flags() if isa is None else isa))
    try:
        version = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=30,
                                 check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"no working C++ compiler ({compiler}: {e})") from None
    text = source.read_bytes()
    key = hashlib.sha256(text + version.encode() + " ".join([*cxx, *flags]).encode()).hexdigest()[:16]
    lib = out_dir / f"fused_cpu-{key}.so"
    if lib.exists():
        return lib
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{lib.name}.", dir=out_dir)
        os.close(fd)
    except OSError as e:
        raise UnwritableError(f"cannot write the kernels to {out_dir}: {e}") from None
    try:
        done = subprocess.run([*cxx, *flags, "-o", tmp, str(source)], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise BuildError(f"{compiler} failed on {source}: {done.stderr.strip()[-500:]}")
        write_atomically(lib, Path(tmp).read_bytes(), sync_dir=False)     # a cache: durability not needed
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


ENV_ISA = "LLM_PRETRAIN_KERNEL_ISA"     # "" (isa_flags()), "avx512" (the widest), "avx2" or "baseline"


def chosen_isa(env=os.environ) -> tuple[str, ...] | None:
    """The ISA flags $LLM_PRETRAIN_KERNEL_ISA asks for; None: the default (isa_flags())."""
    name = env.get(ENV_ISA, "")
    if name in ("", "default"):
        return None
    choices = {"avx512": isa_flags(widest=True), "avx2": isa_flags(), "baseline": ()}
    if name not in choices:
        raise BuildError(f"${ENV_ISA} = {name!r}: it must be one of default, {', '.join(choices)}")
    if name == "avx512" and choices[name] != ("-mavx512f",) or name == "avx2" and not choices[name]:
        raise BuildError(f"${ENV_ISA} = {name!r}: this CPU has no {name.upper()}")
    return choices[name]


def library(env=os.environ) -> Path | None:
    """The built library, or None (said once on stderr) where it cannot be built."""
    global _built
    if _built is None:
        compiler = env.get("CXX") or COMPILER
        try:
            isa = chosen_isa(env)
            try:
                lib = build(cache_dir(env), compiler=compiler, isa=isa)
            except UnwritableError:
                lib = build(Path(tempfile.gettempdir()) / f"llm-pretrain-kernels-{os.getuid()}", compiler=compiler,
                            isa=isa)
            ctypes.CDLL(str(lib)).LlmPretrainSetThreads(_threads)
            _built = (lib,)
        except BuildError as e:
            _built = (None,)
            print(f"llm-pretrain: fused CPU kernels unavailable, using MindSpore's own ops (slower on small "
                  f"models): {e}; install g++ (or set $CXX), or set train.fused_kernels = false",
                  file=sys.stderr, flush=True)
    return _built[0]


def kernels(env=os.environ):
    """The fused ops (a FusedKernels), or None where the library cannot be built."""
    global _kernels
    if _kernels is None:
        lib = library(env)
        if lib is None:
            return None
        _kernels = FusedKernels(lib)
    return _kernels


class FusedKernels:
    """The Custom primitives, built once per process and shared by every layer. Each call takes and
    returns float32 tensors; the gradient of each is its *Bwd kernel."""

    def __init__(self, lib: Path):
        import mindspore as ms
        from mindspore import Tensor, ops

        def op(name, out_shape, out_dtype, bprop=None):
            return ops.Custom(f"{lib}:{name}", out_shape=out_shape, out_dtype=out_dtype, func_type="aot",
                              bprop=bprop)

        rms_bwd = op("RmsNormBwd", lambda dy, x, w, r: (x, w), lambda dy, x, w, r: (x, w))

        def rms_bprop(x, w, eps, out, dout):
            dx, dw = rms_bwd(dout[0], x, w, out[1])
            return dx, dw, ops.zeros_like(eps)

        self._rms = op("RmsNormFwd", lambda x, w, eps: (x, x[:-1]), lambda x, w, eps: (x, x), rms_bprop)

        softmax_bwd = op("CausalSoftmaxBwd", lambda y, dy, scale: y, lambda y, dy, scale: y)

        def softmax_bprop(s, scale, out, dout):
            return softmax_bwd(out, dout, scale), ops.zeros_like(scale)

        self._softmax = op("CausalSoftmaxFwd", lambda s, scale: s, lambda s, scale: s, softmax_bprop)

        swiglu_bwd = op("SwiGluBwd", lambda g, u, d: (g, u), lambda g, u, d: (g, u))

        def swiglu_bprop(g, u, out, dout):
            return swiglu_bwd(g, u, dout)

        self._swiglu = op("SwiGluFwd", lambda g, u: g, lambda g, u: g, swiglu_bprop)

        rope_bwd = op("RopeBwd", lambda dy, c, s: dy, lambda dy, c, s: dy)

        def rope_bprop(x, c, s, out, dout):
            return rope_bwd(dout, c, s), ops.zeros_like(c), ops.zeros_like(s)

        self._rope = op("RopeFwd", lambda x, c, s: x, lambda x, c, s: x, rope_bprop)
        self.scalar = lambda value: Tensor([value], ms.float32)
        self._op = op

    def grad_clipper(self, shapes, clip: float):
        """A GradClipper for parameters of these shapes and this clipping norm (<= 0: none)."""
        return GradClipper(self._op, shapes, self.scalar(clip), self.scalar)

    def rms_norm(self, x, weight, eps):
        """x * rsqrt(mean(x^2, -1) + eps) * weight; eps: a (1,) float32 tensor (self.scalar)."""
        return self._rms(x, weight, eps)[0]

    def causal_softmax(self, scores, scale):
        """softmax(scores * scale + causal mask) over the last axis of (..., T, T); scale: a (1,) tensor."""
        return self._softmax(scores, scale)

    def swiglu(self, gate, up):
        """silu(gate) * up."""
        return self._swiglu(gate, up)

    def rope(self, x, cos, sin):
        """x * cos + rotate_half(x) * sin, x (..., T, D), cos and sin (T, D)."""
        return self._rope(x, cos, sin)


class GradClipper:
    """The gradients unscaled, their global norm, and clipped to it, in one kernel (ClipGrads), where
    MindSpore's graph took ~45: the concatenation, four reductions and scalings, a slice and a reshape
    per parameter. Call it inside a traced step with the gradients as one flat buffer or one tensor a
    parameter: returns (the clipped gradients in the parameters' shapes, the unclipped norm, shape ())."""

    def __init__(self, op, shapes, clip, scalar):
        import mindspore as ms

        self.shapes = [tuple(s) for s in shapes]
        outs = len(self.shapes) + 1
        self._op = op("ClipGrads", lambda *ins: [*self.shapes, [1]], lambda *ins: [ms.float32] * outs)
        self.clip = clip
        self._counts = {k: scalar(float(k)) for k in (1, len(self.shapes))}

    def __call__(self, parts, inv_scale):
        out = self._op(self._counts[len(parts)], inv_scale, self.clip, *parts)
        return list(out[:-1]), out[-1].reshape(())
