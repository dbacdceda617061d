// linear_rows: float32 or bfloat16 weights times 1-4 activation rows, at memory
// speed; linear_rows_tiled: the same arithmetic over any number of rows (the
// batch-invariant linear before panel_gemm.cpp; kept for bench.panel_gemm's
// comparison).  fused.h lists the fused ops.
//
// The batch-1 step's linears (a decode, a verify of a few drafts): oneDNN's packed
// GEMM and MKL's sgemv read the weights well below the memory's speed, where a GEMV
// that streams each weight row once, contiguously, reads at it (bench.panel_gemm
// compares them).  Each thread takes a
// contiguous range of weight rows; each output is one thread's dot product in a
// fixed order (four chains of 8 lanes over K, then summed, in float32; bfloat16
// rounded once at the end, as the eager linear), so the bits do not depend on
// the thread count or on which rows ride along.  linear_rows_tiled runs 8 rows
// and more on a register-blocked kernel with that same order per output.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <omp.h>
#include <torch/library.h>

#include "fused.h"

#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

namespace ferrum_fused {
namespace {

#ifdef FERRUM_X86
__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The two ways a chain takes its products, a block at a time into 8 float32 lanes.
// Fma8: 8 elements (bfloat16 widened) by fused multiply-adds.  Dot16: 16 bfloat16
// as 8 pairs by the AVX-512 BF16 dot product (each lane adds its pair's two exact
// products in turn), twice the products an instruction; written as inline assembly
// so the loops below compile once for AVX2 and run it only where the CPU has it.
struct Fma8 {
  using E = float;  // what a packed block holds
  using V = __m256;
  static constexpr int64_t kSpan = 8;
  template <typename T>
  __attribute__((target("avx2,fma"))) static FERRUM_INLINE V at(const T* p) { return load8(p); }
  __attribute__((target("avx2,fma"))) static FERRUM_INLINE void put(float* p, V v) { _mm256_storeu_ps(p, v); }
  __attribute__((target("avx2,fma"))) static FERRUM_INLINE V zero() { return _mm256_setzero_ps(); }
  __attribute__((target("avx2,fma"))) static FERRUM_INLINE __m256 madd(V w, V x, __m256 a) {
    return _mm256_fmadd_ps(w, x, a);
  }
};
struct Dot16 {
  using E = c10::BFloat16;
  using V = __m256i;
  static constexpr int64_t kSpan = 16;
  __attribute__((target("avx2,fma"))) static FERRUM_INLINE V at(const c10::BFloat16* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  __attribute__((target("avx2,fma"))) static FERRUM_INLINE void put(c10::BFloat16* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
  }
  __attribute__((target("avx2,fma"))) static FERRUM_INLINE V zero() { return _mm256_setzero_si256(); }
  __attribute__((target("avx2,fma"))) static FERRUM_INLINE __m256 madd(V w, V x, __m256 a) {
    asm("vdpbf16ps %2, %1, %0" : "+v"(a) : "v"(w), "v"(x));
    return a;
  }
};

// Whether bfloat16 linears take Dot16 (the cap allows AVX-512 and the CPU has its
// BF16 dot product); otherwise Fma8.  The two give different bits, as any two
// instruction paths may.
bool dot16_on() {
  const ferrum_cpu::Features& f = ferrum_cpu::cpu_features();
  return f.avx512bf16 && f.avx512vl && ferrum_active_isa() >= 2;
}

// One output's sum from its four chains: (a0 + a1) + (a2 + a3) lane by lane, the
// 8 lanes in hsum8's fixed tree, then the products from k to K one fused
// multiply-add at a time.  Both kernels below end every output here, so a row's
// bits do not depend on which kernel (or which row count) computed it.
template <typename W, typename X>
__attribute__((target("avx2,fma"))) FERRUM_INLINE float finish_tail(float sum, const W* w, const X* x, int64_t k,
                                                                  int64_t K) {
  for (; k < K; ++k)
    sum = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(load(w[k])), _mm_set_ss(load(x[k])), _mm_set_ss(sum)));
  return sum;
}
template <typename W, typename X>
__attribute__((target("avx2,fma"))) FERRUM_INLINE float finish(__m256 a0, __m256 a1, __m256 a2, __m256 a3,
                                                             const W* w, const X* x, int64_t k, int64_t K) {
  return finish_tail(hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))), w, x, k, K);
}

