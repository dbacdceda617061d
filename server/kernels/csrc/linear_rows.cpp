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
#include <torch/library.h>

#include "fused.h"

#include <algorithm>
#include <limits>

namespace ferrum_fused {
namespace {

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
  const bool avx2 = avx2_on();
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
