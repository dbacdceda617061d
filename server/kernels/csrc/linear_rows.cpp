// linear_rows: float32 or bfloat16 weights times 1-4 activation rows, at memory
// speed; linear_rows_tiled: the same arithmetic over any number of rows (the
// batch-invariant linear).  fused.h lists the fused ops.
//
// The batch-1 step's linears (a decode, a verify of a few drafts): oneDNN's packed
// GEMM read 30 layers' float32 weights at ~21 GB/s here and MKL's sgemv at ~12,
// where a GEMV that streams each weight row once, contiguously, reads at the
// memory's speed (30-40 GB/s on the same host, 2 threads).  Each thread takes a
// contiguous range of weight rows; each output is one thread's dot product in a
// fixed order (four chains of 8 lanes over K, then summed, in float32; bfloat16
// rounded once at the end, as the eager linear), so the bits do not depend on
// the thread count or on which rows ride along.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "fused.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace ferrum_fused {
namespace {

#ifdef FERRUM_X86
__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// One output's sum from its four chains: (a0 + a1) + (a2 + a3) lane by lane, the
// 8 lanes in hsum8's fixed tree, then the last K % 8 products one fused
// multiply-add at a time.  Both kernels below end every output here, so a row's
// bits do not depend on which kernel (or which row count) computed it.
template <typename W, typename X>
__attribute__((target("avx2,fma"))) FERRUM_INLINE float finish(__m256 a0, __m256 a1, __m256 a2, __m256 a3,
                                                             const W* w, const X* x, int64_t k, int64_t K) {
  float sum = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; k < K; ++k)
    sum = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(load(w[k])), _mm_set_ss(load(x[k])), _mm_set_ss(sum)));
  return sum;
}

// R activation rows (1 or 2) against one weight row: each weight vector is loaded
// (bfloat16: widened) once for the R rows.  The order of every output's sum: chain
// c (0-3) takes the 8 lanes at k = 32 j + 8 c for j = 0, 1, ... in turn, chain 0
// then the 8-lane blocks past the last whole 32, then finish().
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
  for (int r = 0; r < R; ++r) y[r * ldy] = store<T>(finish(a[r][0], a[r][1], a[r][2], a[r][3], w, x + r * K, k, K));
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

// ---- many rows: a register-blocked GEMM with dot_rows' sums -----------------------
// dot_rows loads each weight vector for 1-2 rows and holds 4 accumulators a row, so
// at many rows it is bound by loads, not by multiply-adds.  Here a block of MR
// activation rows x NR weight rows shares every load: the NR weight rows are packed
// first (float32, chain by chain, the rows' 8-lane blocks side by side), then each
// chain is one pass over K with MR x NR accumulators in registers.  The chains are
// independent sums, so running them one after another changes nothing: every output
// takes its chains' lanes in dot_rows' order and ends in finish(), the same bits
// whatever MR, NR or the row count.

// Weight rows [n, n + NR) of W (those past N as zeros) into `panel`: chain c's block
// j of row r at ((c J + j) NR + r) 8, then chain 0's blocks past 32 J (e < E) at
// ((4 J + e) NR + r) 8.
template <typename T, int NR>
__attribute__((target("avx2,fma"))) FERRUM_INLINE void pack_panel(const T* W, int64_t n, int64_t N, int64_t K,
                                                                 int64_t J, int64_t E, float* panel) {
  for (int r = 0; r < NR; ++r) {
    const T* w = W + (n + r) * K;
    const bool live = n + r < N;
    for (int64_t c = 0; c < 4; ++c)
      for (int64_t j = 0; j < J; ++j)
        _mm256_storeu_ps(panel + ((c * J + j) * NR + r) * 8, live ? load8(w + 32 * j + 8 * c) : _mm256_setzero_ps());
    for (int64_t e = 0; e < E; ++e)
      _mm256_storeu_ps(panel + ((4 * J + e) * NR + r) * 8, live ? load8(w + 32 * J + 8 * e) : _mm256_setzero_ps());
  }
}

// One 8-lane block: NR packed weight vectors at pw times MR rows' vectors at x (row stride K).
template <int MR, int NR>
__attribute__((target("avx2,fma"))) FERRUM_INLINE void fma_block(__m256 (&acc)[MR][NR], const float* pw,
                                                                const float* x, int64_t K) {
  __m256 w[NR];
  for (int r = 0; r < NR; ++r) w[r] = _mm256_loadu_ps(pw + 8 * r);
  for (int m = 0; m < MR; ++m) {
    const __m256 xv = _mm256_loadu_ps(x + m * K);
    for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_fmadd_ps(w[r], xv, acc[m][r]);
  }
}

// MR rows of xt (float32, row stride K) against a packed panel: out[m][r][c] is chain
// c of output (m, r), as dot_rows' a[m][c] before finish().
template <int MR, int NR>
__attribute__((target("avx2,fma"))) FERRUM_INLINE void block(const float* xt, int64_t K, const float* panel,
                                                            int64_t J, int64_t E, __m256 (&out)[MR][NR][4]) {
  for (int c = 0; c < 4; ++c) {
    __m256 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
    const float* p = panel + c * J * NR * 8;
    for (int64_t j = 0; j < J; ++j) fma_block<MR, NR>(acc, p + j * NR * 8, xt + 32 * j + 8 * c, K);
    if (c == 0)
      for (int64_t e = 0; e < E; ++e) fma_block<MR, NR>(acc, panel + (4 * J + e) * NR * 8, xt + 32 * J + 8 * e, K);
    for (int m = 0; m < MR; ++m)
      for (int r = 0; r < NR; ++r) out[m][r][c] = acc[m][r];
  }
}

