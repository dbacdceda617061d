// Fused CPU ops for the decode step: each replaces a run of small eager ops
// (a batch-1 step of a 30-layer model was ~1,200 of them, 5-10 us each):
//
//   rms_norm         x * rsqrt(mean(x^2) + eps) * weight                  (~8 ops -> 1)
//   silu_mul         silu(gate) * up over a fused gate|up projection     (~4 ops -> 1)
//   paged_attention  RoPE on q and k, k/v written into the paged pool,
//                    causal attention read straight from the pool blocks (~25 ops -> 1)
//   linear_rows      a float32 or bfloat16 linear over 1-4 rows, at memory speed
//   linear_rows_tiled  the same arithmetic over any number of rows (batch-invariant mode)
//
// Arithmetic is float32 throughout; bfloat16 tensors are converted on load
// and rounded where the eager path rounds (rms_norm before the weight
// multiply, silu before the product), so both paths agree to float32
// rounding.  Loops are plain C++ written for the auto-vectoriser, compiled
// twice: for AVX2+FMA (target attribute, taken only where the CPU has it)
// and portable; ferrum_woq::set_max_isa caps both files, so tests run each
// build on any machine.  The eager torch ops in models/llama.py stay the
// fallback (--step-ops eager) and the reference these are probed against.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <omp.h>

#include "qact.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FERRUM_X86 1
#endif

int ferrum_active_isa();  // woq.cpp: 0 portable, 1 avx2, 2 avx512
at::Tensor ferrum_woq_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             const at::Tensor& mins, int64_t bits);  // woq.cpp
at::Tensor ferrum_qact_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              int64_t bits, int64_t digits, bool rotated);  // qact.cpp: packed codes

namespace {

inline float load(float v) { return v; }
inline float load(c10::BFloat16 v) {  // the bit pattern shifted into place: exact, and it vectorises
  const uint32_t bits = uint32_t(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
template <typename T> inline T store(float v) { return static_cast<T>(v); }

#define FERRUM_INLINE inline __attribute__((always_inline))

// ---- exp over arrays --------------------------------------------------------------
// libm's expf is a call per element (a batch-1 step spent ~15% of its attention
// and silu time there).  exp8: Cephes' expf on 8 lanes, x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by its degree-7 polynomial, 2^n into the exponent
// bits: within 2e-7 relative of exp (measured over -87..88); x below -87.34
// (where expf is subnormal or 0) gives 0, above 88.38 +inf (expf: above 88.72;
// the softmax never passes 0 and silu's 1 + e^-x makes either 0 in the end).
#ifdef FERRUM_X86
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts, as Cephes
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n as two factors: n reaches 128 at the top of the range, past one exponent field
  const __m256i e = _mm256_cvtps_epi32(n), e1 = _mm256_srai_epi32(e, 1);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, _mm256_set1_epi32(127)), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(e, e1),
                                                                           _mm256_set1_epi32(127)), 23));
  const __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
  return _mm256_blendv_ps(_mm256_andnot_ps(under, y), _mm256_set1_ps(INFINITY), over);
}

// s[j] = exp(s[j] - mx) for j < n; returns their sum.
__attribute__((target("avx2,fma"))) float exp_shifted_avx2(float* s, int64_t n, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float part[8];
  _mm256_store_ps(part, acc);
  float sum = 0;
  for (int i = 0; i < 8; ++i) sum += part[i];
  for (; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
  return sum;
}

// y = silu(g) * u over n floats.
__attribute__((target("avx2,fma"))) void silu_mul_f32_avx2(const float* g, const float* u, int64_t n, float* y) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                          _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) y[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}
#endif

float exp_shifted_portable(float* s, int64_t n, float mx) {
  float sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
  return sum;
}

// ---- rms_norm ------------------------------------------------------------------
template <typename T>
FERRUM_INLINE void rms_row(const T* x, const T* w, int64_t c, float eps, T* y) {
  float ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < c; ++i) ss += load(x[i]) * load(x[i]);
  const float inv = 1.0f / std::sqrt(ss / float(c) + eps);
  if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
    for (int64_t i = 0; i < c; ++i) y[i] = x[i] * inv * w[i];
  } else {  // the eager path: normalise in float32, round, then multiply by the weight
    for (int64_t i = 0; i < c; ++i) y[i] = store<T>(load(store<T>(load(x[i]) * inv)) * load(w[i]));
  }
}

template <typename T>
__attribute__((target("avx2,fma"))) void rms_avx2(const T* x, const T* w, int64_t c, float eps, T* y) {
  rms_row(x, w, c, eps, y);
}
template <typename T>
void rms_portable(const T* x, const T* w, int64_t c, float eps, T* y) { rms_row(x, w, c, eps, y); }

// One row on the loops `avx2` picks (rms_norm's and the decode stack's: the same bits).
template <typename T>
void rms_on(bool avx2, const T* x, const T* w, int64_t c, float eps, T* y) {
  avx2 ? rms_avx2(x, w, c, eps, y) : rms_portable(x, w, c, eps, y);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight dtypes differ");
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.numel(), "rms_norm: weight must match the last dim");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t c = xc.size(-1), rows = xc.numel() / std::max<int64_t>(c, 1);
  const bool avx2 = ferrum_active_isa() >= 1;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, xc.scalar_type(), "rms_norm", [&] {
    const scalar_t *xp = xc.data_ptr<scalar_t>(), *wp = wc.data_ptr<scalar_t>();
    scalar_t* yp = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) rms_on(avx2, xp + r * c, wp, c, float(eps), yp + r * c);
    });
  });
  return out;
}

