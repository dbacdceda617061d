// paged_attention: RoPE on q and k, k and v written into the paged pool, and
// causal attention read straight from the pool blocks, one op for the eager
// path's ~25 (fused.h lists the fused ops).  Its pieces (rope_and_write,
// attend_tasks) serve the decode stack's one-region step too.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "fused.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace ferrum_fused {
namespace {

// ---- exp over arrays ----------------------------------------------------------------
#ifdef FERRUM_X86
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
#endif

float exp_shifted_portable(float* s, int64_t n, float mx) {
  float sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
  return sum;
}

// ---- attention over the pool blocks ---------------------------------------------------
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

// Every (b, t) query's heads over its sequence's blocks: a task per kv head (its
// H / Hkv query heads together), or per query head where that would leave fewer
// than 4 tasks a thread (one short batch: threads balance better).
int64_t attention_group(const AttnArgs& a, int threads) {
  return a.B * a.T * a.Hkv >= 4 * threads ? a.H / a.Hkv : 1;
}

}  // namespace

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

template void rope_and_write<float>(const AttnArgs&, const float*, Heads, const float*, Heads, const float*, Heads,
                                    const float*, const float*, const int64_t*, int64_t, int64_t, float*, float*,
                                    float*);

int64_t attention_tasks(const AttnArgs& a, int threads) { return a.B * a.T * (a.H / attention_group(a, threads)); }

template <typename T>
void attend_tasks(const AttnArgs& a, int threads, const float* qfp, const T* kc, const T* vc, int64_t begin,
                  int64_t end, T* op) {
  const int64_t H = a.H, Hkv = a.Hkv, D = a.D, T_ = a.T;
  const int64_t G = attention_group(a, threads), per = H / G;
  const bool avx2 = avx2_on(), avx2_rows = avx2 && D % 8 == 0;
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
template void attend_tasks<float>(const AttnArgs&, int, const float*, const float*, const float*, int64_t, int64_t,
                                  float*);

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

}  // namespace ferrum_fused

TORCH_LIBRARY_FRAGMENT(ferrum_fused, m) {
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor positions, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor write_slots, Tensor tables, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(ferrum_fused, CPU, m) {
  m.impl("paged_attention", &ferrum_fused::paged_attention);
}
