// Quantized linears that multiply in integers (--quantize w8a8|w4a8): weights in
// blocks of 32 along the input with a scale and a minimum, w = code * s + m
// (woq.py's int4 and int8 grids: GGUF's Q4_1 and Q8_0 blocks held without
// loss; scales and minimums in float16 where that loses nothing, as GGUF keeps
// them, else float32), and activation rows
// quantized to int8 on each call, a step per half block of 16 (llama.cpp's
// Q8_1 has one per 32): x ~ q * d_h, q in -127..127, with sum = sum_h d_h sum(q).
// One block's contribution is
//
//     sum_i (c_i s + m) (q_i d_h(i)) = s * sum_h d_h sum_{i in h} c_i q_i  +  m * sum
//
// an integer dot product of 16 bytes per half, two float multiply-adds for
// the steps and the scale and one for the minimum.
//
// Layout (qact.py's pack_rows): weight rows in groups of 8, interleaved per
// block, as llama.cpp's repacked Q4_0x8: one 32-byte register holds 4
// consecutive codes of each of the 8 rows (a 32-bit lane per row), so one
// broadcast of 4 activation codes and one vpdpbusd make 32 multiply-adds into
// 8 rows' sums; a block of 8 rows is 8 such registers (4-bit: 4 loads, each
// split into low and high nibbles), its 8 scales and 8 minimums one vector
// each.  Per block and activation row that is 8 dot instructions, two
// conversions and four float multiply-adds for 256 multiply-adds; the weights are never
// expanded to float, at any batch size, and a group's weights (a few KB) stay
// in L1 while every activation row passes (tiles of 4 rows).  Groups are stored
// in pairs (units of 16 rows) whose 32-byte words alternate, so the AVX-512 loops
// take word k of 16 rows in one 512-bit load, and a unit's weights are one
// contiguous stream for either register width.
//
// Inner loops (qact_tile.inc, one source compiled per instruction set), probed
// once and capped by ferrum_qact::set_max_isa so tests run every one this CPU has:
//   avx512-vnni  vpdpbusd on 512-bit registers, a unit of 16 rows at a time
//   avx-vnni     the same instruction, VEX-encoded (AVX-VNNI, on AVX2 CPUs)
//   avx2         two digits and 8-bit codes: each activation as one int16 (128 q + q',
//                or q) by vpmaddwd against codes widened to int16 once per block for
//                all rows (tile_wide: the VNNI loops' sums and bits); 4-bit codes with
//                one digit: vpmaddubsw + vpmaddwd, int16 sums over a whole block
//                (<= 16 * 15 * 127)
//   portable     C++ integer sums per block (the same numbers up to float
//                summation order)
// Activation rows are quantized by 256-bit vector loops on every x86 path (the
// same codes as the portable loop, whose libm nearbyint per element took half
// the time of a 32-row down projection).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_features.h"
#include "qact.h"
#include "ops.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FERRUM_X86 1
#endif


namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kLanes = 8;  // weight rows interleaved per block and 256-bit register
constexpr int64_t kUnit = 16;  // rows stored together: two groups, one 512-bit register

// Activation rows quantized per block: codes (M * digits, K) int8, per row and
// half block (16 elements) a step d (M, K/16), and per block the value sum the
// codes stand for (M, K/32).  One digit (w8a8, w4a8): each half block on its own
// grid, x ~ q d, q in -127..127, d = amax / 127 of its 16 elements (llama.cpp's
// Q8_1 shares one over 32; halves cut the grid's error where one element of a
// block dwarfs the rest, which raises top-1 agreement with float32:
// `bench.quant_accuracy --grids` compares the grids).  The kernels' two chains of 4 dot
// instructions already split a block's 32 codes into halves, so a half costs
// one conversion and one FMA per row and block more, no dot instruction.  Two
// digits (the int8/int4 modes): one step per block, stored in both halves; row
// m's codes are rows 2m (q, as one digit) and 2m + 1 (q', the remainder x - q d
// on a grid 128 times finer, |q'| <= 64), x ~ (128 q + q') d / 128 with
// |error| <= amax / 32512: about 15 bits instead of 8.  The kernels sum
// 128 * dot(w, q) + dot(w, q') in integers, so a second digit costs a row's dot
// instructions and nothing else.
using ferrum_qact::Q8Rows;  // qact.h

