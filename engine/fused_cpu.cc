// Fused CPU kernels for the LLaMA block, forward and backward: RMSNorm, causal softmax, SwiGLU, RoPE.
//
// MindSpore Custom "aot" kernels (engine/fused_cpu.py builds this file and binds them). Each replaces
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

namespace {

int g_threads = 1;
constexpr int64_t kMinWorkPerThread = 1 << 15;   // elements: below this, a thread costs more than it saves
constexpr int64_t kBlockRows = 64;               // RMSNorm's weight gradient: partial sums per block

int64_t Rows(int nd, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < nd - 1; ++i) n *= shape[i];
  return n;
}

// fn(begin, end) over [0, n) in contiguous ranges, on up to g_threads threads when `work` is large.
template <class F>
void ForRanges(int64_t n, int64_t work, F fn) {
  int64_t t = std::min<int64_t>(g_threads, std::max<int64_t>(1, work / kMinWorkPerThread));
  t = std::min(t, n);
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

// Sum of a[j] * b[j] in eight lanes, combined in a fixed order (vectorisable without -ffast-math).
float Dot(const float *a, const float *b, int64_t n) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int k = 0; k < 8; ++k) lane[k] += a[j + k] * b[j + k];
  float s = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  for (; j < n; ++j) s += a[j] * b[j];
  return s;
}

// The sum of a[0..n) in eight lanes, combined in a fixed order.
float Sum(const float *a, int64_t n) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int k = 0; k < 8; ++k) lane[k] += a[j + k];
  float s = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  for (; j < n; ++j) s += a[j];
  return s;
}

// The largest of a[0..n), n >= 1; a NaN anywhere gives NaN.
float Max(const float *a, int64_t n) {
  float lane[8];
  for (int k = 0; k < 8; ++k) lane[k] = a[0];
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int k = 0; k < 8; ++k) lane[k] = (lane[k] > a[j + k] || lane[k] != lane[k]) ? lane[k] : a[j + k];
  float m = lane[0];
  for (int k = 1; k < 8; ++k) m = (m > lane[k] || m != m) ? m : lane[k];
  for (; j < n; ++j) m = (m > a[j] || m != m) ? m : a[j];
  return m;
}

// exp(x) to ~1 ulp, branch-free so that loops over it vectorise (libm's expf is a call per element,
// ~10x MindSpore's vectorised kernels): Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, Cephes'
// degree-6 polynomial for exp(r), 2^n built in the exponent bits. Saturates outside +-88.376 (0
// below, ~2.4e38 above: no inf from a finite x), and returns a NaN input as NaN.
__attribute__((always_inline)) inline float Exp(float x) {
  const float xc = std::min(std::max(x, -88.3762626647949f), 88.3762626647949f);
  const float fx = xc * 1.44269504088896341f + 0.5f;
  int32_t n = static_cast<int32_t>(fx);
  n -= static_cast<int32_t>(fx < static_cast<float>(n));           // floor, for negative fx too
  const float nf = static_cast<float>(n);
  const float r = (xc - nf * 0.693359375f) - nf * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * (r * r) + r + 1.0f;
  const int32_t bits = (n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x != x ? x : e * scale;
}

// out[j] = exp(in[j] * scale - shift), j < n.
void ExpShifted(const float *__restrict in, float scale, float shift, float *__restrict out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = Exp(in[j] * scale - shift);
}

}  // namespace

extern "C" void LlmPretrainSetThreads(int n) { g_threads = n < 1 ? 1 : n; }

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
    for (int64_t i = b; i < e; ++i) out[i] = (g[i] / (1.0f + Exp(-g[i]))) * u[i];
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
    for (int64_t i = b; i < e; ++i) {
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