// ---- silu_mul ------------------------------------------------------------------
template <typename T>
FERRUM_INLINE void silu_mul_row(const T* g, const T* u, int64_t n, T* y) {
  for (int64_t i = 0; i < n; ++i) {
    const float a = load(g[i]);
    y[i] = store<T>(load(store<T>(a / (1.0f + std::exp(-a)))) * load(u[i]));
  }
}
template <typename T>
__attribute__((target("avx2,fma"))) void silu_mul_avx2(const T* g, const T* u, int64_t n, T* y) {
#ifdef FERRUM_X86
  if constexpr (std::is_same_v<T, float>) return silu_mul_f32_avx2(g, u, n, y);
#endif
  silu_mul_row(g, u, n, y);
}
template <typename T>
void silu_mul_portable(const T* g, const T* u, int64_t n, T* y) { silu_mul_row(g, u, n, y); }
// y = silu(g) * u over n elements on the loops `avx2` picks (silu_mul's and the decode stack's).
template <typename T>
void silu_mul_on(bool avx2, const T* g, const T* u, int64_t n, T* y) {
  avx2 ? silu_mul_avx2(g, u, n, y) : silu_mul_portable(g, u, n, y);
}

// gate_up (..., 2n) = [gate | up] -> silu(gate) * up (..., n)
// silu(gate) * up on this file's loops for every row, whatever the row count: one
// arithmetic per row (the batch-invariant mode's; silu_mul's for a few rows).
at::Tensor silu_mul_rows(const at::Tensor& gate_up) {
  const at::Tensor x = gate_up.contiguous();
  const int64_t n2 = x.size(-1), n = n2 / 2, rows = x.numel() / std::max<int64_t>(n2, 1);
  TORCH_CHECK(n2 % 2 == 0, "silu_mul: the last dim must be even");
  auto shape = x.sizes().vec();
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  const bool avx2 = ferrum_active_isa() >= 1;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "silu_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) silu_mul_on(avx2, xp + r * n2, xp + r * n2 + n, n, yp + r * n);
    });
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  const int64_t n2 = gate_up.size(-1), rows = gate_up.numel() / std::max<int64_t>(n2, 1);
  TORCH_CHECK(n2 % 2 == 0, "silu_mul: the last dim must be even");
  if (rows > 4) {  // batches: ATen's vectorised silu and mul (the eager ops, same numbers); few rows: one op here
    const at::Tensor x = gate_up.contiguous();
    return at::mul(at::silu(x.narrow(-1, 0, n2 / 2)), x.narrow(-1, n2 / 2, n2 / 2));
  }
  return silu_mul_rows(gate_up);
}

// ---- paged attention -----------------------------------------------------------
// x (D) rotated by RoPE at one position into y: y = x * cos + rotate_half(x) * sin.
template <typename T>
FERRUM_INLINE void rope(const T* x, const float* cos, const float* sin, int64_t d, float* y) {
  const int64_t h = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) y[i] = load(x[i]) * cos[i] - load(x[i + h]) * sin[i];
#pragma omp simd
  for (int64_t i = h; i < d; ++i) y[i] = load(x[i]) * cos[i] + load(x[i - h]) * sin[i];
}

template <typename T>
FERRUM_INLINE float dot(const float* q, const T* k, int64_t d) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * load(k[i]);
  return s;
}

template <typename T>
FERRUM_INLINE void axpy(float a, const T* v, int64_t d, float* y) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += a * load(v[i]);
}

struct AttnArgs {
  int64_t B, T, H, Hkv, D, bs, nb;
  const int64_t *pos, *tables;
  float scale;
};

// Queries h0..h0+G-1 of (b, t), which share kv head kvh, against keys 0..pos of
// their sequence, read from the pool blocks: each key and value row is read once
// for the G heads (at 32 sequences a layer's K and V outgrow the caches, and a
// row read per head tripled the traffic).  Per head the same operations in the
// same order as one head alone, so the grouping changes no bit.
template <typename T, bool AVX2>
FERRUM_INLINE void attend_group(const AttnArgs& a, const float* q, const T* kc, const T* vc, int64_t b, int64_t t,
                                int64_t kvh, int64_t G, std::vector<float>& scores, std::vector<float>& acc,
                                T* out) {
  const int64_t n = a.pos[b * a.T + t] + 1, D = a.D, row = a.Hkv * D;
  const int64_t* table = a.tables + b * a.nb;
  scores.resize(G * n);
  acc.assign(G * D + G, 0.0f);  // G accumulators of D, then G sums
  for (int64_t j = 0; j < n; ++j) {
    const T* kr = kc + (table[j / a.bs] * a.bs + j % a.bs) * row + kvh * D;
    for (int64_t g = 0; g < G; ++g) scores[g * n + j] = dot(q + g * D, kr, D) * a.scale;
  }
  float* sums = acc.data() + G * D;
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores.data() + g * n;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, sg[j]);
#ifdef FERRUM_X86
    if constexpr (AVX2) {
      sums[g] = exp_shifted_avx2(sg, n, mx);
      continue;
    }
#endif
    sums[g] = exp_shifted_portable(sg, n, mx);
  }
  for (int64_t j = 0; j < n; ++j) {
    const T* vr = vc + (table[j / a.bs] * a.bs + j % a.bs) * row + kvh * D;
    for (int64_t g = 0; g < G; ++g) axpy(scores[g * n + j], vr, D, acc.data() + g * D);
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.0f / sums[g];
    for (int64_t i = 0; i < D; ++i) out[g * D + i] = store<T>(acc[g * D + i] * inv);
  }
}

