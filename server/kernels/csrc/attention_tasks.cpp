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
// (in L1 while every query's scores take them), V by 64 (in L1 while every query's
// sums take them); the vector loops take several query heads at once, so each K or V
// vector loaded feeds an FMA for each: scores for 3 heads in AVX2's 16 registers or 4,
// then 3, in AVX-512's 32, sums for 3, the rest in pairs and alone (attention_loops.inc).  A
// bfloat16 model whose linears take the AVX-512 BF16 dot product takes it here too:
// its query and p rounded to bfloat16, summed in pairs, in an order as fixed
// (attention_dot.inc).  An int8 pool (--kv-dtype int8) runs the float loops on each
// key's elements read as the int8 value times its block's scale, and weights each
// value's blocks by p times the block's scale (each product once, in float32, the
// same on every path): the scales of a row are its own (rope_and_write's), so
// nothing of this depends on the batch either.
#include "fused.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <type_traits>
#include <vector>

namespace ferrum_fused {
namespace {

constexpr int64_t kC = kAttnChunk;
constexpr int64_t kValueRows = 64;  // keys a pass over V takes for every query and head (16 KB in float32)
constexpr int64_t kAhead = 16;      // rows the value loops ask the cache for before they reach them
// how far ahead of the scores the K rows are asked for, in bytes of rows: each row
// once, 4 KB on (64 rows of an int8 pool's dim 64, 32 of bfloat16's, 16 of float32's),
// far enough that a decode step's scores rarely wait on a line
constexpr int64_t kAskBytes = 4096;
constexpr int64_t kAskQueries = 2;  // tasks of at most this many queries ask ahead

// Asks L2 for rows offs[j0..j1) of c (D elements each).  A kv head's row of a key is a
// few lines, consecutive keys' rows a token's width apart and every block elsewhere in
// the pool: without asking, a long context's decode waits on memory most of its time
// (its K and V do not fit the caches), with the cores idle.
template <typename T>
FERRUM_INLINE void prefetch_rows(const T* c, const int64_t* offs, int64_t j0, int64_t j1, int64_t D) {
#ifdef FERRUM_X86
  const int64_t bytes = D * int64_t(sizeof(T));
  if (bytes == 64) {  // a row of one line's bytes (an int8 pool's of dim 64): one ask, no inner loop
    for (int64_t j = j0; j < j1; ++j) _mm_prefetch(reinterpret_cast<const char*>(c + offs[j]), _MM_HINT_T1);
    return;
  }
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(c + offs[j]) + b, _MM_HINT_T1);
#endif
}

// Asks L1 for the K and V scales of an int8 pool's blocks table[b0..b1) (a block's
// rows' scales lie together, every kv head's): gathered a chunk at a time, key by key,
// they waited on memory a line at a time.
FERRUM_INLINE void prefetch_scales(const AttnArgs& a, const int64_t* table, int64_t b0, int64_t b1, int64_t nb) {
#ifdef FERRUM_X86
  const int64_t bytes = a.bs * a.Hkv * nb * int64_t(sizeof(c10::Half));
  for (int64_t b = b0; b < b1; ++b)
    for (const c10::Half* base : {a.k_scale.data, a.v_scale.data}) {
      const char* p = reinterpret_cast<const char*>(base + table[b] * a.bs * a.Hkv * nb);
      for (int64_t x = 0; x < bytes; x += 64) _mm_prefetch(p + x, _MM_HINT_T0);
    }
#endif
}

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

#include "attention_loops.inc"
#include "attention_dot.inc"

// n float16 bits widened (exactly) into out, 8 at a time where the CPU has F16C.
#ifdef FERRUM_X86
__attribute__((target("avx2,f16c"))) void widen_f16c(const uint16_t* bits, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i))));
  for (; i < n; ++i) out[i] = _cvtsh_ss(bits[i]);
}
#endif

void widen(const uint16_t* bits, int64_t n, float* out) {
#ifdef FERRUM_X86
  if (ferrum_cpu::cpu_features().f16c) {
    widen_f16c(bits, n, out);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = float(c10::Half(bits[i], c10::Half::from_bits()));
}

// The nb float16 scales a row (an int8 pool layer's, fused.h KvScales) of rows[0..n)
// into out through bits: row-major (out[j nb + b]), or BlockMajor (out[b kC + j], as the
// integer scores read the key scales).
template <int N, bool BlockMajor>
void gather_scales(const KvScales& s, const int64_t* rows, int64_t n, int64_t nb, uint16_t* bits, float* out) {
  const int64_t NB = N > 0 ? N : nb, js = BlockMajor ? 1 : NB, bs = BlockMajor ? kC : 1;
  const uint16_t* h = reinterpret_cast<const uint16_t*>(s.data);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t b = 0; b < NB; ++b) bits[j * js + b * bs] = h[rows[j] * NB + b];
  if constexpr (!BlockMajor) return widen(bits, n * NB, out);
  for (int64_t b = 0; b < NB; ++b) widen(bits + b * kC, n, out + b * kC);
}

