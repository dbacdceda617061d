// Weight-only quantized linear layers for CPU, in groups of 32 along the input,
// each group with a scale and a minimum: w = code * scale + min, with 8-bit
// codes (0..255) or 4-bit codes (0..15, GGUF's Q4_1 layout).  GGUF's Q4_1 and
// Q8_0 blocks map onto these grids exactly (see server/woq.py), so such
// checkpoints are held without further loss.
//
// Activations stay in float32 (the wrapper converts bfloat16).  Each thread
// walks its share of output rows: a row is expanded to float32 into an L1
// buffer (never the whole matrix), then dotted with every activation row, so
// a decode step reads the quantized bytes once.  Two builds of the inner
// loops live here: AVX2+FMA intrinsics, chosen at run time only where the CPU
// reports both, and portable C++ for every other CPU (also forced by
// set_portable(true), so tests cover both paths on any machine).  Threads
// come from ATen's pool.  torch's own _weight_int8pack_mm /
// _weight_int4pack_mm_for_cpu are the fallback where this file cannot be
// built or disagrees with the reference (see server/woq.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include "cpu_features.h"
#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FERRUM_X86 1
#endif

namespace {

constexpr int64_t kGroup = 32;  // int4 group length along K
constexpr int kRowTile = 4;     // activation rows sharing one read of the expanded weight row
constexpr int64_t kFusedMaxRows = 12; // up to here (decode): fused; above (prefill, big batches): tiles + GEMM
constexpr int64_t kTileRows = 256;    // weight rows expanded per GEMM tile (fits L2)

// Inner-loop instruction sets, in order; g_max_isa caps what runs (tests force each path).
enum Isa : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };
const char* const kIsaNames[] = {"portable", "avx2", "avx512"};
std::atomic<int> g_max_isa{kAvx512};
constexpr int64_t kRegMaxRows = 4;  // up to here (batch-1..4 decode): codes expanded in registers only

// ---- portable C++ ------------------------------------------------------------
void int4_row_portable(const uint8_t* q, const float* scale, const float* minv, int64_t k, float* out) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const uint8_t* b = q + g * (kGroup / 2);
    float* o = out + g * kGroup;
    for (int i = 0; i < kGroup / 2; ++i) {  // byte i: element i (low nibble), element i + 16 (high)
      o[i] = float(b[i] & 0xF) * scale[g] + minv[g];
      o[i + kGroup / 2] = float(b[i] >> 4) * scale[g] + minv[g];
    }
  }
}

void int8_row_portable(const uint8_t* q, const float* scale, const float* minv, int64_t k, float* out) {
  for (int64_t i = 0; i < k; ++i) out[i] = float(q[i]) * scale[i / kGroup] + minv[i / kGroup];
}

void dot_portable(const float* w, const float* x, int64_t ldx, int rows, int64_t k, float* out, int64_t ldo) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    float sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < k; ++i) sum += w[i] * xr[i];
    out[r * ldo] = sum;
  }
}

#ifdef FERRUM_X86
// ---- AVX2 + FMA ----------------------------------------------------------------
__attribute__((target("avx2,fma"))) void int4_row_avx2(const uint8_t* q, const float* scale, const float* minv,
                                                        int64_t k, float* out) {
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * (kGroup / 2)));
    const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
    const __m256 sc = _mm256_set1_ps(scale[g]), mn = _mm256_set1_ps(minv[g]);
    float* o = out + g * kGroup;
    _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), sc, mn));
    _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), sc, mn));
    _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), sc, mn));
    _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), sc, mn));
  }
}

__attribute__((target("avx2,fma"))) void int8_row_avx2(const uint8_t* q, const float* scale, const float* minv,
                                                        int64_t k, float* out) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const __m256 sc = _mm256_set1_ps(scale[g]), mn = _mm256_set1_ps(minv[g]);
    for (int64_t i = g * kGroup; i < (g + 1) * kGroup; i += 8) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i));
      _mm256_storeu_ps(out + i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), sc, mn));
    }
  }
}

__attribute__((target("avx2,fma"))) inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R activation rows against one expanded weight row; two accumulators per row
// hide the FMA latency.  k is a multiple of 16.
template <int R>
__attribute__((target("avx2,fma"))) void dot_avx2(const float* w, const float* x, int64_t ldx, int64_t k,
                                                  float* out, int64_t ldo) {
  __m256 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
    for (int r = 0; r < R; ++r) {
      a[r][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + i), a[r][0]);
      a[r][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * ldx + i + 8), a[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * ldo] = hsum_avx2(_mm256_add_ps(a[r][0], a[r][1]));
}

#endif  // FERRUM_X86