#ifdef FERRUM_X86
// ---- the same on 256-bit registers (head dims a multiple of 8) ----------------------
template <typename T>
__attribute__((target("avx2,fma"))) inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {  // bfloat16: the bits shifted into place, as load()
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// 8 vectors -> their 8 horizontal sums, in order.
__attribute__((target("avx2,fma"))) inline __m256 hsum8x8(const __m256* s) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// attend_group on registers: scores 8 keys at a time (one sum each, reduced
// together), the value rows into 8 accumulators per 64 dims of a head.  Each
// head on its own, in the same order whatever G is (the grouping changes no bit).
template <typename T>
__attribute__((target("avx2,fma"))) void attend_group_avx2(const AttnArgs& a, const float* q, const T* kc,
                                                           const T* vc, int64_t b, int64_t t, int64_t kvh,
                                                           int64_t G, std::vector<float>& scores,
                                                           std::vector<int64_t>& offs, T* out) {
  const int64_t n = a.pos[b * a.T + t] + 1, D = a.D, row = a.Hkv * D;
  const int64_t* table = a.tables + b * a.nb;
  scores.resize(G * n);
  offs.resize(n);
  for (int64_t j = 0, blk = 0, off = 0; j < n; ++j) {  // key j's row: slot table[j / bs] * bs + j % bs
    offs[j] = (table[blk] * a.bs + off) * row + kvh * D;
    if (++off == a.bs) off = 0, ++blk;
  }
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    float* sg = scores.data() + g * n;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256 s[8];
      for (int r = 0; r < 8; ++r) s[r] = _mm256_setzero_ps();
      for (int64_t i = 0; i < D; i += 8) {
        const __m256 qv = _mm256_loadu_ps(qg + i);
        for (int r = 0; r < 8; ++r) s[r] = _mm256_fmadd_ps(qv, load8(kc + offs[j + r] + i), s[r]);
      }
      _mm256_storeu_ps(sg + j, _mm256_mul_ps(hsum8x8(s), scale));
    }
    for (; j < n; ++j) sg[j] = dot(qg, kc + offs[j], D) * a.scale;
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sg[i]);
    const float inv = 1.0f / exp_shifted_avx2(sg, n, mx);
    for (int64_t c = 0; c < D; c += 64) {
      const int64_t w = std::min<int64_t>(64, D - c) / 8;
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      if (w == 8) {
        for (int64_t k = 0; k < n; ++k) {
          const __m256 p = _mm256_set1_ps(sg[k]);
          const T* vr = vc + offs[k] + c;
          for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(p, load8(vr + 8 * i), acc[i]);
        }
      } else {
        for (int64_t k = 0; k < n; ++k) {
          const __m256 p = _mm256_set1_ps(sg[k]);
          const T* vr = vc + offs[k] + c;
          for (int64_t i = 0; i < w; ++i) acc[i] = _mm256_fmadd_ps(p, load8(vr + 8 * i), acc[i]);
        }
      }
      alignas(32) float tmp[8];
      for (int64_t i = 0; i < w; ++i) {
        _mm256_store_ps(tmp, _mm256_mul_ps(acc[i], _mm256_set1_ps(inv)));
        for (int e = 0; e < 8; ++e) out[g * D + c + 8 * i + e] = store<T>(tmp[e]);
      }
    }
  }
}
#endif

template <typename T>
__attribute__((target("avx2,fma"))) void attend_avx2(const AttnArgs& a, const float* q, const T* kc, const T* vc,
                                                     int64_t b, int64_t t, int64_t kvh, int64_t G,
                                                     std::vector<float>& s, std::vector<float>& acc, T* out) {
  attend_group<T, true>(a, q, kc, vc, b, t, kvh, G, s, acc, out);
}
template <typename T>
void attend_portable(const AttnArgs& a, const float* q, const T* kc, const T* vc, int64_t b, int64_t t, int64_t kvh,
                     int64_t G, std::vector<float>& s, std::vector<float>& acc, T* out) {
  attend_group<T, false>(a, q, kc, vc, b, t, kvh, G, s, acc, out);
}

// The pool's indices checked (positions against cos/sin and the tables, write
// slots and block ids against the pool), as contiguous int64.
struct PagedIndex {
  at::Tensor pos, slots, tab;
};
PagedIndex checked_index(const at::Tensor& positions, const at::Tensor& write_slots, const at::Tensor& tables,
                         int64_t BT, int64_t B, const at::Tensor& cos, const at::Tensor& sin, int64_t D,
                         int64_t blocks, int64_t bs) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "paged_attention: cos/sin must be (positions, D) float32");
  PagedIndex ix{positions.to(at::kLong).contiguous(), write_slots.to(at::kLong).contiguous(),
                tables.to(at::kLong).contiguous()};
  TORCH_CHECK(ix.pos.numel() == BT && ix.slots.numel() == BT && ix.tab.dim() == 2 && ix.tab.size(0) == B,
              "paged_attention: positions/slots/tables shapes");
  const int64_t *pp = ix.pos.data_ptr<int64_t>(), *sp = ix.slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < BT; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < blocks * bs, "paged_attention: write slot out of range");
    TORCH_CHECK(pp[i] >= 0 && pp[i] < cos.size(0) && pp[i] < ix.tab.size(1) * bs,
                "paged_attention: position out of range");
  }
  const int64_t* tp = ix.tab.data_ptr<int64_t>();
  for (int64_t i = 0; i < ix.tab.numel(); ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < blocks, "paged_attention: block id out of range");
  return ix;
}

// Strides of a (B, T, heads, D) tensor with a contiguous last dim.
struct Heads {
  int64_t b, t, h;
};

// RoPE on each (b, t) of [bt0, bt1)'s queries (into qf (B*T, H, D) float32) and
// keys, and those keys and values written into the pool layer (slots sp).
template <typename T>
void rope_and_write(const AttnArgs& a, const T* qp, Heads qs, const T* kp, Heads ks, const T* vp, Heads vs,
                    const float* cp, const float* snp, const int64_t* sp, int64_t bt0, int64_t bt1, float* qfp,
                    T* kc, T* vc) {
  const int64_t H = a.H, Hkv = a.Hkv, D = a.D;
  std::vector<float> tmp(D);
  for (int64_t bt = bt0; bt < bt1; ++bt) {
    const int64_t b = bt / a.T, t = bt % a.T, p = a.pos[bt];
    const float *c = cp + p * D, *s = snp + p * D;
    for (int64_t h = 0; h < H; ++h) rope(qp + b * qs.b + t * qs.t + h * qs.h, c, s, D, qfp + (bt * H + h) * D);
    for (int64_t h = 0; h < Hkv; ++h) {
      rope(kp + b * ks.b + t * ks.t + h * ks.h, c, s, D, tmp.data());
      T* kd = kc + (sp[bt] * Hkv + h) * D;
      T* vd = vc + (sp[bt] * Hkv + h) * D;
      const T* vsrc = vp + b * vs.b + t * vs.t + h * vs.h;
      for (int64_t i = 0; i < D; ++i) {
        kd[i] = store<T>(tmp[i]);
        vd[i] = vsrc[i];
      }
    }
  }
}

