// The attention's tasks (fused.h: AttnPlan): a block of queries of one sequence,
// one kv head's query heads, over their keys read from the pool blocks.
//
// A query's arithmetic is fixed whatever task holds it: its keys 0..n-1 in chunks
// of kAttnChunk; per chunk and head the scores (a dot product in one order), their
// max m, p = exp(score - m) and their sum l (8 lanes by key, then one tree), the
// values' sum weighted by p (key by key, in key order); the chunks merged in order
// (merge_chunk), then divided by l.  Tasks differ only in which queries and chunks
// they hold, so the bits of a query do not depend on the batch, the other queries
// of its forward, the threads, or whether it is a prompt token or a decode step.
// A block's K and V rows are read once for all its queries and heads: K by 8 rows
// (in L1 while every query's scores take them), V by chunks (in L2).
#include "fused.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace ferrum_fused {
namespace {

constexpr int64_t kC = kAttnChunk;

// The 8 lanes of a sum, in one tree: the same code for every path.
FERRUM_INLINE float sum8(const float* l) {
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

// A chunk's result (m, l, then the D sums) merged into a query head's state, the
// chunks of a query in order.  One compiled copy without a target attribute, for
// every caller: a copy compiled for FMA could contract a * b + c, another not.
__attribute__((noinline)) void merge_chunk(float* state, const float* chunk, int64_t D) {
  const float m = std::max(state[0], chunk[0]);
  const float a = std::exp(state[0] - m), b = std::exp(chunk[0] - m);
  state[0] = m;
  state[1] = state[1] * a + chunk[1] * b;
  for (int64_t i = 0; i < D; ++i) state[2 + i] = state[2 + i] * a + chunk[2 + i] * b;
}

template <typename T>
__attribute__((noinline)) void finish(const float* state, int64_t D, T* out) {
  const float inv = 1.0f / state[1];
  for (int64_t i = 0; i < D; ++i) out[i] = store<T>(state[2 + i] * inv);
}

// ---- portable loops -------------------------------------------------------------------
// s[r] = q . k_r * scale for the 8 rows at offs: each dot in 8 lanes (i mod 8), then sum8.
template <typename T>
void scores8_portable(const float* q, const T* kc, const int64_t* offs, int64_t D, float scale, float* s) {
  for (int r = 0; r < 8; ++r) {
    float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const T* k = kc + offs[r];
    for (int64_t i = 0; i < D; ++i) lanes[i % 8] += q[i] * load(k[i]);
    s[r] = sum8(lanes) * scale;
  }
}

// The chunk of `len` keys: s (its scores, padded to a multiple of 8) -> dst (m, l, sums).
template <typename T>
void chunk_portable(float* s, int64_t len, const T* vc, const int64_t* offs, int64_t D, float* dst) {
  float m = -INFINITY;
  for (int64_t j = 0; j < len; ++j) m = std::max(m, s[j]);
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t j = 0; j < len; ++j) lanes[j % 8] += (s[j] = std::exp(s[j] - m));
  float* acc = dst + 2;
  std::fill(acc, acc + D, 0.0f);
  for (int64_t j = 0; j < len; ++j) {
    const T* v = vc + offs[j];
    for (int64_t i = 0; i < D; ++i) acc[i] += s[j] * load(v[i]);
  }
  dst[0] = m, dst[1] = sum8(lanes);
}

#ifdef FERRUM_X86
// ---- the same on 256-bit registers (head dims a multiple of 8) ------------------------
// 8 vectors -> their 8 horizontal sums, in order (each ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7))).
__attribute__((target("avx2,fma"))) inline __m256 hsum8x8(const __m256* s) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <typename T>
__attribute__((target("avx2,fma"))) inline void scores8_avx2(const float* q, const T* kc, const int64_t* offs,
                                                             int64_t D, float scale, float* s) {
  __m256 acc[8];
  for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(qv, load8(kc + offs[r] + i), acc[r]);
  }
  _mm256_storeu_ps(s, _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale)));
}

