// Quantized linears that multiply in integers (--quantize w8a8|w4a8): weights in
// blocks of 32 along the input with a scale and a minimum, w = code * s + m
// (woq.py's int4 and int8 grids: GGUF's Q4_1 and Q8_0 blocks held without loss), and activation rows quantized per block of 32 to int8 on each
// call, as llama.cpp's Q8_1: x ~ q * d, q in -127..127, with sum = d * sum(q).
// One block's contribution is then
//
//     sum_i (c_i s + m) (q_i d) = s d * sum_i c_i q_i  +  m * sum
//
// an integer dot product of 32 bytes per block, one float multiply-add for
// the scale and one for the minimum.  AVX2 has no 8-bit multiply; like
// llama.cpp's ggml_vec_dot_q4_1_q8_1 we use vpmaddubsw (unsigned x signed
// bytes, adjacent pairs summed to int16) then vpmaddwd against ones (pairs to
// int32).  4-bit codes are unsigned (0..15): products stay far from int16
// saturation.  8-bit codes are stored 0..255 (woq.py's grid, code - 128 is
// the signed Q8_0 code): flipping the top bit gives the signed code c, and
// vpmaddubsw(|c|, sign(q, c)) is c q without saturation because q never is
// -128 (|c| q pairs reach 2 * 128 * 127 = 32512 < 32767).
//
// Weights are never expanded to float, at any batch size: for 8-64 rows each
// weight row is unpacked once per 4 activation rows, in registers, and the
// activation codes (M x K bytes) stay in L1/L2.  Two builds of the inner
// loops: AVX2 (chosen at run time where the CPU has it) and portable C++
// (integer sums per block, the same numbers up to float summation order);
// ferrum_woq::set_max_isa caps both, so tests run each on any machine.
// No VNNI path: the CPUs here lack AVX-VNNI, and AVX-512 VNNI is untested.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FERRUM_X86 1
#endif

int ferrum_active_isa();  // woq.cpp: 0 portable, 1 avx2, 2 avx512

namespace {

constexpr int64_t kBlock = 32;
constexpr int kRows = 4;  // activation rows sharing one unpacked weight block

// Activation rows quantized per block: codes (M, K) int8, d and d * sum(q) (M, K/32).
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, sum;
};

Q8Rows quantize_rows(const float* x, int64_t M, int64_t K) {
  const int64_t G = K / kBlock;
  Q8Rows out{std::vector<int8_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G)};
  at::parallel_for(0, M * G, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* xb = x + b * kBlock;
      float amax = 0;
      for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.0f, inv = d > 0 ? 1.0f / d : 0.0f;
      int sum = 0;
      int8_t* qb = out.q.data() + b * kBlock;
      for (int i = 0; i < kBlock; ++i) {
        const int v = static_cast<int>(std::nearbyint(xb[i] * inv));  // |v| <= 127 by construction
        qb[i] = static_cast<int8_t>(v);
        sum += v;
      }
      out.d[b] = d;
      out.sum[b] = d * float(sum);
    }
  });
  return out;
}

struct Weights {
  const uint8_t* codes;   // (N, K/2) packed int4 or (N, K) uint8
  const float *s, *m;     // (N, G)
  int64_t N, K, G;
  int bits;
  const uint8_t* row(int64_t n) const { return codes + n * (bits == 4 ? K / 2 : K); }
};

// ---- portable ----------------------------------------------------------------
// Signed code i of block g in row `w`, and the minimum that goes with it.
inline int code_at(const uint8_t* w, int bits, int64_t g, int i) {
  if (bits == 4) {
    const uint8_t byte = w[g * (kBlock / 2) + (i % (kBlock / 2))];
    return i < kBlock / 2 ? byte & 0xF : byte >> 4;
  }
  return int(w[g * kBlock + i]) - 128;
}

void row_portable(const Weights& W, int64_t n, const Q8Rows& X, int64_t r0, int rows, float* y, int64_t ldy) {
  const uint8_t* w = W.row(n);
  const float *s = W.s + n * W.G, *m = W.m + n * W.G;
  for (int r = 0; r < rows; ++r) {
    const int64_t xr = (r0 + r) * W.G;
    float acc = 0;
    for (int64_t g = 0; g < W.G; ++g) {
      const int8_t* q = X.q.data() + (xr + g) * kBlock;
      int32_t dot = 0;
      for (int i = 0; i < kBlock; ++i) dot += code_at(w, W.bits, g, i) * int32_t(q[i]);
      const float mg = W.bits == 4 ? m[g] : m[g] + 128.0f * s[g];  // 8-bit: c = code - 128
      acc += s[g] * X.d[xr + g] * float(dot) + mg * X.sum[xr + g];
    }
    y[r * ldy] = acc;
  }
}