// Every (b, t) query's heads over its sequence's blocks: a task per kv head (its
// H / Hkv query heads together), or per query head where that would leave fewer
// than 4 tasks a thread (one short batch: threads balance better).
int64_t attention_group(const AttnArgs& a, int threads) {
  return a.B * a.T * a.Hkv >= 4 * threads ? a.H / a.Hkv : 1;
}
int64_t attention_tasks(const AttnArgs& a, int threads) { return a.B * a.T * (a.H / attention_group(a, threads)); }

// Tasks [begin, end) of attention_tasks (after rope_and_write): out (B*T, H*D).
template <typename T>
void attend_tasks(const AttnArgs& a, int threads, const float* qfp, const T* kc, const T* vc, int64_t begin,
                  int64_t end, T* op) {
  const int64_t H = a.H, Hkv = a.Hkv, D = a.D, T_ = a.T;
  const int64_t G = attention_group(a, threads), per = H / G;
  const bool avx2 = ferrum_active_isa() >= 1, avx2_rows = avx2 && D % 8 == 0;
  std::vector<float> scores, acc;
  std::vector<int64_t> offs;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t bt = i / per, h = (i % per) * G, kvh = h / (H / Hkv);
    const float* qi = qfp + (bt * H + h) * D;
    T* oi = op + (bt * H + h) * D;
#ifdef FERRUM_X86
    if (avx2_rows) attend_group_avx2(a, qi, kc, vc, bt / T_, bt % T_, kvh, G, scores, offs, oi);
    else
#endif
    if (avx2) attend_avx2(a, qi, kc, vc, bt / T_, bt % T_, kvh, G, scores, acc, oi);
    else attend_portable(a, qi, kc, vc, bt / T_, bt % T_, kvh, G, scores, acc, oi);
  }
}

// q (B, T, H, D), k/v (B, T, Hkv, D): any strides but a contiguous last dim.
// cos/sin (max_pos, D) float32; positions (B, T) int64; k_cache/v_cache
// (blocks, block_size, Hkv, D) contiguous, one layer of the pool; write_slots
// (B*T) int64 pool slots for the new keys/values; tables (B, nb) int64 block
// ids.  Writes k (rotated) and v into the pool, then returns the attention
// output (B, T, H*D), each query seeing keys 0..its position.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                           const at::Tensor& sin, const at::Tensor& positions, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& write_slots, const at::Tensor& tables,
                           double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "paged_attention: q, k, v must be (B, T, heads, D)");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3), Hkv = k.size(2);
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "paged_attention: head dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4, "paged_attention: pool layer");
  TORCH_CHECK(k_cache.size(2) == Hkv && k_cache.size(3) == D && H % Hkv == 0, "paged_attention: head shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k.scalar_type() == q.scalar_type() &&
              v.scalar_type() == q.scalar_type(), "paged_attention: dtypes differ");
  const PagedIndex ix = checked_index(positions, write_slots, tables, B * T, B, cos, sin, D, k_cache.size(0), k_cache.size(1));
  at::Tensor out = at::empty({B, T, H * D}, q.options());
  at::Tensor qf = at::empty({B, T, H, D}, q.options().dtype(at::kFloat));
  const AttnArgs args{B, T, H, Hkv, D, k_cache.size(1), ix.tab.size(1), ix.pos.data_ptr<int64_t>(),
                      ix.tab.data_ptr<int64_t>(), float(scale)};
  const int threads = at::get_num_threads();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_attention", [&] {
    using T_ = scalar_t;
    T_ *kc = k_cache.data_ptr<T_>(), *vc = v_cache.data_ptr<T_>();
    // 1. rotate q into float32, rotate k and write it and v into the pool (all writes before any read).
    rope_and_write<T_>(args, q.data_ptr<T_>(), {q.stride(0), q.stride(1), q.stride(2)}, k.data_ptr<T_>(),
                       {k.stride(0), k.stride(1), k.stride(2)}, v.data_ptr<T_>(),
                       {v.stride(0), v.stride(1), v.stride(2)}, cos.data_ptr<float>(), sin.data_ptr<float>(),
                       ix.slots.data_ptr<int64_t>(), 0, B * T, qf.data_ptr<float>(), kc, vc);
    // 2. the queries' heads over their sequences' blocks
    at::parallel_for(0, attention_tasks(args, threads), 1, [&](int64_t begin, int64_t end) {
      attend_tasks<T_>(args, threads, qf.data_ptr<float>(), kc, vc, begin, end, out.data_ptr<T_>());
    });
  });
  return out;
}

// ---- linear_rows: float32 or bfloat16 weights times a few activation rows ---------------
// The batch-1 step's linears (a decode, a verify of a few drafts): oneDNN's packed
// GEMM read 30 layers' float32 weights at ~21 GB/s here and MKL's sgemv at ~12,
// where a GEMV that streams each weight row once, contiguously, reads at the
// memory's speed (30-40 GB/s on the same host, 2 threads).  Each thread takes a
// contiguous range of weight rows; each output is one thread's dot product in a
// fixed order (four chains of 8 lanes over K, then summed, in float32; bfloat16
// rounded once at the end, as the eager linear), so the bits do not depend on
// the thread count or on which rows ride along.
constexpr int64_t kLinearRowsMax = 4;