// Each query head's value weights w (len nb): its p[j] times key j's value scales.
template <int N>
void weigh_nb(const float* p, const float* vs, int64_t len, int64_t nb, float* w) {
  const int64_t NB = N > 0 ? N : nb;
  for (int64_t j = 0; j < len; ++j)
    for (int64_t b = 0; b < NB; ++b) w[j * NB + b] = p[j] * vs[j * NB + b];
}

// f(N) for nb scales a row: N == nb for head dims up to 128 (the loops unrolled), else 0.
template <typename F>
void with_nb(int64_t nb, F&& f) {
  switch (nb) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}

struct Scratch {
  std::vector<float> state, s, chunk;
  std::vector<uint16_t> qb, pb;      // the dot product's path: queries and p rounded to bfloat16
  std::vector<const uint16_t*> held_qb;
  std::vector<int64_t> offs, lens, rows;  // rows: an int8 pool's, each key's row (offs / D)
  std::vector<float> key_scale, value_scale;  // an int8 pool's: the chunk's rows' scales (nb a row)
  std::vector<uint16_t> scale_bits;           // and their float16 bits, gathered
  std::vector<float> weights;                 // and each query head's p times its values' scales
  std::vector<float> key_scale_t;             // the integer scores': the key scales block-major (kC a block)
  std::vector<int8_t> qi;                     // and the query heads quantized (quantize_query)
  std::vector<uint8_t> qa;
  std::vector<float> qs;
  std::vector<int32_t> qc;                    // and iscores8_vnni512's corrections and scales
  std::vector<float> qw;
  std::vector<QuantQuery> held_iq;            // the held query heads' quantized queries
  std::vector<int64_t> held;         // the held query heads' queries (their index in the task)
  std::vector<const float*> held_q;  // their query vectors
  std::vector<float*> held_s;        // and their scores
};

#ifdef FERRUM_X86
// Held query heads u.. of sc, N at a time while N are left: their scores for keys r..r+7
// (two tiles of 4 keys: scores_x4, or dot_scores_x4 over their bfloat16 vectors); u
// ends past the last N taken.
template <int N, bool DOT, typename T>
FERRUM_INLINE void score_tiles(Scratch& sc, int64_t& u, int64_t held, int64_t r, const T* kc, const int64_t* offs,
                               int64_t D, float scale, const float* ks, int64_t nb) {
  for (; u + N <= held; u += N) {
    float* s[N];
    for (int h = 0; h < N; ++h) s[h] = sc.held_s[u + h] + r;
    for (int64_t at = r; at < r + 8; at += 4) {
      if constexpr (DOT)
        dot_scores_x4<N>(sc.held_qb.data() + u, reinterpret_cast<const uint16_t*>(kc), offs + at, D, scale, s);
      else
        scores_x4<N>(sc.held_q.data() + u, kc, offs + at, D, scale, s, ks + at * nb, nb);
      for (int h = 0; h < N; ++h) s[h] += 4;
    }
  }
}
#endif

// A query head's partials (its chunks in order) merged into out.
template <typename T>
void merge_partials(const AttnPlan& plan, int64_t qh, int64_t chunks, int64_t D, float* state, T* out) {
  const int64_t W = 2 + D;
  const float* part = plan.part.data() + qh * plan.chunks * W;
  std::copy(part, part + W, state);
  for (int64_t c = 1; c < chunks; ++c) merge_chunk(state, part + c * W, D);
  finish(state, D, out);
}