constexpr int64_t kHalf = kBlock / 2;

// Blocks [b0, b1) of x (row m's block g is b = m G + g) into out, one at a time.
void quantize_portable(const float* x, int64_t b0, int64_t b1, int64_t G, int digits, Q8Rows& out) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t m = b / G, g = b % G;
    const float* xb = x + b * kBlock;
    int8_t* qb = out.q.data() + ((m * digits) * G + g) * kBlock;
    float amax[2] = {0, 0};  // of each half
    for (int i = 0; i < kBlock; ++i) amax[i / kHalf] = std::max(amax[i / kHalf], std::fabs(xb[i]));
    if (digits == 2) amax[0] = amax[1] = std::max(amax[0], amax[1]);  // one grid a block
    float d[2], inv[2];
    int sum[2] = {0, 0};
    for (int h = 0; h < 2; ++h) d[h] = amax[h] / 127.0f, inv[h] = d[h] > 0 ? 1.0f / d[h] : 0.0f;
    for (int i = 0; i < kBlock; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * inv[i / kHalf]));  // |v| <= 127 by construction
      qb[i] = static_cast<int8_t>(v);
      sum[i / kHalf] += v;
    }
    float total = d[0] * float(sum[0]) + d[1] * float(sum[1]);
    if (digits == 2) {
      int8_t* lo = qb + G * kBlock;
      int rest = 0;
      for (int i = 0; i < kBlock; ++i) {
        const float r = xb[i] - float(qb[i]) * d[0];  // |r| <= d / 2 up to rounding
        const int v = std::clamp(static_cast<int>(std::nearbyint(r * inv[0] * 128.0f)), -127, 127);
        lo[i] = static_cast<int8_t>(v);
        rest += v;
      }
      total += d[0] / 128.0f * float(rest);
    }
    out.d[2 * b] = d[0];
    out.d[2 * b + 1] = d[1];
    out.sum[b] = total;
  }
}

using ferrum_qact::Packed;  // qact.h

// ---- portable ----------------------------------------------------------------
// Code i (0..31) of lane r of half h in one (unit, block) of the packed layout:
// word k of half h is the 32 bytes at (2k + h) * 32, lane r's 4 bytes at 4r.
inline int code_at(const uint8_t* blk, int bits, int h, int r, int i) {
  if (bits == 4) {
    const uint8_t byte = blk[(((i % 16) / 4) * 2 + h) * 32 + r * 4 + i % 4];
    return i < 16 ? byte & 0xF : byte >> 4;
  }
  return blk[((i / 4) * 2 + h) * 32 + r * 4 + i % 4];
}

inline float scale_at(const Packed& W, int64_t i) {
  if (W.half) return float(c10::Half(static_cast<const uint16_t*>(W.scales)[i], c10::Half::from_bits()));
  return static_cast<const float*>(W.scales)[i];
}

void groups_portable(const Packed& W, int bits, int64_t u0, int64_t u1, const Q8Rows& X, int64_t M, int digits,
                     float* y) {
  const int64_t bytes = 2 * kLanes * kBlock * bits / 8;  // a unit's block
  for (int64_t j = 2 * u0; j < 2 * u1 && j * kLanes < W.N; ++j) {
    const int64_t u = j / 2, h = j % 2;
    const int lanes = int(std::min<int64_t>(kLanes, W.N - j * kLanes));
    for (int64_t r = 0; r < M; ++r) {
      for (int lane = 0; lane < lanes; ++lane) {
        float acc = 0;
        for (int64_t g = 0; g < W.G; ++g) {
          const uint8_t* blk = W.codes + (u * W.G + g) * bytes;
          const int64_t sc = (u * W.G + g) * 4 * kLanes + h * kLanes;
          const int64_t xb = r * W.G + g;
          int32_t dot[2] = {0, 0};  // per half block
          for (int t = 0; t < digits; ++t) {  // two digits: 128 * dot(w, q) + dot(w, q')
            const int8_t* q = X.q.data() + ((r * digits + t) * W.G + g) * kBlock;
            dot[0] *= 128, dot[1] *= 128;
            for (int i = 0; i < kBlock; ++i) dot[i / kHalf] += code_at(blk, bits, int(h), lane, i) * int32_t(q[i]);
          }
          const float unit = digits == 2 ? 1.0f / 128.0f : 1.0f;
          const float d = X.d[2 * xb] * float(dot[0]) + X.d[2 * xb + 1] * float(dot[1]);
          acc += scale_at(W, sc + lane) * unit * d + scale_at(W, sc + 2 * kLanes + lane) * X.sum[xb];
        }
        y[r * W.N + j * kLanes + lane] = acc;
      }
    }
  }
}

}  // namespace

