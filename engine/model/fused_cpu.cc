// Fused CPU kernels for the LLaMA block, forward and backward: RMSNorm, causal softmax, SwiGLU, RoPE.
//
// MindSpore Custom "aot" kernels (engine/model/fused_cpu.py builds this file and binds them). Each replaces
// 4-15 of MindSpore's small CPU kernels, whose launch costs ~35 us each, more than a tiny model's math.
// Every kernel is deterministic whatever the thread count: rows are independent, and the one
// reduction across rows (RMSNorm's weight gradient) sums fixed blocks of rows in a fixed order.
// No -ffast-math: a NaN or Inf anywhere must reach the loss and the gradient norm as it would unfused.
//
// The calling convention (MindSpore's): params holds the inputs, then the outputs; all float32,
// contiguous; shapes[i] has ndims[i] entries. A non-zero return is an error MindSpore raises.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

extern "C" int64_t LlmPretrainThreadsFor(int64_t n, int64_t work);

namespace {

int g_threads = 1;
constexpr int64_t kMinWorkPerThread = 1 << 20;   // below this, starting a thread (~25 us) costs more than it saves
constexpr int64_t kBlockRows = 64;               // RMSNorm's weight gradient: partial sums per block

int64_t Rows(int nd, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < nd - 1; ++i) n *= shape[i];
  return n;
}