// A task's queries and heads done: the output where it held all their chunks, else
// its chunk's partial, and where it is its group's last, the group's merges.
template <typename T>
void finish_task(const AttnArgs& a, AttnPlan& plan, const AttnTask& k, Scratch& sc, T* op) {
  const int64_t D = a.D, H = a.H, G = a.H / a.Hkv, W = 2 + D, Gt = k.g1 - k.g0, bt0 = k.b * a.T + k.t0;
  const int64_t* pos = a.pos + bt0;
  for (int64_t i = 0; i < k.t1 - k.t0; ++i) {
    const int64_t n = pos[i] + 1, chunks = (n + kC - 1) / kC;
    if (n <= k.c0 * kC) continue;
    for (int64_t g = 0; g < Gt; ++g) {
      const int64_t qh = (bt0 + i) * H + k.kvh * G + k.g0 + g;
      const float* state = sc.state.data() + (i * Gt + g) * W;
      if (k.c0 == 0 && k.c1 >= chunks) finish(state, D, op + qh * D);
      else std::copy(state, state + W, plan.part.data() + (qh * plan.chunks + k.c0) * W);
    }
  }
  if (k.group < 0) return;
  int64_t group_chunks = 0;  // the group's tasks: one per chunk of its longest query
  for (int64_t i = 0; i < k.t1 - k.t0; ++i) group_chunks = std::max(group_chunks, (pos[i] + kC) / kC);
  std::atomic_ref<int> done(plan.done[k.group]);
  if (done.fetch_add(1, std::memory_order_acq_rel) + 1 != group_chunks) return;
  for (int64_t i = 0; i < k.t1 - k.t0; ++i) {
    const int64_t chunks = (pos[i] + kC) / kC;
    for (int64_t g = 0; g < Gt && chunks > 1; ++g) {
      const int64_t qh = (bt0 + i) * H + k.kvh * G + k.g0 + g;
      merge_partials(plan, qh, chunks, D, sc.chunk.data(), op + qh * D);
    }
  }
  done.store(0, std::memory_order_relaxed);  // the plan serves the next layer (after a barrier)
}

// One task on the loops LEVEL picks: 0 the portable ones, 1 the vector ones (float or
// bfloat16, D a multiple of 8), 2 those and the wider ones for 32 vector registers, 3
// the dot product's (attention_dot.inc: T and P bfloat16, D a multiple of 16).  An int8
// pool's rows of whole blocks (D a multiple of 32) take the integer scores on every
// level: AVX2's byte multiply-adds, or with VNNI its dot product (the same bits).
template <typename T, typename P, int LEVEL, bool VNNI = false>
FERRUM_INLINE void task_body(const AttnArgs& a, AttnPlan& plan, const AttnTask& k, const float* qf, const P* kc,
                             const P* vc, Scratch& sc, T* op) {
  const int64_t D = a.D, H = a.H, G = a.H / a.Hkv, row = a.Hkv * D, W = 2 + D;
  const int64_t Gt = k.g1 - k.g0, nq = k.t1 - k.t0, bt0 = k.b * a.T + k.t0;
  const int64_t *table = a.tables + k.b * a.nb, *pos = a.pos + bt0;
  constexpr bool VEC = LEVEL >= 1, DOT = LEVEL >= 3, INT8 = std::is_same_v<P, int8_t>;
  const int64_t nb = INT8 ? kv_scale_blocks(D) : 0;  // an int8 pool's scales a row
  const bool iq = INT8 && D % kKvScaleBlock == 0;     // the integer scores (attention_loops.inc)
  int64_t nmax = 0;
  for (int64_t i = 0; i < nq; ++i) nmax = std::max(nmax, pos[i] + 1);
  // a decode step's task (a query or two) reads each K and V row once or twice: it asks
  // for them ahead; a prompt's block of queries reuses them from L1 and would only pay
  // for the asking
  const bool ask = VEC && nq <= kAskQueries;
  const int64_t ask_k = std::max<int64_t>(8, kAskBytes / (D * int64_t(sizeof(P))));
  sc.state.resize(nq * Gt * W);
  sc.s.resize(nq * Gt * kC);
  sc.chunk.resize(nq * Gt * W);
  sc.held.resize(nq * Gt);
  sc.held_q.resize(nq * Gt);
  sc.held_s.resize(nq * Gt);
  sc.lens.resize(nq);
  sc.offs.resize(kC);
  if constexpr (INT8) {
    sc.key_scale.resize(kC * nb), sc.value_scale.resize(kC * nb), sc.scale_bits.resize(kC * nb);
    sc.weights.resize(nq * Gt * kC * nb);
    sc.rows.resize(kC);
  }
  int64_t* offs = sc.offs.data();
  auto query = [&](int64_t i, int64_t g) { return qf + ((bt0 + i) * H + k.kvh * G + k.g0 + g) * D; };
  const bool wide_iq = VNNI && D % 64 == 0;  // iscores8_vnni512
  auto quant = [&](int64_t i, int64_t g) {
    const int64_t x = i * Gt + g;
    return QuantQuery{sc.qi.data() + x * D, sc.qa.data() + x * D, sc.qs.data() + x * nb,
                      wide_iq ? sc.qc.data() + x * 8 * nb : nullptr, wide_iq ? sc.qw.data() + x * 8 * nb : nullptr};
  };
  if constexpr (INT8)
    if (iq) {  // the queries quantized once
      sc.key_scale_t.resize(kC * nb);
      sc.qi.resize(nq * Gt * D), sc.qa.resize(nq * Gt * D), sc.qs.resize(nq * Gt * nb);
      sc.held_iq.resize(nq * Gt);
      if (wide_iq) sc.qc.resize(nq * Gt * 8 * nb), sc.qw.resize(nq * Gt * 8 * nb);
      for (int64_t i = 0; i < nq; ++i)
        for (int64_t g = 0; g < Gt; ++g) {
          const QuantQuery x = quant(i, g);
          int8_t* q8 = const_cast<int8_t*>(x.q);
          uint8_t* qa = const_cast<uint8_t*>(x.a);
          float* qs = const_cast<float*>(x.s);
#ifdef FERRUM_X86
          if constexpr (VNNI) {
            quantize_query_512(query(i, g), D, q8, qa, qs, const_cast<int32_t*>(x.c), const_cast<float*>(x.w));
            continue;
          }
#endif
          quantize_query(query(i, g), D, q8, qa, qs);
        }
    }
#ifdef FERRUM_X86
  if constexpr (DOT) {  // the queries rounded once, their p per chunk
    sc.qb.resize(nq * Gt * D);
    sc.pb.resize(nq * Gt * kC);
    sc.held_qb.resize(nq * Gt);
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t g = 0; g < Gt; ++g) dot_round(query(i, g), D, sc.qb.data() + (i * Gt + g) * D);
  }