// chunk_portable's steps on registers: the exps 8 keys at a time (lanes past len
// hold -inf: exp8 gives 0, which adds nothing), the values 64 dims at a time.
template <typename T>
__attribute__((target("avx2,fma"))) inline void chunk_avx2(float* s, int64_t len, const T* vc, const int64_t* offs,
                                                           int64_t D, float* dst) {
  float m = -INFINITY;
  for (int64_t j = 0; j < len; ++j) m = std::max(m, s[j]);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 lsum = _mm256_setzero_ps();
  for (int64_t j = 0; j < len; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    lsum = _mm256_add_ps(lsum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, lsum);
  for (int64_t c = 0; c < D; c += 64) {
    const int64_t w = std::min<int64_t>(64, D - c) / 8;
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    if (w == 8) {
      for (int64_t j = 0; j < len; ++j) {
        const __m256 p = _mm256_set1_ps(s[j]);
        const T* v = vc + offs[j] + c;
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(p, load8(v + 8 * i), acc[i]);
      }
    } else {
      for (int64_t j = 0; j < len; ++j) {
        const __m256 p = _mm256_set1_ps(s[j]);
        const T* v = vc + offs[j] + c;
        for (int64_t i = 0; i < w; ++i) acc[i] = _mm256_fmadd_ps(p, load8(v + 8 * i), acc[i]);
      }
    }
    for (int64_t i = 0; i < w; ++i) _mm256_storeu_ps(dst + 2 + c + 8 * i, acc[i]);
  }
  dst[0] = m, dst[1] = sum8(lanes);
}
#endif

struct Scratch {
  std::vector<float> state, s, chunk;
  std::vector<int64_t> offs;
};

// One task on the loops VEC picks (the vector ones: float or bfloat16, D a multiple of 8).
template <typename T, bool VEC>
FERRUM_INLINE void task_body(const AttnArgs& a, AttnPlan& plan, const AttnTask& k, const float* qf, const T* kc,
                             const T* vc, Scratch& sc, T* op) {
  const int64_t D = a.D, H = a.H, G = a.H / a.Hkv, row = a.Hkv * D, W = 2 + D;
  const int64_t Gt = k.g1 - k.g0, nq = k.t1 - k.t0, bt0 = k.b * a.T + k.t0;
  const int64_t *table = a.tables + k.b * a.nb, *pos = a.pos + bt0;
  int64_t nmax = 0;
  for (int64_t i = 0; i < nq; ++i) nmax = std::max(nmax, pos[i] + 1);
  sc.state.resize(nq * Gt * W);
  sc.s.resize(nq * Gt * kC);
  sc.chunk.resize(W);
  sc.offs.resize(kC);
  int64_t* offs = sc.offs.data();
  auto query = [&](int64_t i, int64_t g) { return qf + ((bt0 + i) * H + k.kvh * G + k.g0 + g) * D; };
  for (int64_t c = k.c0; c < k.c1; ++c) {
    const int64_t j0 = c * kC, j1 = std::min(j0 + kC, nmax);
    if (j1 <= j0) break;
    // the keys' row offsets, past j1 (to a multiple of 8) key j0's (their scores are masked)
    for (int64_t j = j0; j < j0 + kC && (j < j1 || (j - j0) % 8 != 0); ++j) {
      const int64_t key = j < j1 ? j : j0;
      offs[j - j0] = (table[key / a.bs] * a.bs + key % a.bs) * row + k.kvh * D;
    }
    for (int64_t r = 0; r < j1 - j0; r += 8)  // 8 keys' rows at a time, for every query and head
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t len = std::min(pos[i] + 1, j0 + kC) - j0;
        if (len <= r) continue;
        for (int64_t g = 0; g < Gt; ++g) {
          float* s = sc.s.data() + (i * Gt + g) * kC + r;
#ifdef FERRUM_X86
          if constexpr (VEC) scores8_avx2(query(i, g), kc, offs + r, D, a.scale, s);
          else
#endif
            scores8_portable(query(i, g), kc, offs + r, D, a.scale, s);
          for (int64_t l = std::max<int64_t>(len - r, 0); l < 8; ++l) s[l] = -INFINITY;
        }
      }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t len = std::min(pos[i] + 1, j0 + kC) - j0;
      if (len <= 0) continue;
      for (int64_t g = 0; g < Gt; ++g) {
        float* state = sc.state.data() + (i * Gt + g) * W;
        float* dst = c == k.c0 ? state : sc.chunk.data();
        float* s = sc.s.data() + (i * Gt + g) * kC;
#ifdef FERRUM_X86
        if constexpr (VEC) chunk_avx2(s, len, vc, offs, D, dst);
        else
#endif
          chunk_portable(s, len, vc, offs, D, dst);
        if (c != k.c0) merge_chunk(state, dst, D);
      }
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t n = pos[i] + 1, chunks = (n + kC - 1) / kC;
    if (n <= k.c0 * kC) continue;
    for (int64_t g = 0; g < Gt; ++g) {
      const int64_t h = k.kvh * G + k.g0 + g;
      const float* state = sc.state.data() + (i * Gt + g) * W;
      if (k.c0 == 0 && k.c1 >= chunks) finish(state, D, op + ((bt0 + i) * H + h) * D);
      else std::copy(state, state + W, plan.part.data() + (((bt0 + i) * H + h) * plan.chunks + k.c0) * W);
    }
  }
}