// fn(begin, end) over [0, n) in contiguous ranges, on up to g_threads threads when `work` is large.
template <class F>
void ForRanges(int64_t n, int64_t work, F fn) {
  const int64_t t = LlmPretrainThreadsFor(n, work);
  if (t <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t per = (n + t - 1) / t;
  std::vector<std::thread> pool;
  for (int64_t k = 1; k < t; ++k) {
    const int64_t b = k * per, e = std::min(n, b + per);
    if (b < e) pool.emplace_back(fn, b, e);
  }
  fn(int64_t{0}, std::min(n, per));
  for (auto &th : pool) th.join();
}

// Vectors of the build ISA's native width in GCC's (and clang's) vector extension: 16 lanes with
// AVX-512, 8 with AVX, else 4 (SSE2, NEON). Written out rather than left to the auto-vectoriser, which if-converted Exp's
// clamp by computing the saturated branch for every element too (g / (1 + 2.4e38) in SiLU: a denormal,
// a ~100-cycle microcode assist, each time) and left the NaN-aware max scalar: the softmax and SiLU ran
// at 2-5 ns an element. Wider than the ISA's registers, GCC lowers compares a lane at a time (1 ns an
// element on SSE2, measured). Element-wise results do not depend on the width.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float VF __attribute__((vector_size(4 * kLanes)));
typedef int32_t VI __attribute__((vector_size(4 * kLanes)));

#define KINLINE inline __attribute__((always_inline))
KINLINE VF Splat(float v) { return VF{} + v; }
KINLINE VF Load(const float *p) { VF v; std::memcpy(&v, p, sizeof v); return v; }
KINLINE void Store(float *p, VF v) { std::memcpy(p, &v, sizeof v); }
// mask ? a : b, lane by lane (mask lanes all ones or all zeros), in bit operations
KINLINE VF Select(VI mask, VF a, VF b) {
  VI ai, bi;
  std::memcpy(&ai, &a, sizeof ai);
  std::memcpy(&bi, &b, sizeof bi);
  const VI r = (ai & mask) | (bi & ~mask);
  VF out;
  std::memcpy(&out, &r, sizeof out);
  return out;
}

// The reductions' eight lanes, whatever the ISA's width (AVX-512's sixteen would change the order of the
// additions, and with it the bits): written as an 8-lane vector, since with -mavx512f GCC's auto-vectoriser
// turned the lane-array loop into 16-wide code with shuffles, 1.6x slower than AVX2's (measured on RMSNorm).
typedef float V8 __attribute__((vector_size(32)));
KINLINE V8 Load8(const float *p) { V8 v; std::memcpy(&v, p, sizeof v); return v; }
KINLINE float Combine8(V8 lane) {
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// Sum of a[j] * b[j] in eight lanes, combined in a fixed order (the same bits on any ISA).
float Dot(const float *a, const float *b, int64_t n) {
  V8 lane = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) lane += Load8(a + j) * Load8(b + j);
  float s = Combine8(lane);
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

// The sum of a[0..n) in eight lanes, combined in a fixed order.
float Sum(const float *a, int64_t n) {
  V8 lane = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) lane += Load8(a + j);
  float s = Combine8(lane);
  for (; j < n; ++j) s += a[j];
  return s;
}

// The larger of m and v, or NaN where either is NaN.
KINLINE float MaxNan(float m, float v) { return (m > v || m != m) ? m : v; }
KINLINE VF MaxNan(VF m, VF v) { return Select((m > v) | (m != m), m, v); }

// The largest of a[0..n), n >= 1; a NaN anywhere gives NaN.
float Max(const float *a, int64_t n) {
  int64_t j = 0;
  float m = a[0];
  if (n >= kLanes) {
    VF lane = Load(a);
    for (j = kLanes; j + kLanes <= n; j += kLanes) lane = MaxNan(lane, Load(a + j));
    for (int k = 0; k < kLanes; ++k) m = MaxNan(m, lane[k]);
  }
  for (; j < n; ++j) m = MaxNan(m, a[j]);
  return m;
}

// exp(x) to ~1 ulp: Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, with n rounded to nearest by
// adding and subtracting 1.5 * 2^23, Cephes' degree-6 polynomial for exp(r), 2^n built in the
// exponent bits (libm's expf is a call per element, ~10x MindSpore's vectorised kernels). Saturates
// outside [-88.376, 88.376] (0 below, ~2.4e38 above: no inf from a finite x). A NaN stays NaN without
// a test: the clamp keeps it (each comparison is false), and so does every step after it. The scalar
// form does the same operations in the same order, so a tail element gets a lane's bits.
constexpr float kExpLo = -88.3762626647949f, kExpHi = 88.3762626647949f;   // n in [-127, 127]
constexpr float kLog2e = 1.44269504088896341f, kRound = 12582912.0f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;

KINLINE float Select(bool mask, float a, float b) { return mask ? a : b; }
KINLINE int32_t ToInt(float v) { return static_cast<int32_t>(v); }
KINLINE VI ToInt(VF v) { return __builtin_convertvector(v, VI); }

template <class F, class I>
KINLINE F ExpOf(F x) {
  F xc = Select(x < kExpLo, F{} + kExpLo, x);
  xc = Select(xc > kExpHi, F{} + kExpHi, xc);
  const F nf = (xc * kLog2e + kRound) - kRound;
  const I n = ToInt(nf);
  const F r = (xc - nf * kLn2Hi) - nf * kLn2Lo;
  F p = F{} + kP0;
  p = p * r + kP1;
  p = p * r + kP2;
  p = p * r + kP3;
  p = p * r + kP4;
  p = p * r + kP5;
  const F e = p * (r * r) + r + 1.0f;
  const I bits = (n + 127) << 23;                         // 2^n; n = -127 gives 0
  F scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return e * scale;
}
KINLINE VF Exp(VF x) { return ExpOf<VF, VI>(x); }
KINLINE float Exp(float x) { return ExpOf<float, int32_t>(x); }

// out[j] = exp(in[j] * scale - shift), j < n.
void ExpShifted(const float *in, float scale, float shift, float *out, int64_t n) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) Store(out + j, Exp(Load(in + j) * scale - shift));
  for (; j < n; ++j) out[j] = Exp(in[j] * scale - shift);
}

}  // namespace

extern "C" void LlmPretrainSetThreads(int n) { g_threads = n < 1 ? 1 : n; }

// The threads ForRanges uses for n items of this much work (tests check that their inputs do split).
extern "C" int64_t LlmPretrainThreadsFor(int64_t n, int64_t work) {
  return std::min(n, std::min<int64_t>(g_threads, std::max<int64_t>(1, work / kMinWorkPerThread)));
}

// RMSNorm. In: x [..., H], w [H], eps [1]. Out: y = x * r * w [..., H], r = 1/sqrt(mean(x^2) + eps) [...].
extern "C" int RmsNormFwd(int, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  const float eps = *static_cast<const float *>(params[2]);
  float *y = static_cast<float *>(params[3]);
  float *r = static_cast<float *>(params[4]);
  const int64_t h = shapes[0][ndims[0] - 1], n = Rows(ndims[0], shapes[0]);
  ForRanges(n, n * h, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float *xi = x + i * h;
      const float ri = 1.0f / std::sqrt(Dot(xi, xi, h) / static_cast<float>(h) + eps);
      r[i] = ri;
      float *yi = y + i * h;
      for (int64_t j = 0; j < h; ++j) yi[j] = (xi[j] * ri) * w[j];
    }
  });
  return 0;
}