// Panels [p0, p1) (weight rows [p0 NR, p1 NR) & N) over `rows` rows of xt (float32,
// zero rows up to a multiple of MR) into y (rows, N).
template <typename T, int MR, int NR>
__attribute__((target("avx2,fma"))) FERRUM_INLINE void blocked_panels(const float* xt, int64_t rows, const T* W,
                                                                     int64_t K, int64_t N, int64_t p0, int64_t p1,
                                                                     T* y) {
  const int64_t J = K / 32, E = (K - 32 * J) / 8, tail = 32 * J + 8 * E;
  std::vector<float> panel(size_t(NR * (4 * J + E) * 8));
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n = p * NR;
    pack_panel<T, NR>(W, n, N, K, J, E, panel.data());
    for (int64_t m = 0; m < rows; m += MR) {
      __m256 out[MR][NR][4];
      block<MR, NR>(xt + m * K, K, panel.data(), J, E, out);
      for (int i = 0; i < MR && m + i < rows; ++i)
        for (int r = 0; r < NR && n + r < N; ++r)
          y[(m + i) * N + n + r] = store<T>(finish(out[i][r][0], out[i][r][1], out[i][r][2], out[i][r][3],
                                                   W + (n + r) * K, xt + (m + i) * K, tail, K));
    }
  }
}

// The blocks' sizes: AVX2 has 16 vector registers (12 accumulators, 3 weights, a
// row's vector), AVX-512VL 32 (the same code, twice the weight rows a block).
constexpr int kBlockRows = 4, kPanelAvx2 = 3, kPanelAvx512 = 6;

template <typename T>
__attribute__((target("avx2,fma"))) void blocked_avx2(const float* xt, int64_t rows, const T* W, int64_t K,
                                                      int64_t N, int64_t p0, int64_t p1, T* y) {
  blocked_panels<T, kBlockRows, kPanelAvx2>(xt, rows, W, K, N, p0, p1, y);
}
template <typename T>
__attribute__((target("avx2,fma,avx512f,avx512vl"))) void blocked_avx512(const float* xt, int64_t rows, const T* W,
                                                                         int64_t K, int64_t N, int64_t p0,
                                                                         int64_t p1, T* y) {
  blocked_panels<T, kBlockRows, kPanelAvx512>(xt, rows, W, K, N, p0, p1, y);
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
// widened to float32 once (zero rows up to a multiple of kBlockRows), then in tiles
// of kBlockedTile rows (a tile stays in the core's cache while every panel is packed
// and read for it), the threads splitting each tile's panels.
constexpr int64_t kBlockedTile = 96;
at::Tensor& blocked_linear(const at::Tensor& x2d, const at::Tensor& weight, at::Tensor& out) {
  const int64_t M = x2d.size(0), K = x2d.size(1), N = weight.size(0);
  const int64_t padded = (M + kBlockRows - 1) / kBlockRows * kBlockRows;
  at::Tensor xt = at::zeros({padded, K}, x2d.options().dtype(at::kFloat));
  xt.narrow(0, 0, M).copy_(x2d);
  const bool wide = ferrum_active_isa() >= 2 && __builtin_cpu_supports("avx512vl");
  const int64_t NR = wide ? kPanelAvx512 : kPanelAvx2, panels = (N + NR - 1) / NR;
  const float* xp = xt.data_ptr<float>();
  auto run = [&](auto tag) {
    using T_ = decltype(tag);
    const T_* wp = weight.data_ptr<T_>();
    T_* yp = out.data_ptr<T_>();
    for (int64_t m0 = 0; m0 < M; m0 += kBlockedTile) {
      const int64_t rows = std::min(kBlockedTile, M - m0);
      at::parallel_for(0, panels, 1, [&](int64_t b, int64_t e) {
        if (wide) return blocked_avx512<T_>(xp + m0 * K, rows, wp, K, N, b, e, yp + m0 * N);
        blocked_avx2<T_>(xp + m0 * K, rows, wp, K, N, b, e, yp + m0 * N);
      });
    }
  };
  if (weight.scalar_type() == at::kFloat) run(float{});
  else run(c10::BFloat16{});
  return out;
}
#endif

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
  const bool avx2 = avx2_on();
#ifdef FERRUM_X86
  if (avx2 && M >= kBlockedMin) return blocked_linear(x2d, weight, out).view(shape);
#endif
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


}  // namespace

at::Tensor linear_rows(const at::Tensor& x, const at::Tensor& weight) {
  return rows_linear(x, weight, "linear_rows", kLinearRowsMax, kLinearRowsMax);
}

// Any number of rows on the same arithmetic, each output the same dot product in the
// same order whatever else is in the batch (the batch-invariant linear), in tiles of 64.
at::Tensor linear_rows_tiled(const at::Tensor& x, const at::Tensor& weight) {
  return rows_linear(x, weight, "linear_rows_tiled", std::numeric_limits<int64_t>::max(), 64);
}

}  // namespace ferrum_fused

TORCH_LIBRARY_FRAGMENT(ferrum_fused, m) {
  m.def("linear_rows(Tensor x, Tensor weight) -> Tensor");
  m.def("linear_rows_tiled(Tensor x, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(ferrum_fused, CPU, m) {
  m.impl("linear_rows", &ferrum_fused::linear_rows);
  m.impl("linear_rows_tiled", &ferrum_fused::linear_rows_tiled);
}