#ifdef FERRUM_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define FERRUM_QACT_NS qact_avx2
#define FERRUM_QACT_DOT 0
namespace {
#include "qact_tile.inc"
}
#undef FERRUM_QACT_NS
#undef FERRUM_QACT_DOT
#pragma GCC pop_options

#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define FERRUM_HAVE_AVXVNNI 1  // older compilers know no AVX-VNNI: that path is left out, not the file
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define FERRUM_QACT_NS qact_avxvnni
#define FERRUM_QACT_DOT 1
namespace {
#include "qact_tile.inc"
}
#undef FERRUM_QACT_NS
#undef FERRUM_QACT_DOT
#pragma GCC pop_options
#endif

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#define FERRUM_QACT_NS qact_avx512vnni
#define FERRUM_QACT_DOT 2
namespace {
#include "qact_tile.inc"
}
#undef FERRUM_QACT_NS
#undef FERRUM_QACT_DOT
#pragma GCC pop_options
#endif

namespace {

// Inner-loop instruction sets, in order; g_max_isa caps what runs.
enum Isa { kPortable, kAvx2, kAvxVnni, kAvx512Vnni };
const char* const kIsaNames[] = {"portable", "avx2", "avx-vnni", "avx512-vnni"};
std::atomic<int> g_max_isa{kAvx512Vnni};

// Whether this CPU runs each level: not a chain (AVX-512 VNNI CPUs without AVX-VNNI exist).
bool cpu_has(int isa) {
  const ferrum_cpu::Features& f = ferrum_cpu::cpu_features();
  const bool avx2 = f.avx2 && f.fma && f.f16c;
#ifdef FERRUM_HAVE_AVXVNNI
  const bool avxvnni = avx2 && f.avxvnni;
#else
  const bool avxvnni = false;  // this compiler built no AVX-VNNI loops
#endif
  const std::array<bool, 4> has{true, avx2, avxvnni, avx2 && f.avx512vnni && f.avx512vl && f.avx512bw};
  return has[isa];
}

// The best level this CPU has at or below the cap, and below woq.cpp's cap
// (FERRUM_RPC_MAX_ISA): under avx512 no AVX-512 loops, portable means portable.
int active_isa() {
  int cap = g_max_isa.load();
  const int woq = ferrum_active_isa();
  if (woq < 2) cap = std::min(cap, int(kAvxVnni));
  if (woq < 1) cap = kPortable;
  while (cap > kPortable && !cpu_has(cap)) --cap;
  return cap;
}

std::string isa() { return kIsaNames[active_isa()]; }

std::string set_max_isa(const std::string& name) {
  for (int i = 0; i <= kAvx512Vnni; ++i)
    if (name == kIsaNames[i]) g_max_isa.store(i);
  return isa();
}

// Whether `isa`'s loops take activations as int16 too (Q8Rows::v): AVX2's, for two
// digits and 8-bit weights (qact_tile.inc tile_wide).
bool wide(int isa) { return isa == kAvx2; }

// Weight units [u0, u1) on the inner loops of `isa`.
template <int BITS, bool HALF, int DIGITS>
void run_groups(int isa, const Packed& W, int64_t u0, int64_t u1, const Q8Rows& X, int64_t M, float* y) {
#ifdef FERRUM_X86
  switch (isa) {
    case kAvx512Vnni: return qact_avx512vnni::groups<BITS, HALF, DIGITS>(W, u0, u1, X, M, y);
#ifdef FERRUM_HAVE_AVXVNNI
    case kAvxVnni: return qact_avxvnni::groups<BITS, HALF, DIGITS>(W, u0, u1, X, M, y);
#endif
    case kAvx2: return qact_avx2::groups<BITS, HALF, DIGITS>(W, u0, u1, X, M, y);
  }
#endif
  groups_portable(W, BITS, u0, u1, X, M, DIGITS, y);
}

template <int BITS, bool HALF>
void run_groups(int isa, const Packed& W, int64_t u0, int64_t u1, const Q8Rows& X, int64_t M, int digits, float* y) {
  digits == 2 ? run_groups<BITS, HALF, 2>(isa, W, u0, u1, X, M, y) : run_groups<BITS, HALF, 1>(isa, W, u0, u1, X, M, y);
}

// w8a8's rotated activations (qact.py RotatedQ8Linear): each 16 elements of x,
// read as a 4x4 matrix X, become H4 X H4 / 4 with H4 = J - 2I, i.e. x times
// (H4 (x) H4) / 4, a Hadamard matrix of order 16 whose rows all sum to 4.  It is
// orthonormal and its own inverse, spreads an outlier over its 16 elements
// before each half block takes one 8-bit step (which lowers the KL divergence
// from float32 several times over: bench.quant_accuracy), and,
// since its rows sum to 4 and Q4_1's 8-bit codes are 17 q, it turns a Q4_1
// block's weights into integer codes that fit 8 bits again: the weights are
// rotated once at load, without loss.  Adds, doublings and a quarter only, in
// one fixed order (columns, then rows; the torch rotate16 makes the same floats),
// so every inner-loop path quantizes the same numbers.  SSE (every x86-64) takes
// a 4x4 matrix as four row registers, transposed between the two passes; the
// scalar loop (the portable path's) ran at ~1.3 ns an element, a tenth of a
// batch-8 step.
inline void rotate_chunk_scalar(const float* v, float* y) {
  float t[16];
  for (int b = 0; b < 4; ++b) {  // H4 X: each column's sum minus twice the element
    const float c = (v[b] + v[4 + b]) + (v[8 + b] + v[12 + b]);
    for (int a = 0; a < 4; ++a) t[4 * a + b] = c - (v[4 * a + b] + v[4 * a + b]);
  }
  for (int a = 0; a < 4; ++a) {  // (H4 X) H4, then / 4
    const float* r = t + 4 * a;
    const float c = (r[0] + r[1]) + (r[2] + r[3]);
    for (int b = 0; b < 4; ++b) y[4 * a + b] = (c - (r[b] + r[b])) * 0.25f;
  }
}

#ifdef FERRUM_X86
inline void rotate_chunk_sse(const float* v, float* y) {
  __m128 r0 = _mm_loadu_ps(v), r1 = _mm_loadu_ps(v + 4), r2 = _mm_loadu_ps(v + 8), r3 = _mm_loadu_ps(v + 12);
  __m128 c = _mm_add_ps(_mm_add_ps(r0, r1), _mm_add_ps(r2, r3));  // column sums
  r0 = _mm_sub_ps(c, _mm_add_ps(r0, r0)), r1 = _mm_sub_ps(c, _mm_add_ps(r1, r1));  // H4 X
  r2 = _mm_sub_ps(c, _mm_add_ps(r2, r2)), r3 = _mm_sub_ps(c, _mm_add_ps(r3, r3));
  _MM_TRANSPOSE4_PS(r0, r1, r2, r3);  // now columns: r_b holds element b of every row
  c = _mm_add_ps(_mm_add_ps(r0, r1), _mm_add_ps(r2, r3));  // row sums
  const __m128 quarter = _mm_set1_ps(0.25f);
  r0 = _mm_mul_ps(_mm_sub_ps(c, _mm_add_ps(r0, r0)), quarter), r1 = _mm_mul_ps(_mm_sub_ps(c, _mm_add_ps(r1, r1)), quarter);
  r2 = _mm_mul_ps(_mm_sub_ps(c, _mm_add_ps(r2, r2)), quarter), r3 = _mm_mul_ps(_mm_sub_ps(c, _mm_add_ps(r3, r3)), quarter);
  _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
  _mm_storeu_ps(y, r0), _mm_storeu_ps(y + 4, r1), _mm_storeu_ps(y + 8, r2), _mm_storeu_ps(y + 12, r3);
}
#endif

// n floats (a multiple of 16), on SSE unless the inner loops are capped at portable.
void rotate16(const float* x, float* y, int64_t n, bool portable) {
#ifdef FERRUM_X86
  if (!portable) {
    for (int64_t c = 0; c < n; c += 16) rotate_chunk_sse(x + c, y + c);
    return;
  }
#endif
  for (int64_t c = 0; c < n; c += 16) rotate_chunk_scalar(x + c, y + c);
}

}  // namespace