// hsum8 of 8 vectors at once, lane o of the result hsum8(v[o]) bit for bit (the same
// adds of the same pairs, transposed): halves, then lanes 2 apart, then neighbours.
__attribute__((target("avx2,fma"))) FERRUM_INLINE __m256 hsum8x8(const __m256* v) {
  __m256 s[4];
  for (int i = 0; i < 4; ++i)
    s[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[i], v[i + 4], 0x20), _mm256_permute2f128_ps(v[i], v[i + 4], 0x31));
  const __m256 t01 = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], 0x44), _mm256_shuffle_ps(s[0], s[1], 0xEE));
  const __m256 t23 = _mm256_add_ps(_mm256_shuffle_ps(s[2], s[3], 0x44), _mm256_shuffle_ps(s[2], s[3], 0xEE));
  return _mm256_add_ps(_mm256_shuffle_ps(t01, t23, 0x88), _mm256_shuffle_ps(t01, t23, 0xDD));
}

// R activation rows (1 or 2) against one weight row: each weight block is loaded
// once for the R rows.  The order of every output's sum (s = S::kSpan): chain c
// (0-3) takes the block at k = 4 s j + s c for j = 0, 1, ... in turn, chain 0 then
// the blocks past the last whole 4 s, then finish() from there.
template <typename T, typename S, int R>
__attribute__((target("avx2,fma"))) FERRUM_INLINE void dot_rows(const T* w, const T* x, int64_t K, T* y,
                                                               int64_t ldy) {
  constexpr int64_t s = S::kSpan;
  __m256 a[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 4 * s <= K; k += 4 * s) {
    const typename S::V w0 = S::at(w + k), w1 = S::at(w + k + s), w2 = S::at(w + k + 2 * s),
                        w3 = S::at(w + k + 3 * s);
    for (int r = 0; r < R; ++r) {
      const T* xr = x + r * K + k;
      a[r][0] = S::madd(w0, S::at(xr), a[r][0]);
      a[r][1] = S::madd(w1, S::at(xr + s), a[r][1]);
      a[r][2] = S::madd(w2, S::at(xr + 2 * s), a[r][2]);
      a[r][3] = S::madd(w3, S::at(xr + 3 * s), a[r][3]);
    }
  }
  for (; k + s <= K; k += s) {
    const typename S::V w0 = S::at(w + k);
    for (int r = 0; r < R; ++r) a[r][0] = S::madd(w0, S::at(x + r * K + k), a[r][0]);
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = store<T>(finish(a[r][0], a[r][1], a[r][2], a[r][3], w, x + r * K, k, K));
}

template <typename T, typename S>
__attribute__((target("avx2,fma"))) FERRUM_INLINE void rows_range(const T* x, int64_t M, const T* W, int64_t K,
                                                                 int64_t n0, int64_t n1, int64_t N, T* y) {
  for (int64_t n = n0; n < n1; ++n) {
    const T* w = W + n * K;
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) dot_rows<T, S, 2>(w, x + m * K, K, y + m * N + n, N);
    if (m < M) dot_rows<T, S, 1>(w, x + m * K, K, y + m * N + n, N);
  }
}
template <typename T>
__attribute__((target("avx2,fma"))) void linear_rows_avx2(const T* x, int64_t M, const T* W, int64_t K,
                                                          int64_t n0, int64_t n1, int64_t N, T* y) {
  rows_range<T, Fma8>(x, M, W, K, n0, n1, N, y);
}
__attribute__((target("avx2,fma,avx512f,avx512vl"))) void linear_rows_dot16(
    const c10::BFloat16* x, int64_t M, const c10::BFloat16* W, int64_t K, int64_t n0, int64_t n1, int64_t N,
    c10::BFloat16* y) {
  rows_range<c10::BFloat16, Dot16>(x, M, W, K, n0, n1, N, y);
}