// In: dy [..., H], x [..., H], w [H], r [...]. Out: dx [..., H], dw [H].
// dx = r * (dy * w) - x * r^3 * mean(dy * w * x); dw = sum over rows of dy * x * r.
extern "C" int RmsNormBwd(int, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  const float *dy = static_cast<const float *>(params[0]);
  const float *x = static_cast<const float *>(params[1]);
  const float *w = static_cast<const float *>(params[2]);
  const float *r = static_cast<const float *>(params[3]);
  float *dx = static_cast<float *>(params[4]);
  float *dw = static_cast<float *>(params[5]);
  const int64_t h = shapes[1][ndims[1] - 1], n = Rows(ndims[1], shapes[1]);
  const int64_t blocks = (n + kBlockRows - 1) / kBlockRows;
  std::vector<float> partial(static_cast<size_t>(blocks * h), 0.0f);
  ForRanges(blocks, n * h, [&](int64_t b, int64_t e) {
    std::vector<float> g(static_cast<size_t>(h));
    for (int64_t blk = b; blk < e; ++blk) {
      float *pw = partial.data() + blk * h;
      for (int64_t i = blk * kBlockRows; i < std::min(n, (blk + 1) * kBlockRows); ++i) {
        const float *xi = x + i * h, *dyi = dy + i * h;
        const float ri = r[i];
        for (int64_t j = 0; j < h; ++j) {
          g[j] = dyi[j] * w[j];
          pw[j] += dyi[j] * (xi[j] * ri);
        }
        const float c = ri * ri * ri * (Dot(g.data(), xi, h) / static_cast<float>(h));
        float *dxi = dx + i * h;
        for (int64_t j = 0; j < h; ++j) dxi[j] = ri * g[j] - xi[j] * c;
      }
    }
  });
  std::memset(dw, 0, sizeof(float) * static_cast<size_t>(h));
  for (int64_t blk = 0; blk < blocks; ++blk)
    for (int64_t j = 0; j < h; ++j) dw[j] += partial[blk * h + j];
  return 0;
}

// Causal softmax over the last axis. In: s [..., T, T] (row i of each T x T block attends to 0..i),
// scale [1]. Out: y = softmax(s * scale) over columns 0..i, exactly 0 beyond (as a -1e9 mask gives).
extern "C" int CausalSoftmaxFwd(int, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  const float *s = static_cast<const float *>(params[0]);
  const float scale = *static_cast<const float *>(params[1]);
  float *y = static_cast<float *>(params[2]);
  const int nd = ndims[0];
  const int64_t t = shapes[0][nd - 1];
  if (nd < 2 || shapes[0][nd - 2] != t) return 1;
  const int64_t n = Rows(nd, shapes[0]);
  ForRanges(n, n * t * 4, [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const int64_t upto = row % t + 1;
      const float *si = s + row * t;
      float *yi = y + row * t;
      const float m = Max(si, upto) * scale;      // scale > 0: the max of the scaled row
      ExpShifted(si, scale, m, yi, upto);
      const float inv = 1.0f / Sum(yi, upto);
      for (int64_t j = 0; j < upto; ++j) yi[j] *= inv;
      for (int64_t j = upto; j < t; ++j) yi[j] = 0.0f;
    }
  });
  return 0;
}

// In: y [..., T, T] (the forward's output), dy, scale [1]. Out: ds = scale * y * (dy - sum(dy * y)).
extern "C" int CausalSoftmaxBwd(int, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  const float *y = static_cast<const float *>(params[0]);
  const float *dy = static_cast<const float *>(params[1]);
  const float scale = *static_cast<const float *>(params[2]);
  float *ds = static_cast<float *>(params[3]);
  const int nd = ndims[0];
  const int64_t t = shapes[0][nd - 1], n = Rows(nd, shapes[0]);
  ForRanges(n, n * t, [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const int64_t upto = row % t + 1;
      const float *yi = y + row * t, *dyi = dy + row * t;
      float *dsi = ds + row * t;
      const float dot = Dot(dyi, yi, upto);
      for (int64_t j = 0; j < upto; ++j) dsi[j] = scale * (yi[j] * (dyi[j] - dot));
      for (int64_t j = upto; j < t; ++j) dsi[j] = 0.0f;
    }
  });
  return 0;
}