namespace ferrum_qact {  // qact.h: what decode_stack.cpp calls
// On the inner loops of `isa`: the same codes on every path (the vector loops
// round half to even and multiply in the same order, unfused).
void quantize_blocks(const float* x, int64_t b0, int64_t b1, int64_t K, int digits, bool rotated, int isa,
                     Q8Rows& out, float* scratch) {
  const int64_t G = K / kBlock;
  if (rotated) {
    rotate16(x + b0 * kBlock, scratch + b0 * kBlock, (b1 - b0) * kBlock, isa == kPortable);
    x = scratch;
  }
#ifdef FERRUM_X86
  if (isa == kAvx512Vnni) return qact_avx512vnni::quantize(x, b0, b1, G, digits, out);
  if (isa != kPortable) return qact_avx2::quantize(x, b0, b1, G, digits, out);
#endif
  quantize_portable(x, b0, b1, G, digits, out);
}

Q8Rows rows_for(int64_t M, int64_t K, int digits, int isa) {
  return {std::vector<int8_t>(M * digits * K), std::vector<float>(2 * M * (K / kBlock)),
          std::vector<float>(M * (K / kBlock)), std::vector<int16_t>(wide(isa) ? M * K : 0)};
}

void run_units(int isa, const Packed& W, int bits, int64_t u0, int64_t u1, const Q8Rows& X, int64_t M, int digits,
               float* y) {
  if (bits == 4) W.half ? run_groups<4, true>(isa, W, u0, u1, X, M, digits, y) : run_groups<4, false>(isa, W, u0, u1, X, M, digits, y);
  else W.half ? run_groups<8, true>(isa, W, u0, u1, X, M, digits, y) : run_groups<8, false>(isa, W, u0, u1, X, M, digits, y);
}
}  // namespace ferrum_qact