// ---- many rows: a register-blocked GEMM with dot_rows' sums -----------------------
// dot_rows loads each weight block for 1-2 rows and holds 4 accumulators a row, so
// at many rows it is bound by loads, not by multiply-adds.  Here a block of MR
// activation rows x NR weight rows shares every load: the NR weight rows are packed
// first (chain by chain, the rows' blocks side by side), then each chain is one pass
// over K with MR x NR accumulators in registers.  The chains are independent sums,
// so running them one after another changes nothing: every output takes its chains'
// blocks in dot_rows' order and ends as finish() ends it (hsum8x8, eight outputs at
// once), the same bits whatever MR, NR or the row count.

// Weight rows [n, n + NR) of W (those past N as zeros) into `panel` (s = S::kSpan):
// chain c's block j of row r at ((c J + j) NR + r) s, then chain 0's blocks past
// 4 s J (e < E) at ((4 J + e) NR + r) s.
template <typename T, typename S, int NR>
__attribute__((target("avx2,fma"))) FERRUM_INLINE void pack_panel(const T* W, int64_t n, int64_t N, int64_t K,
                                                                 int64_t J, int64_t E, typename S::E* panel) {
  constexpr int64_t s = S::kSpan;
  for (int r = 0; r < NR; ++r) {  // each row read in order (the prefetcher's pattern), its blocks scattered
    const T* w = W + (n + r) * K;
    const bool live = n + r < N;
    for (int64_t j = 0; j < J; ++j)
      for (int64_t c = 0; c < 4; ++c)
        S::put(panel + ((c * J + j) * NR + r) * s, live ? S::at(w + 4 * s * j + s * c) : S::zero());
    for (int64_t e = 0; e < E; ++e)
      S::put(panel + ((4 * J + e) * NR + r) * s, live ? S::at(w + 4 * s * J + s * e) : S::zero());
  }
}

// One block: NR packed weight blocks at pw times MR rows' blocks at x (row stride K).
template <typename S, int MR, int NR>
__attribute__((target("avx2,fma"))) FERRUM_INLINE void madd_block(__m256 (&acc)[MR][NR], const typename S::E* pw,
                                                                 const typename S::E* x, int64_t K) {
  typename S::V w[NR];
  for (int r = 0; r < NR; ++r) w[r] = S::at(pw + S::kSpan * r);
  for (int m = 0; m < MR; ++m) {
    const typename S::V xv = S::at(x + m * K);
    for (int r = 0; r < NR; ++r) acc[m][r] = S::madd(w[r], xv, acc[m][r]);
  }
}

// MR rows of xt (row stride K) against a packed panel: out[m][r][c] is chain c of
// output (m, r), as dot_rows' a[m][c] before finish().
template <typename S, int MR, int NR>
__attribute__((target("avx2,fma"))) FERRUM_INLINE void block(const typename S::E* xt, int64_t K,
                                                            const typename S::E* panel, int64_t J, int64_t E,
                                                            __m256 (&out)[MR][NR][4]) {
  constexpr int64_t s = S::kSpan;
  for (int c = 0; c < 4; ++c) {
    __m256 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
    const typename S::E* p = panel + c * J * NR * s;
    for (int64_t j = 0; j < J; ++j) madd_block<S, MR, NR>(acc, p + j * NR * s, xt + 4 * s * j + s * c, K);
    if (c == 0)
      for (int64_t e = 0; e < E; ++e)
        madd_block<S, MR, NR>(acc, panel + (4 * J + e) * NR * s, xt + 4 * s * J + s * e, K);
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) out[m][r][c] = acc[m][r];
  }
}

