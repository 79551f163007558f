// One row of the gated MLP activation, out[i] = act(gate[i]) * up[i] (act 0: SiLU, 1: GELU-tanh):
// the gated_activation op (gated_activation.cc) and the fused decoder blocks (decoder_block_ops.cc)
// run these functions, so they give the same bits.
//
// The AVX-512 (16 lanes), AVX2 (8 lanes) and portable kernels perform the same IEEE operations in the
// same order (the exp a polynomial in fused multiply-adds, not the libm's), so an element's bits do not
// depend on the machine; a row's tail (past the last whole vector) runs the portable code.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_isa.h"

namespace fd_cpu {
namespace gated {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
constexpr float kExpCoefficients[] = {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};

// e^x for x clamped to [-87, 88] (2^n stays a normal float): n = round(x log2 e), a degree-7
// Taylor series of e^r on |r| <= ln2 / 2 (relative error ~1e-8), times 2^n. The clamps are vmaxps /
// vminps's (a NaN becomes the bound), the rounding to nearest even.
inline float exp1(float x) {
  x = x > -87.f ? x : -87.f;
  x = x < 88.f ? x : 88.f;
  const float n = std::nearbyint(x * kLog2e);
  const float r = std::fma(-n, kLn2Lo, std::fma(-n, kLn2Hi, x));
  float e = 1.f / 5040.f;
  for (const float c : kExpCoefficients) e = std::fma(e, r, c);
  const int32_t bits = (int32_t(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return e * two_n;
}

// SiLU: x / (1 + e^-x). GELU-tanh: 0.5 x (1 + tanh u) = x / (1 + e^-2u), the form without the
// cancellation 1 + tanh u suffers where tanh u is near -1.
inline float act1(float x, int act) {
  float z = 0.f - x;
  if (act == 1) {
    const float x3 = (x * x) * x;
    z = -2.f * (kSqrt2OverPi * std::fma(kGeluCubic, x3, x));
  }
  return x / (1.f + exp1(z));
}

inline void row_generic(const float* gate, const float* up, int64_t f, int act, float* out) {
  for (int64_t i = 0; i < f; ++i) out[i] = act1(gate[i], act) * up[i];
}

__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x));
  __m512 e = _mm512_set1_ps(1.f / 5040.f);
  for (const float c : kExpCoefficients) e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(e, _mm512_castsi512_ps(bits));
}

__attribute__((target("avx512f"))) inline __m512 act16(__m512 x, int act) {
  const __m512 one = _mm512_set1_ps(1.f);
  __m512 z = _mm512_sub_ps(_mm512_setzero_ps(), x);
  if (act == 1) {
    const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(kSqrt2OverPi), _mm512_fmadd_ps(_mm512_set1_ps(kGeluCubic), x3, x));
    z = _mm512_mul_ps(_mm512_set1_ps(-2.f), u);
  }
  return _mm512_div_ps(x, _mm512_add_ps(one, exp16(z)));
}

__attribute__((target("avx512f"))) inline void row_avx512(const float* gate, const float* up, int64_t f, int act,
                                                  float* out) {
  for (int64_t i = 0; i < f; i += 16) {
    const __mmask16 m = f - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (f - i)) - 1);
    const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
    _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(act16(g, act), _mm512_maskz_loadu_ps(m, up + i)));
  }
}

__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x));
  __m256 e = _mm256_set1_ps(1.f / 5040.f);
  for (const float c : kExpCoefficients) e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(e, _mm256_castsi256_ps(bits));
}

__attribute__((target("avx2,fma"))) inline __m256 act8(__m256 x, int act) {
  __m256 z = _mm256_sub_ps(_mm256_setzero_ps(), x);
  if (act == 1) {
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(kSqrt2OverPi), _mm256_fmadd_ps(_mm256_set1_ps(kGeluCubic), x3, x));
    z = _mm256_mul_ps(_mm256_set1_ps(-2.f), u);
  }
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(z)));
}

__attribute__((target("avx2,fma"))) inline void row_avx2(const float* gate, const float* up, int64_t f, int act,
                                                       float* out) {
  int64_t i = 0;
  for (; i + 8 <= f; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(act8(_mm256_loadu_ps(gate + i), act), _mm256_loadu_ps(up + i)));
  row_generic(gate + i, up + i, f - i, act, out + i);
}

// Row r of x [rows, 2F] (gate, then up) into out [rows, F], on this process's instruction set.
inline void gated_row(const float* row, int64_t f, int act, float* out) {
  const Isa isa = kernels_isa();
  if (isa == Isa::kAvx512) return row_avx512(row, row + f, f, act, out);
  if (isa == Isa::kAvx2) return row_avx2(row, row + f, f, act, out);
  row_generic(row, row + f, f, act, out);
}

}  // namespace gated
}  // namespace fd_cpu