#ifdef FERRUM_X86
template <typename T>
__attribute__((target("avx2,fma"))) void task_avx2(const AttnArgs& a, AttnPlan& plan, const AttnTask& k,
                                                   const float* qf, const T* kc, const T* vc, Scratch& sc, T* op) {
  task_body<T, true>(a, plan, k, qf, kc, vc, sc, op);
}
#endif
template <typename T>
void task_portable(const AttnArgs& a, AttnPlan& plan, const AttnTask& k, const float* qf, const T* kc, const T* vc,
                   Scratch& sc, T* op) {
  task_body<T, false>(a, plan, k, qf, kc, vc, sc, op);
}

}  // namespace

template <typename T>
void attend_tasks(const AttnArgs& a, AttnPlan& plan, const float* qfp, const T* kc, const T* vc, int64_t begin,
                  int64_t end, T* op) {
  thread_local Scratch sc;
  const bool vec = avx2_on() && a.D % 8 == 0;
  for (int64_t i = begin; i < end; ++i) {
#ifdef FERRUM_X86
    if constexpr (!std::is_same_v<T, double>)
      if (vec) {
        task_avx2(a, plan, plan.tasks[i], qfp, kc, vc, sc, op);
        continue;
      }
#endif
    task_portable(a, plan, plan.tasks[i], qfp, kc, vc, sc, op);
  }
}

template <typename T>
void attend_merges(const AttnArgs& a, const AttnPlan& plan, int64_t begin, int64_t end, T* op) {
  const int64_t D = a.D, W = 2 + D;
  std::vector<float> state(W);
  for (int64_t u = begin; u < end; ++u) {
    const int64_t qh = plan.merges[u], n = a.pos[qh / a.H] + 1, chunks = (n + kC - 1) / kC;
    const float* part = plan.part.data() + qh * plan.chunks * W;
    std::copy(part, part + W, state.data());
    for (int64_t c = 1; c < chunks; ++c) merge_chunk(state.data(), part + c * W, D);
    finish(state.data(), D, op + qh * D);
  }
}

#define FERRUM_ATTEND(T)                                                                                          \
  template void attend_tasks<T>(const AttnArgs&, AttnPlan&, const float*, const T*, const T*, int64_t, int64_t, T*); \
  template void attend_merges<T>(const AttnArgs&, const AttnPlan&, int64_t, int64_t, T*);
FERRUM_ATTEND(float)
FERRUM_ATTEND(double)
FERRUM_ATTEND(c10::BFloat16)
#undef FERRUM_ATTEND

}  // namespace ferrum_fused