// Panels [p0, p1) (weight rows [p0 NR, p1 NR) & N) over `rows` rows of xt (S::E,
// zero rows up to a multiple of MR) into y (rows, N).
template <typename T, typename S, int MR, int NR>
__attribute__((target("avx2,fma"))) FERRUM_INLINE void blocked_panels(const typename S::E* xt, int64_t rows,
                                                                     const T* W, int64_t K, int64_t N, int64_t p0,
                                                                     int64_t p1, T* y) {
  constexpr int64_t s = S::kSpan;
  const int64_t J = K / (4 * s), E = (K - 4 * s * J) / s, tail = 4 * s * J + s * E;
  std::vector<typename S::E> panel(size_t(NR * (4 * J + E) * s));
  // the next panel's weight rows are fetched into cache a slice per block, behind the arithmetic
  const char* next_end = reinterpret_cast<const char*>(W + std::min(p1 * NR, N) * K);
  const int64_t lines = (NR * K * int64_t(sizeof(T)) + 63) / 64, per_block = lines / ((rows + MR - 1) / MR) + 1;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n = p * NR;
    pack_panel<T, S, NR>(W, n, N, K, J, E, panel.data());
    const char* next = reinterpret_cast<const char*>(W + (n + NR) * K);
    for (int64_t m = 0; m < rows; m += MR) {
      for (int64_t l = 0; l < per_block && next < next_end; ++l, next += 64) _mm_prefetch(next, _MM_HINT_T1);
      __m256 out[MR][NR][4];
      block<S, MR, NR>(xt + m * K, K, panel.data(), J, E, out);
      constexpr int O = MR * NR, O8 = (O + 7) / 8 * 8;
      __m256 v[O8];
      for (int o = 0; o < O8; ++o) {
        const __m256* a = out[o / NR][o % NR];
        v[o] = o < O ? _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])) : _mm256_setzero_ps();
      }
      float sums[O8];
      for (int o = 0; o < O8; o += 8) _mm256_storeu_ps(sums + o, hsum8x8(v + o));
      for (int i = 0; i < MR && m + i < rows; ++i)
        for (int r = 0; r < NR && n + r < N; ++r)
          y[(m + i) * N + n + r] = store<T>(finish_tail(sums[i * NR + r], W + (n + r) * K, xt + (m + i) * K, tail, K));
    }
  }
}

// The blocks' sizes: AVX2 has 16 vector registers (12 accumulators, 3 weights, a
// row's block), AVX-512VL 32 (the same code, twice the weight rows a block).
constexpr int kBlockRows = 4, kPanelAvx2 = 3, kPanelAvx512 = 6;