#endif
  for (int64_t c = k.c0; c < k.c1; ++c) {
    const int64_t j0 = c * kC, j1 = std::min(j0 + kC, nmax);
    if (j1 <= j0) break;
    if constexpr (INT8)
      if (ask) {  // this chunk's and the next one's scales, every block's lines asked at once
        const int64_t table_blocks = (nmax + a.bs - 1) / a.bs;
        prefetch_scales(a, table, j0 / a.bs, std::min((j1 + a.bs - 1) / a.bs, table_blocks), nb);
        prefetch_scales(a, table, std::min(j1, nmax) / a.bs, std::min((j1 + kC + a.bs - 1) / a.bs, table_blocks),
                        nb);
      }
    // the chunk's keys' row offsets, then to a multiple of 8 key j0's (those scores are masked);
    // a pool block at a time, its tokens' slots consecutive (the loop's bounds in locals:
    // through the references the compiler reloaded them at every store)
    {
      const int64_t bs = a.bs, Hkv = a.Hkv, kvh = k.kvh, head = kvh * D;
      int64_t* rows = INT8 ? sc.rows.data() : nullptr;
      for (int64_t j = j0; j < j1;) {
        const int64_t off = j % bs, n = std::min(bs - off, j1 - j), slot = table[j / bs] * bs + off;
        for (int64_t t = 0; t < n; ++t) {
          offs[j - j0 + t] = (slot + t) * row + head;
          if constexpr (INT8) rows[j - j0 + t] = (slot + t) * Hkv + kvh;  // its scales' row
        }
        j += n;
      }
    }
    for (int64_t j = j1 - j0; j % 8 != 0; ++j) offs[j] = offs[0];
    if constexpr (INT8) {  // each key's and value's row's scales
      for (int64_t j = j1 - j0; j % 8 != 0; ++j) sc.rows[j] = sc.rows[0];
      with_nb(nb, [&](auto N) {
        const int64_t n8 = (j1 - j0 + 7) / 8 * 8;
        if (iq) gather_scales<N, true>(a.k_scale, sc.rows.data(), n8, nb, sc.scale_bits.data(), sc.key_scale_t.data());
        else gather_scales<N, false>(a.k_scale, sc.rows.data(), n8, nb, sc.scale_bits.data(), sc.key_scale.data());
        gather_scales<N, false>(a.v_scale, sc.rows.data(), j1 - j0, nb, sc.scale_bits.data(), sc.value_scale.data());
      });
    }
    const float* ks = sc.key_scale.data();
    if (ask) prefetch_rows(kc, offs, 0, std::min(ask_k, j1 - j0), D);
    int64_t* lens = sc.lens.data();  // each query's keys in this chunk (none where <= 0)
    for (int64_t i = 0; i < nq; ++i) lens[i] = std::min(pos[i] + 1, j0 + kC) - j0;
    // the query heads the keys from r on reach (the vector loops take them in pairs): the
    // same set until r reaches held_until, the fewest keys any of them has
    int64_t held = 0, held_until = -1;
    for (int64_t r = 0; r < j1 - j0; r += 8) {  // 8 keys' rows at a time, for every query and head
      // the K rows ask_k on, each asked once (the first ask_k at the chunk's start)
      if (ask) {  // and the same keys' V rows, in L2 by the time the sums take them
        prefetch_rows(kc, offs, std::min(r + ask_k, j1 - j0), std::min(r + 8 + ask_k, j1 - j0), D);
        prefetch_rows(vc, offs, r, std::min(r + 8, j1 - j0), D);
      }
      if (r >= held_until) {
        held = 0, held_until = INT64_MAX;
        for (int64_t i = 0; i < nq; ++i)
          if (lens[i] > r) {
            for (int64_t g = 0; g < Gt; ++g) {
              sc.held_q[held] = query(i, g), sc.held_s[held] = sc.s.data() + (i * Gt + g) * kC;
              if constexpr (DOT) sc.held_qb[held] = sc.qb.data() + (i * Gt + g) * D;
              if constexpr (INT8)
                if (iq) sc.held_iq[held] = quant(i, g);
              sc.held[held++] = i;
            }
            held_until = std::min(held_until, lens[i]);
          }
      }
      int64_t u = 0;
      if constexpr (INT8)
        if (iq) {  // the integer scores: 3 heads a K load (a kv head's query heads), then one
          const int8_t* k8 = reinterpret_cast<const int8_t*>(kc);
          const float* kst = sc.key_scale_t.data() + r;
#ifdef FERRUM_X86
          if constexpr (VNNI)
            if (D % 64 == 0) {
              for (; u + 3 <= held; u += 3) {
                float* s[3] = {sc.held_s[u] + r, sc.held_s[u + 1] + r, sc.held_s[u + 2] + r};
                iscores8_vnni512<3>(sc.held_iq.data() + u, k8, offs + r, D, a.scale, s, kst, kC);
              }
              for (; u < held; ++u) {
                float* s[1] = {sc.held_s[u] + r};
                iscores8_vnni512<1>(sc.held_iq.data() + u, k8, offs + r, D, a.scale, s, kst, kC);
              }
            }
          if constexpr (VEC) {
            for (; u + 3 <= held; u += 3) {
              float* s[3] = {sc.held_s[u] + r, sc.held_s[u + 1] + r, sc.held_s[u + 2] + r};
              if constexpr (VNNI) iscores8_vnni<3>(sc.held_iq.data() + u, k8, offs + r, D, a.scale, s, kst, kC);
              else iscores8_avx2<3>(sc.held_iq.data() + u, k8, offs + r, D, a.scale, s, kst, kC);
            }
            for (; u < held; ++u) {
              float* s[1] = {sc.held_s[u] + r};
              if constexpr (VNNI) iscores8_vnni<1>(sc.held_iq.data() + u, k8, offs + r, D, a.scale, s, kst, kC);
              else iscores8_avx2<1>(sc.held_iq.data() + u, k8, offs + r, D, a.scale, s, kst, kC);
            }
          }
#endif
          for (; u < held; ++u) iscores8_portable(sc.held_iq[u], k8, offs + r, D, a.scale, sc.held_s[u] + r, kst, kC);
        }
#ifdef FERRUM_X86
      // the held query heads' scores for these 8 keys: 4 heads at a time on AVX-512, then
      // 3 (a kv head's 3 query heads read each K vector once), then pairs
      if constexpr (DOT) {
        score_tiles<4, true>(sc, u, held, r, kc, offs, D, a.scale, ks, nb);
        score_tiles<2, true>(sc, u, held, r, kc, offs, D, a.scale, ks, nb);
        score_tiles<1, true>(sc, u, held, r, kc, offs, D, a.scale, ks, nb);
      }
      if constexpr (LEVEL == 2) score_tiles<4, false>(sc, u, held, r, kc, offs, D, a.scale, ks, nb);
      if constexpr (LEVEL == 2) score_tiles<3, false>(sc, u, held, r, kc, offs, D, a.scale, ks, nb);
      if constexpr (LEVEL == 1) score_tiles<3, false>(sc, u, held, r, kc, offs, D, a.scale, ks, nb);
      if constexpr (VEC && !DOT) score_tiles<2, false>(sc, u, held, r, kc, offs, D, a.scale, ks, nb);
#endif
      for (; u < held; ++u) {
#ifdef FERRUM_X86
        if constexpr (VEC) scores8_avx2(sc.held_q[u], kc, offs + r, D, a.scale, sc.held_s[u] + r, ks + r * nb, nb);
        else
#endif
          scores8_portable(sc.held_q[u], kc, offs + r, D, a.scale, sc.held_s[u] + r, ks + r * nb, nb);
      }
      if (r + 8 > held_until)  // some query ends among these keys: the keys past its own -inf (exps 0)
        for (int64_t x = 0; x < held; ++x) {
          const int64_t len = lens[sc.held[x]];
          float* s = sc.held_s[x] + r;
          for (int64_t l = std::max<int64_t>(len - r, 0); l < 8; ++l) s[l] = -INFINITY;
        }
    }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t len = lens[i];
      for (int64_t g = 0; g < Gt && len > 0; ++g) {
        float* s = sc.s.data() + (i * Gt + g) * kC;
#ifdef FERRUM_X86
        if constexpr (LEVEL >= 2) exps_512(s, len, sc.chunk.data() + (i * Gt + g) * W);
        else if constexpr (VEC) exps_avx2(s, len, sc.chunk.data() + (i * Gt + g) * W);
        else
#endif
          exps_portable(s, len, sc.chunk.data() + (i * Gt + g) * W);
#ifdef FERRUM_X86
        // p rounded, an odd len's next one too (exps_avx2 wrote it: 0) for its pair
        if constexpr (DOT) dot_round(s, len + len % 2, sc.pb.data() + (i * Gt + g) * kC);
#endif
        if constexpr (INT8) {  // the value sums' weights: p times each block's scale
          float* w = sc.weights.data() + (i * Gt + g) * kC * nb;
#ifdef FERRUM_X86
          if constexpr (VNNI)
            if (nb == 2) {
              weigh2_512(s, sc.value_scale.data(), len, w);
              continue;
            }
#endif
          with_nb(nb, [&](auto N) { weigh_nb<N>(s, sc.value_scale.data(), len, nb, w); });
        }
      }
    }
    for (int64_t r = 0; r < j1 - j0; r += kValueRows)  // V by sub-chunks (in L1 for every query and head)
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t len = lens[i];
        const int64_t end = std::min(len, r + kValueRows);
        // each key's p, or an int8 pool's weights (nb a key)
        auto p = [&](int64_t g) {
          return INT8 ? sc.weights.data() + (i * Gt + g) * kC * nb : sc.s.data() + (i * Gt + g) * kC;
        };
        auto acc = [&](int64_t g) { return sc.chunk.data() + (i * Gt + g) * W + 2; };
        int64_t g = 0;