// The best instruction set this CPU and OS support (cpu_features.h).
int cpu_isa() {
  const ferrum_cpu::Features& f = ferrum_cpu::cpu_features();
  if (f.avx512f && f.fma) return kAvx512;
  if (f.avx2 && f.fma) return kAvx2;
  return kPortable;
}

int active_isa() { return std::min(cpu_isa(), g_max_isa.load()); }

#ifdef FERRUM_X86
// ---- few activation rows: weights expanded in registers, never stored ---------
// woq_reg.inc once for AVX2 (8 lanes, FERRUM_MM naming _mm256_ intrinsics) and
// once for AVX-512 (16 lanes, _mm512_), each with that width's horizontal sum.
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define FERRUM_MM(op) _mm256_##op
#define FERRUM_REG_SUM hsum_avx2
namespace reg_avx2 {
#include "woq_reg.inc"
}
#undef FERRUM_MM
#undef FERRUM_REG_SUM
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,fma")
#define FERRUM_MM(op) _mm512_##op
#define FERRUM_REG_SUM _mm512_reduce_add_ps
namespace reg_avx512 {
#include "woq_reg.inc"
}
#undef FERRUM_MM
#undef FERRUM_REG_SUM
#pragma GCC pop_options

// A weight row (n) against M <= kRegMaxRows activation rows, on the widest loops `isa` allows.
template <bool kInt4>
void reg_rows(int isa, int64_t M, const uint8_t* q, const float* sc, const float* mn, int64_t k, const float* x,
              int64_t ldx, float* out, int64_t ldo) {
  if (isa >= kAvx512) return reg_avx512::reg_rows<kInt4>(M, q, sc, mn, k, x, ldx, out, ldo);
  reg_avx2::reg_rows<kInt4>(M, q, sc, mn, k, x, ldx, out, ldo);
}
#endif

void dot_rows(bool avx2, const float* w, const float* x, int64_t ldx, int64_t rows, int64_t k, float* out,
              int64_t ldo) {
#ifdef FERRUM_X86
  if (avx2) {
    int64_t m = 0;
    for (; m + kRowTile <= rows; m += kRowTile) dot_avx2<kRowTile>(w, x + m * ldx, ldx, k, out + m * ldo, ldo);
    for (; m < rows; ++m) dot_avx2<1>(w, x + m * ldx, ldx, k, out + m * ldo, ldo);
    return;
  }
#endif
  dot_portable(w, x, ldx, static_cast<int>(rows), k, out, ldo);
}

// out (M, N) = x (M, K) @ W^T, where `expand(avx2, n, buf)` writes row n of W as float32 into buf.
// Few rows: each thread expands its weight rows one at a time into L1 and
// dots them with every activation row (the weights are read once).  Many
// rows: tiles of weight rows are expanded in parallel, then multiplied by the
// BLAS GEMM (out^T = W x^T, so each tile's result is contiguous).
// With kRegMaxRows rows or fewer and AVX2 or better, `reg(isa, n, M, x, y)` computes
// y[m * n_out] = x[m] . W[n] for every row m instead, codes expanded in registers.
template <typename Expand, typename Reg>
at::Tensor run_linear(const at::Tensor& x2d, int64_t n_out, Expand expand, Reg reg) {
  const int64_t M = x2d.size(0), K = x2d.size(1);
  const int isa = active_isa();
  const bool avx2 = isa >= kAvx2;
  if (M <= kRegMaxRows && avx2) {
    at::Tensor out = at::empty({M, n_out}, x2d.options());
    const float* x = x2d.data_ptr<float>();
    float* y = out.data_ptr<float>();
    const int64_t grain = std::max<int64_t>(16, n_out / (8 * at::get_num_threads()));
    at::parallel_for(0, n_out, grain, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) reg(isa, n, M, x, y + n);
    });
    return out;
  }
  if (M > kFusedMaxRows) {
    at::Tensor out_t = at::empty({n_out, M}, x2d.options());
    const at::Tensor x_t = x2d.t();
    const int64_t tiles = (n_out + kTileRows - 1) / kTileRows;
    const bool inference = c10::InferenceMode::is_enabled();  // thread-local: OpenMP workers need it too
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {  // each thread: its own tiles, serial GEMMs
      c10::InferenceMode guard(inference);
      at::Tensor tile = at::empty({kTileRows, K}, x2d.options());
      float* t = tile.data_ptr<float>();
      for (int64_t i = begin; i < end; ++i) {
        const int64_t n0 = i * kTileRows, rows = std::min(kTileRows, n_out - n0);
        for (int64_t r = 0; r < rows; ++r) expand(avx2, n0 + r, t + r * K);
        at::Tensor dst = out_t.narrow(0, n0, rows);
        at::mm_out(dst, tile.narrow(0, 0, rows), x_t);
      }
    });
    return out_t.t().contiguous();
  }
  at::Tensor out = at::empty({M, n_out}, x2d.options());
  const float* x = x2d.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(16, n_out / (8 * at::get_num_threads()));
  at::parallel_for(0, n_out, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> w(K);
    for (int64_t n = begin; n < end; ++n) {
      expand(avx2, n, w.data());
      dot_rows(avx2, w.data(), x, K, M, K, y + n, n_out);
    }
  });
  return out;
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t n_out) {
  auto shape = x.sizes().vec();
  shape.back() = n_out;
  return shape;
}