#ifdef FERRUM_X86
__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// R activation rows (1 or 2) against one weight row: each weight vector is loaded
// (bfloat16: widened) once for the R rows; every row sums in the same order
// whatever R (four chains over K, the rest into the first, then a fixed tree).
template <typename T, int R>
__attribute__((target("avx2,fma"))) inline void dot_rows(const T* w, const T* x, int64_t K, T* y, int64_t ldy) {
  __m256 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m256 w0 = load8(w + k), w1 = load8(w + k + 8), w2 = load8(w + k + 16), w3 = load8(w + k + 24);
    for (int r = 0; r < R; ++r) {
      const T* xr = x + r * K + k;
      a[r][0] = _mm256_fmadd_ps(w0, load8(xr), a[r][0]);
      a[r][1] = _mm256_fmadd_ps(w1, load8(xr + 8), a[r][1]);
      a[r][2] = _mm256_fmadd_ps(w2, load8(xr + 16), a[r][2]);
      a[r][3] = _mm256_fmadd_ps(w3, load8(xr + 24), a[r][3]);
    }
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 w0 = load8(w + k);
    for (int r = 0; r < R; ++r) a[r][0] = _mm256_fmadd_ps(w0, load8(x + r * K + k), a[r][0]);
  }
  for (int r = 0; r < R; ++r) {
    float sum = hsum8(_mm256_add_ps(_mm256_add_ps(a[r][0], a[r][1]), _mm256_add_ps(a[r][2], a[r][3])));
    for (int64_t j = k; j < K; ++j) sum += load(w[j]) * load(x[r * K + j]);
    y[r * ldy] = store<T>(sum);
  }
}

template <typename T>
__attribute__((target("avx2,fma"))) void linear_rows_avx2(const T* x, int64_t M, const T* W, int64_t K,
                                                          int64_t n0, int64_t n1, int64_t N, T* y) {
  for (int64_t n = n0; n < n1; ++n) {
    const T* w = W + n * K;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) dot_rows<T, 2>(w, x + m * K, K, y + m * N + n, N);
    if (m < M) dot_rows<T, 1>(w, x + m * K, K, y + m * N + n, N);
  }
}
#endif

template <typename T>
void linear_rows_portable(const T* x, int64_t M, const T* W, int64_t K, int64_t n0, int64_t n1, int64_t N, T* y) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight chains, summed pairwise: the vectoriser's shape
      const T *w = W + n * K, *xm = x + m * K;
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        for (int l = 0; l < 8; ++l) acc[l] += load(w[k + l]) * load(xm[k + l]);
      float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      for (; k < K; ++k) sum += load(w[k]) * load(xm[k]);
      y[m * N + n] = store<T>(sum);
    }
}

// x (..., K) with at most `max_rows` rows, weight (N, K) contiguous, both float32 or
// both bfloat16 -> (..., N): x @ weight.T, no bias (the caller adds it).  Rows go in
// tiles of `tile` (a tile's activations stay in cache while each weight row is read
// once for it); a tile changes which rows share a weight load, never a row's sums.
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const char* name, int64_t max_rows,
                       int64_t tile) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              name, ": float32 or bfloat16 only, x and weight alike");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), name, ": weight must be (N, K) contiguous");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.size(-1) == K, name, ": activation width ", x.size(-1), " != ", K);
  const at::Tensor x2d = x.reshape({-1, K}).contiguous();
  const int64_t M = x2d.size(0);
  TORCH_CHECK(M <= max_rows, name, ": at most ", max_rows, " rows, got ", M);
  auto shape = x.sizes().vec();
  shape.back() = N;
  at::Tensor out = at::empty({M, N}, x.options());
  const bool avx2 = ferrum_active_isa() >= 1;
  auto run = [&](auto tag) {
    using T_ = decltype(tag);
    const T_ *xp = x2d.data_ptr<T_>(), *wp = weight.data_ptr<T_>();
    T_* yp = out.data_ptr<T_>();
    for (int64_t m0 = 0; m0 < M; m0 += tile) {
      const int64_t rows = std::min(tile, M - m0);
      at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
#ifdef FERRUM_X86
        if (avx2) return linear_rows_avx2<T_>(xp + m0 * K, rows, wp, K, b, e, N, yp + m0 * N);
#endif
        linear_rows_portable<T_>(xp + m0 * K, rows, wp, K, b, e, N, yp + m0 * N);
      });
    }
  };
  if (x.scalar_type() == at::kFloat) run(float{});
  else run(c10::BFloat16{});
  return out.view(shape);
}

// 1-4 rows: the batch-1 step's linears.
at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight) {
  return rows_linear(x, weight, "linear_rows", kLinearRowsMax, kLinearRowsMax);
}

// Any number of rows on the same arithmetic, each output the same dot product in the
// same order whatever else is in the batch (the batch-invariant linear), in tiles of 64.
at::Tensor linear_rows_tiled(const at::Tensor& x, const at::Tensor& weight) {
  return rows_linear(x, weight, "linear_rows_tiled", std::numeric_limits<int64_t>::max(), 64);
}