#ifdef FERRUM_X86
        if constexpr (DOT) {
          const uint16_t* vb = reinterpret_cast<const uint16_t*>(vc);
          auto pb = [&](int64_t g) { return sc.pb.data() + (i * Gt + g) * kC; };
          for (; g + 3 <= Gt && len > r; g += 3) {
            const uint16_t* ps[3] = {pb(g), pb(g + 1), pb(g + 2)};
            float* accs[3] = {acc(g), acc(g + 1), acc(g + 2)};
            dot_values_n<3>(ps, r, end, vb, offs, D, accs, ask);
          }
          for (; g + 2 <= Gt && len > r; g += 2) {
            const uint16_t* ps[2] = {pb(g), pb(g + 1)};
            float* accs[2] = {acc(g), acc(g + 1)};
            dot_values_n<2>(ps, r, end, vb, offs, D, accs, ask);
          }
          for (; g < Gt && len > r; ++g) {
            const uint16_t* ps[1] = {pb(g)};
            float* accs[1] = {acc(g)};
            dot_values_n<1>(ps, r, end, vb, offs, D, accs, ask);
          }
        }
#ifdef FERRUM_X86
        if constexpr (VNNI)  // an int8 pool's sums on 512-bit registers
          for (; g + 3 <= Gt && len > r && D % 64 == 0; g += 3) {
            const float* ps[3] = {p(g), p(g + 1), p(g + 2)};
            float* accs[3] = {acc(g), acc(g + 1), acc(g + 2)};
            ivalues_512<3>(ps, r, end, reinterpret_cast<const int8_t*>(vc), offs, D, accs, ask, nb);
          }