// SwiGLU's product. In: gate, up (same shape). Out: silu(gate) * up.
extern "C" int SwiGluFwd(int, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  const float *g = static_cast<const float *>(params[0]);
  const float *u = static_cast<const float *>(params[1]);
  float *out = static_cast<float *>(params[2]);
  const int64_t n = Rows(ndims[0], shapes[0]) * shapes[0][ndims[0] - 1];
  ForRanges(n, n * 4, [&](int64_t b, int64_t e) {
    int64_t i = b;
    for (; i + kLanes <= e; i += kLanes) {
      const VF gi = Load(g + i);
      Store(out + i, (gi / (1.0f + Exp(-gi))) * Load(u + i));
    }
    for (; i < e; ++i) out[i] = (g[i] / (1.0f + Exp(-g[i]))) * u[i];
  });
  return 0;
}

// In: gate, up, dout. Out: dgate = dout * up * sig * (1 + gate * (1 - sig)), dup = dout * silu(gate).
extern "C" int SwiGluBwd(int, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  const float *g = static_cast<const float *>(params[0]);
  const float *u = static_cast<const float *>(params[1]);
  const float *dout = static_cast<const float *>(params[2]);
  float *dg = static_cast<float *>(params[3]);
  float *du = static_cast<float *>(params[4]);
  const int64_t n = Rows(ndims[0], shapes[0]) * shapes[0][ndims[0] - 1];
  ForRanges(n, n * 4, [&](int64_t b, int64_t e) {
    int64_t i = b;
    for (; i + kLanes <= e; i += kLanes) {
      const VF gi = Load(g + i), di = Load(dout + i);
      const VF sig = 1.0f / (1.0f + Exp(-gi));
      Store(du + i, di * (gi * sig));
      Store(dg + i, di * Load(u + i) * (sig * (1.0f + gi * (1.0f - sig))));
    }
    for (; i < e; ++i) {
      const float sig = 1.0f / (1.0f + Exp(-g[i]));
      du[i] = dout[i] * (g[i] * sig);
      dg[i] = dout[i] * u[i] * (sig * (1.0f + g[i] * (1.0f - sig)));
    }
  });
  return 0;
}

// RoPE's shapes: x [..., T, D] with D even, cos and sin [T, D]; false where they are not.
static bool RopeShape(int *ndims, int64_t **shapes, int64_t *d, int64_t *t, int64_t *n) {
  const int nd = ndims[0];
  if (nd < 2 || ndims[1] != 2 || ndims[2] != 2) return false;
  *d = shapes[0][nd - 1];
  *t = shapes[0][nd - 2];
  *n = Rows(nd, shapes[0]);
  return *d % 2 == 0 && shapes[1][0] == *t && shapes[1][1] == *d && shapes[2][0] == *t && shapes[2][1] == *d;
}

// Rotary embedding, Hugging Face's rotate-half layout. In: x [..., T, D], cos [T, D], sin [T, D].
// Out: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]).
extern "C" int RopeFwd(int, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  const float *x = static_cast<const float *>(params[0]);
  const float *c = static_cast<const float *>(params[1]);
  const float *s = static_cast<const float *>(params[2]);
  float *y = static_cast<float *>(params[3]);
  int64_t d, t, n;
  if (!RopeShape(ndims, shapes, &d, &t, &n)) return 1;
  const int64_t half = d / 2;
  ForRanges(n, n * d, [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const float *xi = x + row * d, *ci = c + (row % t) * d, *si = s + (row % t) * d;
      float *yi = y + row * d;
      for (int64_t j = 0; j < half; ++j) yi[j] = xi[j] * ci[j] + (-xi[j + half]) * si[j];
      for (int64_t j = half; j < d; ++j) yi[j] = xi[j] * ci[j] + xi[j - half] * si[j];
    }
  });
  return 0;
}

// In: dy [..., T, D], cos, sin. Out: dx = dy * cos + rotate_half's transpose of (dy * sin).
extern "C" int RopeBwd(int, void **params, int *ndims, int64_t **shapes, const char **, void *, void *) {
  const float *dy = static_cast<const float *>(params[0]);
  const float *c = static_cast<const float *>(params[1]);
  const float *s = static_cast<const float *>(params[2]);
  float *dx = static_cast<float *>(params[3]);
  int64_t d, t, n;
  if (!RopeShape(ndims, shapes, &d, &t, &n)) return 1;
  const int64_t half = d / 2;
  ForRanges(n, n * d, [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const float *gi = dy + row * d, *ci = c + (row % t) * d, *si = s + (row % t) * d;
      float *dxi = dx + row * d;
      for (int64_t j = 0; j < half; ++j) dxi[j] = gi[j] * ci[j] + gi[j + half] * si[j + half];
      for (int64_t j = half; j < d; ++j) dxi[j] = gi[j] * ci[j] - gi[j - half] * si[j - half];
    }
  });
  return 0;
}

