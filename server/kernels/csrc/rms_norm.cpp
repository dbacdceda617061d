// rms_norm: x * rsqrt(mean(x^2) + eps) * weight over the last dim, one op for
// the eager path's ~8 (fused.h lists the fused ops).
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "fused.h"

#include <algorithm>
#include <type_traits>

namespace ferrum_fused {
namespace {

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

}  // namespace

template <typename T>
void rms_on(bool avx2, const T* x, const T* w, int64_t c, float eps, T* y) {
  avx2 ? rms_avx2(x, w, c, eps, y) : rms_portable(x, w, c, eps, y);
}
template void rms_on<float>(bool, const float*, const float*, int64_t, float, float*);
template void rms_on<c10::BFloat16>(bool, const c10::BFloat16*, const c10::BFloat16*, int64_t, float,
                                   c10::BFloat16*);

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight dtypes differ");
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.numel(), "rms_norm: weight must match the last dim");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t c = xc.size(-1), rows = xc.numel() / std::max<int64_t>(c, 1);
  const bool avx2 = avx2_on();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, xc.scalar_type(), "rms_norm", [&] {
    const scalar_t *xp = xc.data_ptr<scalar_t>(), *wp = wc.data_ptr<scalar_t>();
    scalar_t* yp = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) rms_on(avx2, xp + r * c, wp, c, float(eps), yp + r * c);
    });
  });
  return out;
}

}  // namespace ferrum_fused

TORCH_LIBRARY_FRAGMENT(ferrum_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", ferrum_ops::on_cpu(&ferrum_fused::rms_norm));
}
