// What the fused step ops' files share: bfloat16 loads and stores, the 8-lane
// vector exp and the 8-lane load, and the inner-loop cap (woq.cpp's).
//
// Arithmetic is float32 throughout; bfloat16 tensors are converted on load
// and rounded where the eager path rounds (rms_norm before the weight
// multiply, silu before the product), so both paths agree to float32
// rounding.  Loops are plain C++ written for the auto-vectoriser, compiled
// twice: for AVX2+FMA (target attribute, taken only where the CPU has it)
// and portable; ferrum_woq::set_max_isa caps every file, so tests run each
// build on any machine.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FERRUM_X86 1
#endif

#define FERRUM_INLINE inline __attribute__((always_inline))

#include "cpu_features.h"
#include "ops.h"

namespace ferrum_fused {

inline float load(float v) { return v; }
inline float load(c10::BFloat16 v) {  // the bit pattern shifted into place: exact, and it vectorises
  const uint32_t bits = uint32_t(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
// an int8 KV pool's value (its row's scale applied apart); a template, so a double
// (or any other) argument does not find it among load(float)'s rivals
template <typename I>
  requires std::is_same_v<I, int8_t>
inline float load(I v) { return float(v); }
template <typename T> inline T store(float v) { return static_cast<T>(v); }

// Whether the AVX2+FMA loops run (the CPU has them and the cap allows them).
inline bool avx2_on() { return ferrum_active_isa() >= 1; }

#ifdef FERRUM_X86
// ---- exp over 8 lanes ---------------------------------------------------------------
// libm's expf is a call per element (a batch-1 step spent ~15% of its attention
// and silu time there).  exp8: Cephes' expf on 8 lanes, x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by its degree-7 polynomial, 2^n into the exponent
// bits: within 2e-7 relative of exp (measured over -87..88); x below -87.34
// (where expf is subnormal or 0) gives 0, above 88.38 +inf (expf: above 88.72;
// the softmax never passes 0 and silu's 1 + e^-x makes either 0 in the end).
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ), over = _mm256_cmp_ps(x, hi, _CMP_GT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts, as Cephes
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n as two factors: n reaches 128 at the top of the range, past one exponent field
  const __m256i e = _mm256_cvtps_epi32(n), e1 = _mm256_srai_epi32(e, 1);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, _mm256_set1_epi32(127)), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(e, e1),
                                                                           _mm256_set1_epi32(127)), 23));
  const __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
  return _mm256_blendv_ps(_mm256_andnot_ps(under, y), _mm256_set1_ps(INFINITY), over);
}

// exp8 on 16 lanes: the same operations lane by lane (the same bits), the masks in
// mask registers.
__attribute__((target("avx2,fma,avx512f"))) inline __m512 exp16(__m512 x) {
  const __m512 hi = _mm512_set1_ps(88.3762626647949f), lo = _mm512_set1_ps(-87.3365478515625f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), over = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, hi), lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_cvtps_epi32(n), e1 = _mm512_srai_epi32(e, 1);
  const __m512 f1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e1, _mm512_set1_epi32(127)), 23));
  const __m512 f2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(e, e1),
                                                                           _mm512_set1_epi32(127)), 23));
  const __m512 y = _mm512_maskz_mov_ps(__mmask16(~under), _mm512_mul_ps(_mm512_mul_ps(p, f1), f2));
  return _mm512_mask_blend_ps(over, y, _mm512_set1_ps(INFINITY));
}

// 8 floats, or 8 bfloat16 widened (the bits shifted into place, as load()).
template <typename T>
__attribute__((target("avx2,fma"))) inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// 8 int8 widened to float32 (exact): an int8 KV pool's values, before their row's scale.
__attribute__((target("avx2,fma"))) inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// float32 to bfloat16 bits in the low 16 of each lane, as c10::BFloat16 rounds (to
// nearest even; a NaN becomes 0x7FC0).
__attribute__((target("avx2,fma"))) inline __m256i bf16_bits(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                        _mm256_set1_epi32(0x7FFF));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// 8 floats stored as bfloat16, rounded as store<c10::BFloat16> rounds (bf16_bits).
__attribute__((target("avx2,fma"))) inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i b = bf16_bits(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
#endif

}  // namespace ferrum_fused