template <typename T>
__attribute__((target("avx2,fma"))) void blocked_avx2(const float* xt, int64_t rows, const T* W, int64_t K,
                                                      int64_t N, int64_t p0, int64_t p1, T* y) {
  blocked_panels<T, Fma8, kBlockRows, kPanelAvx2>(xt, rows, W, K, N, p0, p1, y);
}
template <typename T>
__attribute__((target("avx2,fma,avx512f,avx512vl"))) void blocked_avx512(const float* xt, int64_t rows, const T* W,
                                                                         int64_t K, int64_t N, int64_t p0,
                                                                         int64_t p1, T* y) {
  blocked_panels<T, Fma8, kBlockRows, kPanelAvx512>(xt, rows, W, K, N, p0, p1, y);
}
__attribute__((target("avx2,fma,avx512f,avx512vl"))) void blocked_dot16(
    const c10::BFloat16* xt, int64_t rows, const c10::BFloat16* W, int64_t K, int64_t N, int64_t p0, int64_t p1,
    c10::BFloat16* y) {
  blocked_panels<c10::BFloat16, Dot16, kBlockRows, kPanelAvx512>(xt, rows, W, K, N, p0, p1, y);
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

#ifdef FERRUM_X86
// From this many rows the blocked kernel runs (fewer: dot_rows, the same bits).
constexpr int64_t kBlockedMin = 8;

// x2d (M, K) times weight (N, K) into out (M, N) on the blocked kernel: the rows
// copied once as the packed blocks hold them (float32, or bfloat16 for Dot16; zero
// rows up to a multiple of kBlockRows), then in tiles of about kBlockedTileBytes of
// those rows (a tile stays in the core's cache while every panel is packed and read
// for it; larger tiles read the weights fewer times), the threads splitting each
// tile's panels.
constexpr int64_t kBlockedTileBytes = 512 << 10;
at::Tensor& blocked_linear(const at::Tensor& x2d, const at::Tensor& weight, at::Tensor& out) {
  const int64_t M = x2d.size(0), K = x2d.size(1), N = weight.size(0);
  const bool bf16 = weight.scalar_type() == at::kBFloat16, dot16 = bf16 && dot16_on();
  const bool wide = ferrum_active_isa() >= 2 && ferrum_cpu::cpu_features().avx512vl;
  const int64_t padded = (M + kBlockRows - 1) / kBlockRows * kBlockRows;
  at::Tensor xt = at::zeros({padded, K}, x2d.options().dtype(dot16 ? at::kBFloat16 : at::kFloat));
  xt.narrow(0, 0, M).copy_(x2d);
  const int64_t NR = wide || dot16 ? kPanelAvx512 : kPanelAvx2, panels = (N + NR - 1) / NR;
  const int64_t tile = std::max<int64_t>(1, kBlockedTileBytes / (K * int64_t(xt.element_size()) * kBlockRows)) *
                       kBlockRows;
  auto run = [&](auto tag) {
    using T_ = decltype(tag);
    const T_* wp = weight.data_ptr<T_>();
    T_* yp = out.data_ptr<T_>();
    for (int64_t m0 = 0; m0 < M; m0 += tile) {
      const int64_t rows = std::min(tile, M - m0);
      at::parallel_for(0, panels, 1, [&](int64_t b, int64_t e) {
        if constexpr (std::is_same_v<T_, c10::BFloat16>) {
          if (dot16) return blocked_dot16(xt.data_ptr<T_>() + m0 * K, rows, wp, K, N, b, e, yp + m0 * N);
        }
        const float* xp = xt.data_ptr<float>() + m0 * K;
        if (wide) return blocked_avx512<T_>(xp, rows, wp, K, N, b, e, yp + m0 * N);
        blocked_avx2<T_>(xp, rows, wp, K, N, b, e, yp + m0 * N);
      });
    }
  };
  if (bf16) run(c10::BFloat16{});
  else run(float{});
  return out;
}
#endif

// x (..., K) with at most `max_rows` rows and weight (N, K) contiguous, both float32
// or both bfloat16, checked (errors named `name`): x's rows and the output's.
ferrum_ops::Rows checked_rows(const at::Tensor& x, const at::Tensor& weight, const char* name, int64_t max_rows) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              name, ": float32 or bfloat16 only, x and weight alike");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), name, ": weight must be (N, K) contiguous");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.size(-1) == K, name, ": activation width ", x.size(-1), " != ", K);
  ferrum_ops::Rows io = ferrum_ops::rows_of(x, K, N);
  TORCH_CHECK(io.M <= max_rows, name, ": at most ", max_rows, " rows, got ", io.M);
  return io;
}

// Outputs [n0, n1) of `rows` rows on the loops this CPU and the cap allow (dot16:
// dot16_on(), read once by the caller).
template <typename T>
void rows_cols(bool avx2, bool dot16, const T* xp, int64_t rows, const T* wp, int64_t K, int64_t n0, int64_t n1,
               int64_t N, T* yp) {
#ifdef FERRUM_X86
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (dot16) return linear_rows_dot16(xp, rows, wp, K, n0, n1, N, yp);
  }
  if (avx2) return linear_rows_avx2<T>(xp, rows, wp, K, n0, n1, N, yp);
#else
  (void)avx2, (void)dot16;
#endif
  linear_rows_portable<T>(xp, rows, wp, K, n0, n1, N, yp);
}

bool dot16_here() {
#ifdef FERRUM_X86
  return dot16_on();
#else
  return false;
#endif
}