// ---- a whole decoder layer ----------------------------------------------------------
// One Llama (or Qwen3: qk_norm holds the q/k RMSNorm weights, else empty)
// decoder layer for a decode-sized float32 forward whose projections
// are all our int8/int4 linears: the same ops, in the same order, as
// models/llama.py runs them one Python call at a time (RMSNorm, fused q|k|v,
// paged attention, o, residual, RMSNorm, fused gate|up, silu*up, down,
// residual), so a step makes 30 op calls instead of ~400.  Each weight list is
// [qweight, scales, mins], or [codes, scales] in qact.cpp's packed layout for the
// linears that quantize their activations too, whose widths (8 or 4) bits holds
// negated, digits their activation digits (1: w8a8, w4a8; 2: int8, int4) and
// rotated whether their activations are rotated first (w8a8: qact.cpp rotate16),
// or [weight] (N, K) float32 with bits 32: linear_rows, so 1-4 rows only (bfloat16
// weights and x too where every linear is one of those: the eager path's roundings).
at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& ln1, const at::Tensor& ln2, double eps,
                        at::TensorList qkv, at::TensorList o, at::TensorList gate_up, at::TensorList down,
                        at::IntArrayRef bits, at::IntArrayRef digits, at::IntArrayRef rotated, at::TensorList qk_norm, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& positions, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& write_slots, const at::Tensor& tables, int64_t num_heads,
                        int64_t num_kv_heads, double scale) {
  TORCH_CHECK(bits.size() == 4 && digits.size() == 4 && rotated.size() == 4,
              "decode_layer: bits, digits and rotated have four entries");
  const bool all_rows = bits[0] == 32 && bits[1] == 32 && bits[2] == 32 && bits[3] == 32;
  TORCH_CHECK(x.dim() == 3 && (x.scalar_type() == at::kFloat || (all_rows && x.scalar_type() == at::kBFloat16)),
              "decode_layer: x must be (B, T, C) float32 (or bfloat16 with every linear on linear_rows)");
  TORCH_CHECK(qk_norm.empty() || qk_norm.size() == 2, "decode_layer: qk_norm is [] or [q_norm, k_norm] weights");
  const at::TensorList lists[] = {qkv, o, gate_up, down};
  for (int i = 0; i < 4; ++i)
    TORCH_CHECK(lists[i].size() == (bits[i] == 32 ? 1u : bits[i] < 0 ? 2u : 3u),
                "decode_layer: each linear is [qweight, scales, mins], [codes, scales] with negated bits, "
                "or [weight] with bits 32");
  const int64_t B = x.size(0), T = x.size(1), H = num_heads, Hkv = num_kv_heads, D = k_cache.size(3);
  auto lin = [&](const at::Tensor& in, at::TensorList w, int i) {
    return bits[i] == 32 ? linear_rows(in, w[0])
           : bits[i] < 0 ? ferrum_qact_linear(in, w[0], w[1], -bits[i], digits[i], rotated[i] != 0)
                         : ferrum_woq_linear(in, w[0], w[1], w[2], bits[i]);
  };
  const at::Tensor qkv_out = lin(rms_norm(x, ln1, eps), qkv, 0);  // (B, T, (H + 2 Hkv) D)
  TORCH_CHECK(qkv_out.size(-1) == (H + 2 * Hkv) * D, "decode_layer: q|k|v width does not match the heads");
  at::Tensor q = qkv_out.narrow(-1, 0, H * D).view({B, T, H, D});
  at::Tensor k = qkv_out.narrow(-1, H * D, Hkv * D).view({B, T, Hkv, D});
  if (!qk_norm.empty()) {  // Qwen3: RMSNorm over each head's D before RoPE
    q = rms_norm(q, qk_norm[0], eps);
    k = rms_norm(k, qk_norm[1], eps);
  }
  const at::Tensor v = qkv_out.narrow(-1, (H + Hkv) * D, Hkv * D).view({B, T, Hkv, D});
  const at::Tensor attn = paged_attention(q, k, v, cos, sin, positions, k_cache, v_cache, write_slots, tables, scale);
  at::Tensor h = x + lin(attn, o, 1);
  return h.add_(lin(silu_mul(lin(rms_norm(h, ln2, eps), gate_up, 2)), down, 3));
}

// ---- the decode stack ---------------------------------------------------------------
// A model's layers held once, as decode_layer takes them, and run by one call a
// step.  A Python call per layer cost ~14 us of argument conversion and
// dispatch (30 layers: 0.4 ms of a 5 ms batch-1 step), and each of a layer's
// five parallel loops an OpenMP fork and join.  Where every linear quantizes its
// activations and a step has at most kStackRows rows, the whole step is one
// parallel region: the threads split each linear's weight units and the
// attention's tasks as decode_layer's loops do, and meet at a barrier between
// phases; a row's norm, RoPE and quantization go to the thread that owns the
// row, silu*up and its quantization by blocks.  Each output is the same kernel's
// arithmetic in the same order, so the bits equal decode_layer's.  Otherwise
// (float32 linears, batches) the layers run one decode_layer each, in C++.
constexpr int64_t kStackRows = 4;
constexpr int64_t kPrefetchBytes = 256 << 10;  // of o's weights, behind the attention

