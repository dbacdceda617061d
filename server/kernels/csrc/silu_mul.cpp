// silu_mul: silu(gate) * up over a fused gate|up projection, one op for the
// eager path's ~4 (fused.h lists the fused ops); silu_mul_rows: the same loops
// for any number of rows (the batch-invariant mode's).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include "fused.h"

#include <algorithm>
#include <type_traits>

namespace ferrum_fused {
namespace {

#ifdef FERRUM_X86
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

// The same over bfloat16, rounded where the eager path rounds (silu, then the product).
__attribute__((target("avx2,fma"))) void silu_mul_bf16_avx2(const c10::BFloat16* g, const c10::BFloat16* u,
                                                            int64_t n, c10::BFloat16* y) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = load8(g + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
    const __m256i s = bf16_bits(_mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
    store8(y + i, _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(s, 16)), load8(u + i)));
  }
  for (; i < n; ++i) {
    const float a = load(g[i]);
    y[i] = store<c10::BFloat16>(load(store<c10::BFloat16>(a / (1.0f + std::exp(-a)))) * load(u[i]));
  }
}
#endif

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
  if constexpr (std::is_same_v<T, c10::BFloat16>) return silu_mul_bf16_avx2(g, u, n, y);
#endif
  silu_mul_row(g, u, n, y);
}
template <typename T>
void silu_mul_portable(const T* g, const T* u, int64_t n, T* y) { silu_mul_row(g, u, n, y); }

}  // namespace

template <typename T>
void silu_mul_on(bool avx2, const T* g, const T* u, int64_t n, T* y) {
  avx2 ? silu_mul_avx2(g, u, n, y) : silu_mul_portable(g, u, n, y);
}
template void silu_mul_on<float>(bool, const float*, const float*, int64_t, float*);
template void silu_mul_on<c10::BFloat16>(bool, const c10::BFloat16*, const c10::BFloat16*, int64_t, c10::BFloat16*);

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
  const bool avx2 = avx2_on();
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

}  // namespace ferrum_fused

TORCH_LIBRARY_FRAGMENT(ferrum_fused, m) {
  using ferrum_ops::on_cpu;
  m.def("silu_mul(Tensor gate_up) -> Tensor", on_cpu(&ferrum_fused::silu_mul));
  m.def("silu_mul_rows(Tensor gate_up) -> Tensor", on_cpu(&ferrum_fused::silu_mul_rows));
}