at::Tensor as_rows(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "activations must be float32");
  TORCH_CHECK(x.size(-1) == k, "activation width ", x.size(-1), " != weight width ", k);
  return x.reshape({-1, k}).contiguous();
}

// x (..., K) float32 times the (N, K) weight of `bits`-bit codes (8: a byte an
// element; 4: two, GGUF Q4_1's order) with a scale and a minimum per group of 32.
at::Tensor woq_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                      const at::Tensor& mins, int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "woq_linear: bits must be 8 or 4, not ", bits);
  const bool int4 = bits == 4;
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
              "int", bits, " weights must be a contiguous (N, K", int4 ? "/2" : "", ") uint8 tensor of codes");
  const int64_t N = qweight.size(0), row_bytes = qweight.size(1), K = int4 ? row_bytes * 2 : row_bytes, G = K / kGroup;
  TORCH_CHECK(K % kGroup == 0, "int", bits, " weights need K divisible by ", kGroup);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && mins.scalar_type() == at::kFloat && scales.is_contiguous() &&
              mins.is_contiguous() && scales.numel() == N * G && mins.numel() == N * G,
              "int", bits, " scales and minimums must be (N, K/32) float32");
  at::Tensor x2d = as_rows(x, K);
  const uint8_t* q = qweight.data_ptr<uint8_t>();
  const float *s = scales.data_ptr<float>(), *z = mins.data_ptr<float>();
  auto expand = [&](bool avx2, int64_t n, float* buf) {
    const uint8_t* row = q + n * row_bytes;
#ifdef FERRUM_X86
    if (avx2) return int4 ? int4_row_avx2(row, s + n * G, z + n * G, K, buf)
                          : int8_row_avx2(row, s + n * G, z + n * G, K, buf);
#endif
    int4 ? int4_row_portable(row, s + n * G, z + n * G, K, buf) : int8_row_portable(row, s + n * G, z + n * G, K, buf);
  };
  auto reg = [&](int isa, int64_t n, int64_t M, const float* xr, float* y) {
#ifdef FERRUM_X86
    const uint8_t* row = q + n * row_bytes;
    if (int4) return reg_rows<true>(isa, M, row, s + n * G, z + n * G, K, xr, K, y, N);
    reg_rows<false>(isa, M, row, s + n * G, z + n * G, K, xr, K, y, N);
#endif
  };
  at::Tensor out = run_linear(x2d, N, expand, reg);
  return out.view(out_shape(x, N));
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins) {
  return woq_linear(x, qweight, scales, mins, 8);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins) {
  return woq_linear(x, qweight, scales, mins, 4);
}

// Which inner loops run: "avx512" (few rows; more rows use avx2), "avx2" or "portable".
std::string isa() { return kIsaNames[active_isa()]; }

// Caps the inner loops at `name` (tests run every path this CPU has); returns what now runs.
std::string set_max_isa(const std::string& name) {
  for (int i = 0; i < 3; ++i)
    if (name == kIsaNames[i]) g_max_isa.store(i);
  return isa();
}

}  // namespace

// The inner loops in use (0 portable, 1 avx2, 2 avx512), for the fused ops too (common.h).
int ferrum_active_isa() { return active_isa(); }

// A quantized linear for decode_stack.cpp's whole-layer op: bits 8 or 4.
at::Tensor ferrum_woq_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                             const at::Tensor& mins, int64_t bits) {
  return woq_linear(x, qweight, scales, mins, bits);
}

// Each schema with its CPU kernel (torch::dispatch), or for every device where the
// op reads no tensor.
TORCH_LIBRARY(ferrum_woq, m) {
  using ferrum_ops::on_cpu;
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins) -> Tensor", on_cpu(&int8_linear));
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins) -> Tensor", on_cpu(&int4_linear));
  m.def("isa() -> str", &isa);
  m.def("set_max_isa(str name) -> str", &set_max_isa);
}