namespace {

int64_t Size(int nd, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < nd; ++i) n *= shape[i];
  return n;
}

constexpr int64_t kClipBlock = 1 << 16;   // elements: the norm's partial sums, in a fixed order

}  // namespace

// The gradients' unscaling, global norm and clipping in one pass each way. In: count [1] (k, exactly
// representable), inv [1], clip [1], then k tensors, the gradients one after another (one flat buffer
// or one tensor a parameter). Out: tensors of the same total size, the same stream cut into the
// parameters' shapes, then norm [1]. v = x * inv; norm = sqrt(sum v^2) (fixed blocks, summed in double
// in order: the same bits on any thread count); y = v * min(clip / (norm + 1e-6), 1), or v where
// clip <= 0. A NaN or Inf anywhere makes the norm non-finite (the step's finite check).
extern "C" int ClipGrads(int nparam, void **params, int *ndims, int64_t **shapes, const char **, void *,
                         void *) {
  const int k = static_cast<int>(*static_cast<const float *>(params[0]));
  const float inv = *static_cast<const float *>(params[1]);
  const float clip = *static_cast<const float *>(params[2]);
  const int m = nparam - 4 - k;
  if (k < 1 || m < 1) return 1;
  std::vector<int64_t> in_at(k + 1, 0), out_at(m + 1, 0);
  for (int i = 0; i < k; ++i) in_at[i + 1] = in_at[i] + Size(ndims[3 + i], shapes[3 + i]);
  for (int i = 0; i < m; ++i) out_at[i + 1] = out_at[i] + Size(ndims[3 + k + i], shapes[3 + k + i]);
  if (in_at[k] != out_at[m]) return 2;
  const int64_t total = in_at[k], blocks = (total + kClipBlock - 1) / kClipBlock;
  // the input holding flat position p, and the pointer to it (inputs are contiguous, in order)
  auto in_ptr = [&](int64_t p, int64_t *run) {
    const int i = static_cast<int>(std::upper_bound(in_at.begin(), in_at.end(), p) - in_at.begin()) - 1;
    *run = in_at[i + 1] - p;
    return static_cast<const float *>(params[3 + i]) + (p - in_at[i]);
  };
  std::vector<double> partial(static_cast<size_t>(blocks), 0.0);
  ForRanges(blocks, total, [&](int64_t b, int64_t e) {
    for (int64_t blk = b; blk < e; ++blk) {
      float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t p = blk * kClipBlock, end = std::min(total, p + kClipBlock); p < end;) {
        int64_t run;
        const float *x = in_ptr(p, &run);
        run = std::min(run, end - p);
        // lane = flat position mod 8, however the stream is cut into tensors
        auto one = [&](int64_t j) {
          const float v = x[j] * inv;
          lane[(p + j) % 8] += v * v;
        };
        int64_t j = 0;
        for (; j < run && (p + j) % 8 != 0; ++j) one(j);
        for (; j + 8 <= run; j += 8)
          for (int q = 0; q < 8; ++q) {
            const float v = x[j + q] * inv;
            lane[q] += v * v;
          }
        for (; j < run; ++j) one(j);
        p += run;
      }
      partial[blk] = ((double{lane[0]} + lane[1]) + (double{lane[2]} + lane[3])) +
                     ((double{lane[4]} + lane[5]) + (double{lane[6]} + lane[7]));
    }
  });
  double sum = 0.0;
  for (double v : partial) sum += v;
  const float norm = static_cast<float>(std::sqrt(sum));
  const float coef = clip > 0.0f ? std::min(clip / (norm + 1e-6f), 1.0f) : 1.0f;
  ForRanges(m, total, [&](int64_t b, int64_t e) {
    for (int64_t o = b; o < e; ++o) {
      float *y = static_cast<float *>(params[3 + k + o]);
      for (int64_t p = out_at[o]; p < out_at[o + 1];) {
        int64_t run;
        const float *x = in_ptr(p, &run);
        run = std::min(run, out_at[o + 1] - p);
        float *yo = y + (p - out_at[o]);
        for (int64_t j = 0; j < run; ++j) yo[j] = (x[j] * inv) * coef;
        p += run;
      }
    }
  });
  *static_cast<float *>(params[nparam - 1]) = norm;
  return 0;
}
