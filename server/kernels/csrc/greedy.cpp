// greedy_rows: what a greedy token choice reads of each row of float32 logits, in
// one read of the row and one exp a logit, where the torch ops took ~10 passes (and
// a fork of the thread team each) a decode step (fused.h lists the fused ops).
//
// For each row: its largest value, the first index holding it, its smallest value
// and its log-normaliser max + log(sum(exp(x - max))).  A NaN anywhere makes the
// row's largest, smallest and normaliser NaN (as amax and amin give them).  Each
// row's sum runs in one fixed order (8 lanes over the row, the tail after, the lanes
// added in a fixed tree), so a row's results do not depend on the other rows or
// the threads; the AVX2 loops' exp (exp8) and the portable loop's (std::exp)
// differ in the last bits, as any two instruction paths may.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "fused.h"

#include <limits>
#include <tuple>

namespace ferrum_fused {
namespace {

struct RowStats {
  float largest, smallest, log_norm;
  int64_t first;
};

FERRUM_INLINE float lanes_sum(const float* s) { return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])); }

FERRUM_INLINE RowStats nan_row() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  return {nan, nan, nan, 0};
}

RowStats row_portable(const float* x, int64_t V) {
  float hi = -std::numeric_limits<float>::infinity(), lo = std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < V; ++i) {
    if (std::isnan(x[i])) return nan_row();
    hi = std::max(hi, x[i]);
    lo = std::min(lo, x[i]);
  }
  int64_t first = 0;
  while (x[first] != hi) ++first;
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0}, tail = 0;
  int64_t i = 0;
  for (; i + 8 <= V; i += 8)
    for (int l = 0; l < 8; ++l) s[l] += std::exp(x[i + l] - hi);
  for (; i < V; ++i) tail += std::exp(x[i] - hi);
  return {hi, lo, hi + std::log(lanes_sum(s) + tail), first};
}

#ifdef FERRUM_X86
__attribute__((target("avx2,fma"))) RowStats row_avx2(const float* x, int64_t V) {
  const float inf = std::numeric_limits<float>::infinity();
  __m256 hi8 = _mm256_set1_ps(-inf), lo8 = _mm256_set1_ps(inf), nan8 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    hi8 = _mm256_max_ps(hi8, v);
    lo8 = _mm256_min_ps(lo8, v);
  }
  if (_mm256_movemask_ps(nan8)) return nan_row();
  alignas(32) float h[8], m[8];
  _mm256_store_ps(h, hi8);
  _mm256_store_ps(m, lo8);
  float hi = -inf, lo = inf;
  for (int l = 0; l < 8; ++l) hi = std::max(hi, h[l]), lo = std::min(lo, m[l]);
  for (; i < V; ++i) {
    if (std::isnan(x[i])) return nan_row();
    hi = std::max(hi, x[i]);
    lo = std::min(lo, x[i]);
  }
  int64_t first = 0;
  const __m256 top = _mm256_set1_ps(hi);
  for (; first + 8 <= V; first += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + first), top, _CMP_EQ_OQ));
    if (hit) {
      first += __builtin_ctz(unsigned(hit));
      break;
    }
  }
  while (x[first] != hi) ++first;  // past the vector loop: the tail
  __m256 acc = _mm256_setzero_ps();
  float tail = 0;
  i = 0;
  for (; i + 8 <= V; i += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), top)));
  for (; i < V; ++i) tail += std::exp(x[i] - hi);
  alignas(32) float s[8];
  _mm256_store_ps(s, acc);
  return {hi, lo, hi + std::log(lanes_sum(s) + tail), first};
}
#endif

}  // namespace

// x (R, V) float32, V >= 1 -> (first index of each row's largest (R,) int64, largest (R,),
// smallest (R,), log-normaliser (R,)).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> greedy_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "greedy_rows: x must be (rows, vocab) float32 with vocab >= 1");
  const at::Tensor xc = x.contiguous();
  const int64_t R = xc.size(0), V = xc.size(1);
  at::Tensor first = at::empty({R}, xc.options().dtype(at::kLong));
  at::Tensor largest = at::empty({R}, xc.options()), smallest = at::empty({R}, xc.options()),
             log_norm = at::empty({R}, xc.options());
  const float* xp = xc.data_ptr<float>();
  int64_t* fp = first.data_ptr<int64_t>();
  float *hp = largest.data_ptr<float>(), *lp = smallest.data_ptr<float>(), *np = log_norm.data_ptr<float>();
  const bool avx2 = avx2_on();
  // a row is ~V / 8 vector steps: a few rows stay on the calling thread (no fork)
  at::parallel_for(0, R, std::max<int64_t>(1, (int64_t(1) << 18) / V), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
#ifdef FERRUM_X86
      const RowStats s = avx2 ? row_avx2(xp + r * V, V) : row_portable(xp + r * V, V);
#else
      const RowStats s = row_portable(xp + r * V, V);
#endif
      fp[r] = s.first, hp[r] = s.largest, lp[r] = s.smallest, np[r] = s.log_norm;
    }
  });
  return {first, largest, smallest, log_norm};
}

}  // namespace ferrum_fused

TORCH_LIBRARY_FRAGMENT(ferrum_fused, m) {
  m.def("greedy_rows(Tensor x) -> (Tensor, Tensor, Tensor, Tensor)", ferrum_ops::on_cpu(&ferrum_fused::greedy_rows));
}