// x (..., K) with at most `max_rows` rows, weight (N, K) contiguous, both float32 or
// both bfloat16 -> (..., N): x @ weight.T, no bias (the caller adds it).  Rows go in
// tiles of `tile` (a tile's activations stay in cache while each weight row is read
// once for it); a tile changes which rows share a weight load, never a row's sums.
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& weight, const char* name, int64_t max_rows,
                       int64_t tile) {
  ferrum_ops::Rows io = checked_rows(x, weight, name, max_rows);
  const int64_t M = io.M, N = weight.size(0), K = weight.size(1);
  const bool avx2 = avx2_on(), dot16 = dot16_here();
#ifdef FERRUM_X86
  if (avx2 && M >= kBlockedMin) {
    blocked_linear(io.x2d, weight, io.out);
    return io.result();
  }
#endif
  auto run = [&](auto tag) {
    using T_ = decltype(tag);
    const T_ *xp = io.x2d.data_ptr<T_>(), *wp = weight.data_ptr<T_>();
    T_* yp = io.out.data_ptr<T_>();
    for (int64_t m0 = 0; m0 < M; m0 += tile) {
      const int64_t rows = std::min(tile, M - m0);
      at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
        rows_cols<T_>(avx2, dot16, xp + m0 * K, rows, wp, K, b, e, N, yp + m0 * N);
      });
    }
  };
  if (x.scalar_type() == at::kFloat) run(float{});
  else run(c10::BFloat16{});
  return io.result();
}


}  // namespace

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight) {
  return rows_linear(x, weight, "linear_rows", kLinearRowsMax, kLinearRowsMax);
}

at::Tensor linear_rows_with(const at::Tensor& x, const at::Tensor& weight, RowsHook& hook) {
  const ferrum_ops::Rows io = checked_rows(x, weight, "linear_rows", kLinearRowsMax);
  const int64_t M = io.M, N = weight.size(0), K = weight.size(1);
  hook.prepare(io.x2d, io.out);
  const bool avx2 = avx2_on(), dot16 = dot16_here();
  // this thread's outputs [n0, n1), as rows_linear's loop body
  auto cols = [&](auto tag, int64_t n0, int64_t n1) {
    using T_ = decltype(tag);
    rows_cols<T_>(avx2, dot16, io.x2d.data_ptr<T_>(), M, weight.data_ptr<T_>(), K, n0, n1, N, io.out.data_ptr<T_>());
  };
  auto body = [&](int tid, int nt) {
    const int64_t n0 = N * tid / nt / 16 * 16, n1 = tid + 1 == nt ? N : N * (tid + 1) / nt / 16 * 16;
    hook.before(tid, nt, n0, n1);
    if (x.scalar_type() == at::kFloat) cols(float{}, n0, n1);
    else cols(c10::BFloat16{}, n0, n1);
    return std::pair<int64_t, int64_t>{n0, n1};
  };
  // rows_linear's split: threads while each takes 64 outputs or more
  const int threads = int(std::min<int64_t>(at::get_num_threads(), N / 64));
  if (threads <= 1 || omp_in_parallel()) {
    body(0, 1);
    hook.after(0, 0, N);
    return io.result();
  }
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
    const auto [n0, n1] = body(tid, omp_get_num_threads());
    if (hook.joins()) {  // the same answer on every thread
#pragma omp barrier
    }
    hook.after(tid, n0, n1);
  }
  return io.result();
}

// Any number of rows on the same arithmetic, each output the same dot product in the
// same order whatever else is in the batch (the batch-invariant linear), in tiles of 64.
at::Tensor linear_rows_tiled(const at::Tensor& x, const at::Tensor& weight) {
  return rows_linear(x, weight, "linear_rows_tiled", std::numeric_limits<int64_t>::max(), 64);
}

}  // namespace ferrum_fused

TORCH_LIBRARY_FRAGMENT(ferrum_fused, m) {
  using ferrum_ops::on_cpu;
  m.def("linear_rows(Tensor x, Tensor weight) -> Tensor", on_cpu(&ferrum_fused::linear_rows));
  m.def("linear_rows_tiled(Tensor x, Tensor weight) -> Tensor", on_cpu(&ferrum_fused::linear_rows_tiled));
}