#endif
        if constexpr (VEC && !DOT)
          for (; g + 3 <= Gt && len > r && D % 32 == 0; g += 3) {
            const float* ps[3] = {p(g), p(g + 1), p(g + 2)};
            float* accs[3] = {acc(g), acc(g + 1), acc(g + 2)};
            if (LEVEL >= 2 && D % 64 == 0) values_x<3, 8>(ps, r, end, vc, offs, D, accs, ask, nb);
            else values_x<3, 4>(ps, r, end, vc, offs, D, accs, ask, nb);
          }
        if constexpr (VEC && !DOT)
          for (; g + 2 <= Gt && len > r && D % 32 == 0; g += 2) {
            const float* ps[2] = {p(g), p(g + 1)};
            float* accs[2] = {acc(g), acc(g + 1)};
            values_x<2, 4>(ps, r, end, vc, offs, D, accs, ask, nb);
          }
#endif
        for (; g < Gt && len > r; ++g) {
#ifdef FERRUM_X86
          if constexpr (VEC) values_avx2(p(g), r, end, vc, offs, D, acc(g), ask, nb);
          else
#endif
            values_portable(p(g), r, end, vc, offs, D, acc(g), nb);
        }
      }
    for (int64_t i = 0; i < nq; ++i) {
      const int64_t len = lens[i];
      for (int64_t g = 0; g < Gt && len > 0; ++g) {
        float *state = sc.state.data() + (i * Gt + g) * W, *chunk = sc.chunk.data() + (i * Gt + g) * W;
        if (c == k.c0) std::copy(chunk, chunk + W, state);
        else merge_chunk(state, chunk, D);
      }
    }
  }
  finish_task(a, plan, k, sc, op);
}