namespace {
using ferrum_qact::quantize_blocks, ferrum_qact::rows_for, ferrum_qact::run_units;

// Activation rows quantized (rotate16 first where `rotated`: one digit only).
Q8Rows quantize_rows(const float* x, int64_t M, int64_t K, int digits, bool rotated, int isa) {
  const int64_t G = K / kBlock;
  std::vector<float> scratch(rotated ? M * K : 0);
  Q8Rows out = rows_for(M, K, digits, isa);
  at::parallel_for(0, M * G, 64, [&](int64_t begin, int64_t end) {
    quantize_blocks(x, begin, end, K, digits, rotated, isa, out, scratch.data());
  });
  return out;
}

// Checked views of packed weights: codes (U, G, 16 * 32 * bits / 8) uint8, scales (U, G, 2, 16).
Packed packed_weights(const at::Tensor& codes, const at::Tensor& scales, int64_t bits, int64_t n) {
  TORCH_CHECK(bits == 4 || bits == 8, "block_linear: bits must be 4 or 8");
  const int64_t bytes = kUnit * kBlock * bits / 8;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.is_contiguous() &&
              codes.size(2) == bytes, "block_linear: codes must be contiguous (N/16, K/32, ", bytes, ") uint8");
  const int64_t U = codes.size(0), G = codes.size(1);
  TORCH_CHECK(n > (U - 1) * kUnit && n <= U * kUnit, "block_linear: ", n, " outputs do not fit ", U, " units of 16");
  TORCH_CHECK((scales.scalar_type() == at::kHalf || scales.scalar_type() == at::kFloat) && scales.is_contiguous() &&
              scales.numel() == U * G * 2 * kUnit, "block_linear: scales must be (N/16, K/32, 2, 16) float16 or float32");
  return {codes.data_ptr<uint8_t>(), scales.data_ptr(), scales.scalar_type() == at::kHalf, n, U, G};
}