struct StackLayer {
  at::Tensor ln1, ln2;
  double eps;
  std::vector<at::Tensor> lin[4];  // qkv, o, gate_up, down: decode_layer's weight lists
  std::array<int64_t, 4> bits, digits, rotated;
  std::vector<at::Tensor> qk_norm;
  ferrum_qact::Packed packed[4];  // where bits < 0
};

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, double scale)
      : H_(num_heads), Hkv_(num_kv_heads), scale_(scale) {
    TORCH_CHECK(H_ > 0 && Hkv_ > 0 && H_ % Hkv_ == 0, "DecodeStack: heads must be a multiple of kv heads");
  }

  void add_layer(at::Tensor ln1, at::Tensor ln2, double eps, std::vector<at::Tensor> qkv, std::vector<at::Tensor> o,
                 std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, std::vector<int64_t> bits,
                 std::vector<int64_t> digits, std::vector<int64_t> rotated, std::vector<at::Tensor> qk_norm) {
    TORCH_CHECK(bits.size() == 4 && digits.size() == 4 && rotated.size() == 4,
                "DecodeStack: bits, digits and rotated have four entries");
    for (at::Tensor& w : qk_norm) w = w.contiguous();  // the one region reads the norms' weights by pointer
    StackLayer L{ln1.contiguous(), ln2.contiguous(), eps, {qkv, o, gate_up, down}, {}, {}, {}, qk_norm, {}};
    bool packed = true;
    for (int i = 0; i < 4; ++i) {
      L.bits[i] = bits[i], L.digits[i] = digits[i], L.rotated[i] = rotated[i];
      TORCH_CHECK(L.lin[i].size() == (bits[i] == 32 ? 1u : bits[i] < 0 ? 2u : 3u),
                  "DecodeStack: each linear is [qweight, scales, mins], [codes, scales] with negated bits, "
                  "or [weight] with bits 32");
      if (bits[i] < 0) L.packed[i] = ferrum_qact::packed(L.lin[i][0], L.lin[i][1], -bits[i]);
      packed = packed && bits[i] < 0 && (digits[i] == 1 || digits[i] == 2) && (!rotated[i] || digits[i] == 1);
    }
    if (packed) {  // the widths the one-region step relies on, alike in every layer
      const int64_t C = ln1.numel(), I = L.packed[3].G * 32, D = L.packed[0].N / (H_ + 2 * Hkv_);
      packed = ln1.scalar_type() == at::kFloat && ln2.scalar_type() == at::kFloat && ln1.dim() == 1 &&
               ln2.dim() == 1 && ln2.numel() == C &&
               L.packed[0].G * 32 == C && L.packed[0].N == (H_ + 2 * Hkv_) * D && L.packed[1].G * 32 == H_ * D &&
               L.packed[1].N == C && L.packed[2].G * 32 == C && L.packed[2].N == 2 * I && L.packed[3].N == C &&
               (qk_norm.empty() || (qk_norm.size() == 2 && qk_norm[0].numel() == D && qk_norm[1].numel() == D &&
                                    qk_norm[0].scalar_type() == at::kFloat && qk_norm[1].scalar_type() == at::kFloat));
      packed = packed && (layers_.empty() || (C == C_ && I == I_ && D == D_));
      C_ = C, I_ = I, D_ = D;
    }
    one_region_ = packed && (layers_.empty() || one_region_);
    layers_.push_back(std::move(L));
  }

  // x (B, T, C) -> (B, T, C) after layers [first, last); k_pool/v_pool (layers,
  // blocks, block_size, Hkv, D), the rest as decode_layer takes them.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                     const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& write_slots,
                     const at::Tensor& tables, int64_t first, int64_t last) {
    TORCH_CHECK(0 <= first && first <= last && last <= size(), "DecodeStack: layers ", first, "..", last, " of ", size());
    TORCH_CHECK(k_pool.dim() == 5 && v_pool.sizes() == k_pool.sizes() && k_pool.size(0) == size(),
                "DecodeStack: the pool must be (layers, blocks, block_size, kv_heads, head_dim)");
    if (one_region_ && x.dim() == 3 && x.scalar_type() == at::kFloat && x.size(0) * x.size(1) <= kStackRows &&
        x.size(2) == C_ && k_pool.size(4) == D_)
      return forward_one_region(x, cos, sin, positions, k_pool, v_pool, write_slots, tables, first, last);
    at::Tensor h = x;
    for (int64_t l = first; l < last; ++l) {
      const StackLayer& L = layers_[l];
      h = decode_layer(h, L.ln1, L.ln2, L.eps, L.lin[0], L.lin[1], L.lin[2], L.lin[3], L.bits, L.digits, L.rotated,
                       L.qk_norm, cos, sin, positions, k_pool.select(0, l), v_pool.select(0, l), write_slots, tables,
                       H_, Hkv_, scale_);
    }
    return h;
  }

  bool one_region() const { return one_region_; }
  int64_t size() const { return int64_t(layers_.size()); }

 private:
  at::Tensor forward_one_region(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                const at::Tensor& positions, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                const at::Tensor& write_slots, const at::Tensor& tables, int64_t first, int64_t last);

  std::vector<StackLayer> layers_;
  int64_t H_, Hkv_, D_ = 0, C_ = 0, I_ = 0;
  double scale_;
  bool one_region_ = false;
};