#ifdef FERRUM_X86
template <typename T, typename P>
__attribute__((target("avx2,fma"))) void task_avx2(const AttnArgs& a, AttnPlan& plan, const AttnTask& k,
                                                   const float* qf, const P* kc, const P* vc, Scratch& sc, T* op) {
  task_body<T, P, 1>(a, plan, k, qf, kc, vc, sc, op);
}

template <typename T, typename P>
__attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512bf16"))) void task_dot(
    const AttnArgs& a, AttnPlan& plan, const AttnTask& k, const float* qf, const P* kc, const P* vc, Scratch& sc,
    T* op) {
  task_body<T, P, 3>(a, plan, k, qf, kc, vc, sc, op);
}

// The AVX-512 task over an int8 pool on a CPU with VNNI: its integer scores by the dot product.
template <typename T, typename P>
__attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni"))) void task_vnni(const AttnArgs& a, AttnPlan& plan,
                                                                              const AttnTask& k, const float* qf,
                                                                              const P* kc, const P* vc, Scratch& sc,
                                                                              T* op) {
  task_body<T, P, 2, true>(a, plan, k, qf, kc, vc, sc, op);
}

template <typename T, typename P>
__attribute__((target("avx2,fma,avx512f,avx512vl"))) void task_avx512(const AttnArgs& a, AttnPlan& plan,
                                                                       const AttnTask& k, const float* qf,
                                                                       const P* kc, const P* vc, Scratch& sc,
                                                                       T* op) {
  task_body<T, P, 2>(a, plan, k, qf, kc, vc, sc, op);
}

// Whether the wider loops run: the AVX-512 cap, and the 256-bit forms of its
// instructions (AVX512VL), which reach the 32 registers.
bool wide_on() {
  return ferrum_cpu::cpu_features().avx512vl && ferrum_active_isa() >= 2;
}
#endif
template <typename T, typename P>
void task_portable(const AttnArgs& a, AttnPlan& plan, const AttnTask& k, const float* qf, const P* kc, const P* vc,
                   Scratch& sc, T* op) {
  task_body<T, P, 0>(a, plan, k, qf, kc, vc, sc, op);
}

}  // namespace