// x (..., K) float32 -> (..., n) float32, over packed weights (qact.py's pack_rows),
// with activations as one int8 digit per element (w8a8, w4a8) or two (int8, int4);
// `rotated`: one digit of rotate16(x), against weights rotated at load (w8a8).
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t bits,
                        int64_t n, int64_t digits, bool rotated) {
  TORCH_CHECK(digits == 1 || digits == 2, "block_linear: digits must be 1 or 2");
  TORCH_CHECK(!rotated || digits == 1, "block_linear: rotated activations take one digit");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "block_linear: activations must be float32");
  const Packed W = packed_weights(codes, scales, bits, n);
  const int64_t U = W.U, K = W.G * kBlock;
  TORCH_CHECK(x.size(-1) == K, "block_linear: activation width ", x.size(-1), " != ", K);
  const ferrum_ops::Rows io = ferrum_ops::rows_of(x, K, n);
  const int64_t M = io.M;
  if (M == 0) return io.result();
  const int dg = int(digits);
  const int isa = active_isa();
  const Q8Rows X = quantize_rows(io.x2d.data_ptr<float>(), M, K, dg, rotated, isa);
  float* y = io.out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, U / (4 * at::get_num_threads()));
  at::parallel_for(0, U, grain, [&](int64_t begin, int64_t end) { run_units(isa, W, int(bits), begin, end, X, M, dg, y); });
  return io.result();
}

// x (..., K) float32 -> (codes (..., digits, K) int8, d (..., K/16), sum (..., K/32)):
// the activation quantization block_linear runs, on this CPU's loops (for tests).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize(const at::Tensor& x, int64_t digits, bool rotated) {
  TORCH_CHECK(digits == 1 || digits == 2, "quantize: digits must be 1 or 2");
  TORCH_CHECK(!rotated || digits == 1, "quantize: rotated activations take one digit");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) % kBlock == 0, "quantize: float32 rows of 32k");
  const at::Tensor x2d = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = x2d.size(0), K = x2d.size(1), G = K / kBlock;
  const Q8Rows X = quantize_rows(x2d.data_ptr<float>(), M, K, int(digits), rotated, active_isa());
  auto lead = x.sizes().vec();
  lead.pop_back();
  auto shape = [&](std::vector<int64_t> tail) { auto s = lead; s.insert(s.end(), tail.begin(), tail.end()); return s; };
  at::Tensor q = at::empty(shape({digits, K}), x.options().dtype(at::kChar));
  at::Tensor d = at::empty(shape({2 * G}), x.options()), sum = at::empty(shape({G}), x.options());
  std::memcpy(q.data_ptr(), X.q.data(), X.q.size());
  std::memcpy(d.data_ptr(), X.d.data(), X.d.size() * sizeof(float));
  std::memcpy(sum.data_ptr(), X.sum.data(), X.sum.size() * sizeof(float));
  return {q, d, sum};
}

}  // namespace

namespace ferrum_qact {
int isa_level() { return active_isa(); }
Packed packed(const at::Tensor& codes, const at::Tensor& scales, int64_t bits) {
  return packed_weights(codes, scales, bits, codes.size(0) * kUnit);
}
void prefetch_units(const Packed& W, int bits, int64_t u0, int64_t u1, int64_t bytes) {
#ifdef FERRUM_X86
  const int64_t unit = W.G * kUnit * kBlock * bits / 8, scales = W.G * 2 * kUnit * (W.half ? 2 : 4);
  const char* codes = reinterpret_cast<const char*>(W.codes) + u0 * unit;
  const int64_t n = std::min(bytes, (u1 - u0) * unit);
  for (int64_t i = 0; i < n; i += 64) _mm_prefetch(codes + i, _MM_HINT_T1);
  const char* sc = static_cast<const char*>(W.scales) + u0 * scales;
  const int64_t ns = std::min((u1 - u0) * scales, n * scales / unit + 64);
  for (int64_t i = 0; i < ns; i += 64) _mm_prefetch(sc + i, _MM_HINT_T1);
#else
  (void)W, (void)bits, (void)u0, (void)u1, (void)bytes;
#endif
}
}  // namespace ferrum_qact

// For decode_stack.cpp's whole-layer op: all N = 16 * units outputs.
at::Tensor ferrum_qact_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t bits,
                              int64_t digits, bool rotated) {
  return block_linear(x, codes, scales, bits, codes.size(0) * kUnit, digits, rotated);
}

TORCH_LIBRARY(ferrum_qact, m) {
  using ferrum_ops::on_cpu;
  m.def("block_linear(Tensor x, Tensor codes, Tensor scales, int bits, int n, int digits=1, bool rotated=False) -> Tensor",
        on_cpu(&block_linear));
  m.def("quantize(Tensor x, int digits, bool rotated=False) -> (Tensor, Tensor, Tensor)", on_cpu(&quantize));
  m.def("isa() -> str", &isa);
  m.def("set_max_isa(str name) -> str", &set_max_isa);
}
