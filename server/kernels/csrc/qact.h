// What qact.cpp lends decode_stack.cpp's DecodeStack (one OpenMP region for a
// whole decode step): the quantized activation rows, the packed weights, and
// the two loops a linear is made of, each over a range a thread owns, so the
// stack splits them between its threads itself.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace ferrum_qact {

// Activation rows quantized per block (qact.cpp explains the grid): codes
// (M * digits, K) int8, a step per half block (M, K/16), the value sum per block (M, K/32),
// and for two digits on the AVX2 loops each element's 128 q + q' as one int16 (M, K).
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, sum;  // d: 2 a block (its halves), sum: 1 a block
  std::vector<int16_t> v;     // empty unless rows_for's isa takes it (qact.cpp: wide activations)
};

struct Packed {
  const uint8_t* codes;  // (U, G, 16 * 32 * bits / 8): units of two groups of 8 rows (qact.py pack_rows)
  const void* scales;    // (U, G, 2, 16) float16 or float32: 16 scales, then 16 minimums
  bool half;
  int64_t N, U, G;
};

// The inner loops this CPU runs under the caps (0 portable .. 3 avx512-vnni).
int isa_level();
// Checked views of a packed linear's tensors (all N = 16 U outputs).
Packed packed(const at::Tensor& codes, const at::Tensor& scales, int64_t bits);
// Room for M rows of K, quantized for the inner loops of `isa` (isa_level()).
Q8Rows rows_for(int64_t M, int64_t K, int digits, int isa);
// Blocks [b0, b1) of x (M, K; row m's block g is m K/32 + g) into out, after
// rotate16 into `scratch` (M * K floats, the same blocks) where `rotated`.
// The same codes as quantize_rows, whichever thread quantizes which blocks.
void quantize_blocks(const float* x, int64_t b0, int64_t b1, int64_t K, int digits, bool rotated, int isa,
                     Q8Rows& out, float* scratch);
// Outputs of units [u0, u1) for all M rows: y (M, W.N).
void run_units(int isa, const Packed& W, int bits, int64_t u0, int64_t u1, const Q8Rows& X, int64_t M, int digits,
               float* y);

// Up to `bytes` of units [u0, u1)'s codes, and their scales, fetched into L2
// (prefetch hints; nothing on the portable path): a thread's next linear, while
// it works on something that leaves memory idle.
void prefetch_units(const Packed& W, int bits, int64_t u0, int64_t u1, int64_t bytes);

}  // namespace ferrum_qact