template <typename T, typename P>
void attend_tasks(const AttnArgs& a, AttnPlan& plan, const float* qfp, const P* kc, const P* vc, int64_t begin,
                  int64_t end, T* op) {
  thread_local Scratch sc;
  const bool vec = avx2_on() && a.D % 8 == 0;
#ifdef FERRUM_X86
  const bool wide = vec && wide_on();
  // a bfloat16 model's attention on the dot product where its linears take it too
  constexpr bool bf16 = std::is_same_v<T, c10::BFloat16> && std::is_same_v<P, c10::BFloat16>;
  // the loops' 16-bit masks and shuffles take AVX512BW
  const bool dot = bf16 && wide && ferrum_cpu::cpu_features().avx512bw && a.D % 16 == 0 && panel_path(true).dot;
  // an int8 pool's integer scores on VNNI's dot product where the AVX-512 loops run
  constexpr bool int8 = std::is_same_v<P, int8_t>;
  const bool vnni = int8 && wide && ferrum_cpu::cpu_features().avx512vnni && ferrum_cpu::cpu_features().avx512bw;
#endif
  for (int64_t i = begin; i < end; ++i) {
#ifdef FERRUM_X86
    if constexpr (bf16)
      if (dot) {
        task_dot(a, plan, plan.tasks[i], qfp, kc, vc, sc, op);
        continue;
      }
    if constexpr (int8)
      if (vnni) {
        task_vnni(a, plan, plan.tasks[i], qfp, kc, vc, sc, op);
        continue;
      }
    if constexpr (!std::is_same_v<P, double>)
      if (wide) {
        task_avx512(a, plan, plan.tasks[i], qfp, kc, vc, sc, op);
        continue;
      } else if (vec) {
        task_avx2(a, plan, plan.tasks[i], qfp, kc, vc, sc, op);
        continue;
      }
#endif
    task_portable(a, plan, plan.tasks[i], qfp, kc, vc, sc, op);
  }
}

template <typename T, typename P>
void attend_claimed(const AttnArgs& a, AttnPlan& plan, const float* qfp, const P* kc, const P* vc, T* op) {
  std::atomic_ref<int64_t> next(plan.next);
  const int64_t n = int64_t(plan.order.size());
  for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n;
       i = next.fetch_add(1, std::memory_order_relaxed))
    attend_tasks<T, P>(a, plan, qfp, kc, vc, plan.order[i], plan.order[i] + 1, op);
}

template void attend_tasks<float, float>(const AttnArgs&, AttnPlan&, const float*, const float*, const float*,
                                         int64_t, int64_t, float*);
template void attend_tasks<double, double>(const AttnArgs&, AttnPlan&, const float*, const double*, const double*,
                                           int64_t, int64_t, double*);
template void attend_tasks<c10::BFloat16, c10::BFloat16>(const AttnArgs&, AttnPlan&, const float*,
                                                         const c10::BFloat16*, const c10::BFloat16*, int64_t,
                                                         int64_t, c10::BFloat16*);
template void attend_tasks<float, c10::BFloat16>(const AttnArgs&, AttnPlan&, const float*, const c10::BFloat16*,
                                                 const c10::BFloat16*, int64_t, int64_t, float*);

template void attend_tasks<float, int8_t>(const AttnArgs&, AttnPlan&, const float*, const int8_t*, const int8_t*,
                                          int64_t, int64_t, float*);
template void attend_tasks<c10::BFloat16, int8_t>(const AttnArgs&, AttnPlan&, const float*, const int8_t*,
                                                  const int8_t*, int64_t, int64_t, c10::BFloat16*);

template void attend_claimed<float, float>(const AttnArgs&, AttnPlan&, const float*, const float*, const float*,
                                           float*);
template void attend_claimed<double, double>(const AttnArgs&, AttnPlan&, const float*, const double*, const double*,
                                             double*);
template void attend_claimed<c10::BFloat16, c10::BFloat16>(const AttnArgs&, AttnPlan&, const float*,
                                                           const c10::BFloat16*, const c10::BFloat16*,
                                                           c10::BFloat16*);
template void attend_claimed<float, c10::BFloat16>(const AttnArgs&, AttnPlan&, const float*, const c10::BFloat16*,
                                                   const c10::BFloat16*, float*);

template void attend_claimed<float, int8_t>(const AttnArgs&, AttnPlan&, const float*, const int8_t*, const int8_t*,
                                            float*);
template void attend_claimed<c10::BFloat16, int8_t>(const AttnArgs&, AttnPlan&, const float*, const int8_t*,
                                                    const int8_t*, c10::BFloat16*);

}  // namespace ferrum_fused