at::Tensor DecodeStack::forward_one_region(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                           const at::Tensor& positions, const at::Tensor& k_pool,
                                           const at::Tensor& v_pool, const at::Tensor& write_slots,
                                           const at::Tensor& tables, int64_t first, int64_t last) {
  const int64_t B = x.size(0), T = x.size(1), M = B * T, C = C_, I = I_, H = H_, Hkv = Hkv_, D = D_;
  const int64_t Wq = (H + 2 * Hkv) * D;
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.scalar_type() == at::kFloat &&
              v_pool.scalar_type() == at::kFloat && k_pool.size(3) == Hkv, "DecodeStack: pool layers");
  const PagedIndex ix = checked_index(positions, write_slots, tables, M, B, cos, sin, D, k_pool.size(1), k_pool.size(2));
  at::Tensor h = x.contiguous().clone();  // (B, T, C): the residual stream, updated in place
  if (M == 0) return h;
  const int64_t maxK = std::max({C, H * D, I});
  std::vector<float> xn(M * maxK), qkv(M * Wq), qf(M * H * D), gu(M * 2 * I), y(M * C), scratch(M * maxK);
  ferrum_qact::Q8Rows X = ferrum_qact::rows_for(M, maxK, 2);
  const AttnArgs args{B, T, H, Hkv, D, k_pool.size(2), ix.tab.size(1), ix.pos.data_ptr<int64_t>(),
                      ix.tab.data_ptr<int64_t>(), float(scale_)};
  const int64_t layer_floats = k_pool.stride(0), *slots = ix.slots.data_ptr<int64_t>();
  float *hp = h.data_ptr<float>(), *kp = k_pool.data_ptr<float>(), *vp = v_pool.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const bool avx2 = ferrum_active_isa() >= 1;
  const int isa = ferrum_qact::isa_level(), threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    auto mine = [&](int64_t n) { return std::pair<int64_t, int64_t>{n * tid / nt, n * (tid + 1) / nt}; };
    auto rms = [&](const float* in, const at::Tensor& w, int64_t c, double eps, float* out) {
      rms_on(avx2, in, w.data_ptr<float>(), c, float(eps), out);
    };
    // rows of `in` (M, K) quantized for linear i, by the threads that own them
    auto quantize_rows = [&](const StackLayer& L, int i, const float* in, int64_t K) {
      const auto [m0, m1] = mine(M);
      ferrum_qact::quantize_blocks(in, m0 * K / 32, m1 * K / 32, K, int(L.digits[i]), L.rotated[i] != 0, isa, X,
                                   scratch.data());
    };
    // linear i over the quantized rows: this thread's units into out (M, N)
    auto linear = [&](const StackLayer& L, int i, float* out) {
      const auto [u0, u1] = mine(L.packed[i].U);
      ferrum_qact::run_units(isa, L.packed[i], int(-L.bits[i]), u0, u1, X, M, int(L.digits[i]), out);
      return std::pair<int64_t, int64_t>{u0 * 16, std::min(u1 * 16, L.packed[i].N)};
    };
    auto norm_and_quantize = [&](const StackLayer& L, const at::Tensor& w, int i) {  // h's rows for linear i
      const auto [m0, m1] = mine(M);
      for (int64_t m = m0; m < m1; ++m) rms(hp + m * C, w, C, L.eps, xn.data() + m * C);
      quantize_rows(L, i, xn.data(), C);
    };
    auto residual = [&](std::pair<int64_t, int64_t> cols) {  // h += y over this thread's columns
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = cols.first; n < cols.second; ++n) hp[m * C + n] += y[m * C + n];
    };
    for (int64_t l = first; l < last; ++l) {
      const StackLayer& L = layers_[l];
      float *kc = kp + l * layer_floats, *vc = vp + l * layer_floats;
      norm_and_quantize(L, L.ln1, 0);
#pragma omp barrier
      linear(L, 0, qkv.data());
#pragma omp barrier
      {
        // o's weights (a thread's share: ~90 KB on SmolLM2) into L2 while RoPE and the
        // attention run, which leave memory idle: o's phase 206 -> 121 us a step,
        // RoPE's 35 -> 97 (issuing the hints), the step 0.03-0.06 ms shorter, w4a8
        // batch 1 on Zen 4, alternating rounds.  The same at the start of the other
        // linears (32 KB, behind their 1-2 us phases) measured nothing.
        const auto [o0, o1] = mine(L.packed[1].U);
        ferrum_qact::prefetch_units(L.packed[1], int(-L.bits[1]), o0, o1, kPrefetchBytes);
        const auto [m0, m1] = mine(M);
        if (!L.qk_norm.empty())  // Qwen3: RMSNorm over each head's D before RoPE
          for (int64_t m = m0; m < m1; ++m)
            for (int64_t hd = 0; hd < H + Hkv; ++hd) {
              float* head = qkv.data() + m * Wq + hd * D;
              rms(head, L.qk_norm[hd < H ? 0 : 1], D, L.eps, head);
            }
        rope_and_write<float>(args, qkv.data(), {T * Wq, Wq, D}, qkv.data() + H * D, {T * Wq, Wq, D},
                              qkv.data() + (H + Hkv) * D, {T * Wq, Wq, D}, cp, sp, slots, m0, m1, qf.data(), kc, vc);
      }
#pragma omp barrier
      {
        const auto [t0, t1] = mine(attention_tasks(args, threads));
        attend_tasks<float>(args, threads, qf.data(), kc, vc, t0, t1, xn.data());  // xn: (M, H D) now
      }
#pragma omp barrier
      quantize_rows(L, 1, xn.data(), H * D);
#pragma omp barrier
      residual(linear(L, 1, y.data()));
#pragma omp barrier
      norm_and_quantize(L, L.ln2, 2);
#pragma omp barrier
      linear(L, 2, gu.data());
#pragma omp barrier
      {  // silu(gate) * up and its quantization, by blocks of 32
        const auto [b0, b1] = mine(M * I / 32);
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t m = b / (I / 32), c = b % (I / 32) * 32;
          const float* g = gu.data() + m * 2 * I + c;
          silu_mul_on(avx2, g, g + I, 32, xn.data() + m * I + c);
        }
        ferrum_qact::quantize_blocks(xn.data(), b0, b1, I, int(L.digits[3]), L.rotated[3] != 0, isa, X,
                                     scratch.data());
      }
#pragma omp barrier
      residual(linear(L, 3, y.data()));
#pragma omp barrier
    }
  }
  return h;
}

}  // namespace

TORCH_LIBRARY(ferrum_fused, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, double>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("forward", &DecodeStack::forward)
      .def("one_region", &DecodeStack::one_region)
      .def("size", &DecodeStack::size);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("linear_rows(Tensor x, Tensor weight) -> Tensor");
  m.def("linear_rows_tiled(Tensor x, Tensor weight) -> Tensor");
  m.def("silu_mul_rows(Tensor gate_up) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor positions, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor write_slots, Tensor tables, float scale) -> Tensor");
  m.def("decode_layer(Tensor x, Tensor ln1, Tensor ln2, float eps, Tensor[] qkv, Tensor[] o, Tensor[] gate_up, "
        "Tensor[] down, int[] bits, int[] digits, int[] rotated, Tensor[] qk_norm, Tensor cos, Tensor sin, Tensor positions, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor write_slots, Tensor tables, int num_heads, int num_kv_heads, float scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(ferrum_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("linear_rows", &linear_rows);
  m.impl("linear_rows_tiled", &linear_rows_tiled);
  m.impl("silu_mul_rows", &silu_mul_rows);
  m.impl("paged_attention", &paged_attention);
  m.impl("decode_layer", &decode_layer);
}
