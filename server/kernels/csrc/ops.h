// What the ops' files share at their edges: a schema registered with its CPU
// kernel (on_cpu), and for the linears, which take activations (..., K) to
// outputs (..., N), the activations as contiguous rows (M, K), an output (M, N)
// for the kernel to fill, and that output in the activations' leading shape.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace ferrum_ops {

// fn as an op's kernel for CPU tensors: m.def(schema, on_cpu(&fn)) defines the op
// and registers its one kernel together.
template <typename F>
torch::CppFunction on_cpu(F* fn) {
  return torch::dispatch(c10::DispatchKey::CPU, fn);
}

struct Rows {
  at::Tensor x2d;  // (M, K), contiguous
  at::Tensor out;  // (M, N), uninitialised, x's dtype and device
  std::vector<int64_t> shape;  // x's shape with N last
  int64_t M;
  at::Tensor result() const { return out.view(shape); }  // out as (..., N)
};

inline Rows rows_of(const at::Tensor& x, int64_t K, int64_t N) {
  Rows r{x.reshape({-1, K}).contiguous(), {}, x.sizes().vec(), 0};
  r.M = r.x2d.size(0);
  r.shape.back() = N;
  r.out = at::empty({r.M, N}, x.options());
  return r;
}

}  // namespace ferrum_ops