#ifdef FERRUM_X86
// ---- AVX2 ----------------------------------------------------------------------
__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// R activation rows against weight row n: per block, 32 codes unpacked once
// into bytes, then two instructions per row give 8 int32 partial dot products.
template <int R, int BITS>
__attribute__((target("avx2,fma"))) void row_avx2(const Weights& W, int64_t n, const Q8Rows& X, int64_t r0,
                                                  float* y, int64_t ldy) {
  const uint8_t* w = W.row(n);
  const float *s = W.s + n * W.G, *m = W.m + n * W.G;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(char(0x80));
  __m256 acc[R];
  float mins[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), mins[r] = 0;
  for (int64_t g = 0; g < W.G; ++g) {
    __m256i c;  // BITS 4: unsigned codes; BITS 8: |signed code|
    __m256i sign_src;
    if constexpr (BITS == 4) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + g * (kBlock / 2)));
      c = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low);  // elements 0..15 | 16..31
      sign_src = c;
    } else {
      sign_src = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * kBlock)), top);
      c = _mm256_sign_epi8(sign_src, sign_src);  // |c|: -128 stays 0x80, read as unsigned 128
    }
    const float sg = s[g], mg = BITS == 4 ? m[g] : m[g] + 128.0f * s[g];
    for (int r = 0; r < R; ++r) {
      const int64_t xb = (r0 + r) * W.G + g;
      __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(X.q.data() + xb * kBlock));
      if constexpr (BITS == 8) q = _mm256_sign_epi8(q, sign_src);
      const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(c, q), ones);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(sg * X.d[xb]), acc[r]);
      mins[r] += mg * X.sum[xb];
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(acc[r]) + mins[r];
}

template <int BITS>
void rows_avx2(const Weights& W, int64_t n, const Q8Rows& X, int64_t M, float* y, int64_t ldy) {
  int64_t r = 0;
  for (; r + kRows <= M; r += kRows) row_avx2<kRows, BITS>(W, n, X, r, y + r * ldy, ldy);
  switch (M - r) {
    case 3: return row_avx2<3, BITS>(W, n, X, r, y + r * ldy, ldy);
    case 2: return row_avx2<2, BITS>(W, n, X, r, y + r * ldy, ldy);
    case 1: return row_avx2<1, BITS>(W, n, X, r, y + r * ldy, ldy);
  }
}
#endif

// x (..., K) float32 -> (..., N) float32.
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& mins, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "block_linear: bits must be 4 or 8");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "block_linear: activations must be float32");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.is_contiguous(),
              "block_linear: codes must be a contiguous 2-d uint8 tensor");
  const int64_t N = codes.size(0), K = bits == 4 ? codes.size(1) * 2 : codes.size(1), G = K / kBlock;
  TORCH_CHECK(K % kBlock == 0 && x.size(-1) == K, "block_linear: activation width ", x.size(-1), " != ", K);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && mins.scalar_type() == at::kFloat && scales.is_contiguous() &&
              mins.is_contiguous() && scales.numel() == N * G && mins.numel() == N * G,
              "block_linear: scales and minimums must be (N, K/32) float32");
  const at::Tensor x2d = x.reshape({-1, K}).contiguous();
  const int64_t M = x2d.size(0);
  auto shape = x.sizes().vec();
  shape.back() = N;
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out.view(shape);
  const Q8Rows X = quantize_rows(x2d.data_ptr<float>(), M, K);
  const Weights W{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(), N, K, G, int(bits)};
  float* y = out.data_ptr<float>();
  const bool avx2 = ferrum_active_isa() >= 1;
  const int64_t grain = std::max<int64_t>(16, N / (8 * at::get_num_threads()));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
#ifdef FERRUM_X86
      if (avx2) {
        if (bits == 4) rows_avx2<4>(W, n, X, M, y + n, N);
        else rows_avx2<8>(W, n, X, M, y + n, N);
        continue;
      }
#endif
      for (int64_t r = 0; r < M; r += kRows)
        row_portable(W, n, X, r, int(std::min<int64_t>(kRows, M - r)), y + r * N + n, N);
    }
  });
  return out.view(shape);
}

}  // namespace

// For fused.cpp's whole-layer op.
at::Tensor ferrum_qact_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& mins, int64_t bits) {
  return block_linear(x, codes, scales, mins, bits);
}

TORCH_LIBRARY(ferrum_qact, m) {
  m.def("block_linear(Tensor x, Tensor codes, Tensor scales, Tensor mins, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(ferrum_qact, CPU, m) { m.impl("block_linear", &block_linear); }
