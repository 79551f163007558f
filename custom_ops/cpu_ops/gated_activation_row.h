// One row of the gated MLP activation, out[i] = act(gate[i]) * up[i] (act 0: SiLU, 1: GELU-tanh):
// the gated_activation op (gated_activation.cc) and the fused decoder blocks (decoder_block_ops.cc)
// run these functions, so they give the same bits.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace fd_cpu {
namespace gated {

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

// e^x for x clamped to [-87, 88] (2^n stays a normal float): n = round(x log2 e), a degree-7
// Taylor series of e^r on |r| <= ln2 / 2 (relative error ~1e-8), times 2^n.
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x));
  __m512 e = _mm512_set1_ps(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(e, _mm512_castsi512_ps(bits));
}

__attribute__((target("avx512f"))) inline __m512 act16(__m512 x, int act) {
  const __m512 one = _mm512_set1_ps(1.f);
  // SiLU: x / (1 + e^-x). GELU-tanh: 0.5 x (1 + tanh u) = x / (1 + e^-2u), the form without the
  // cancellation 1 + tanh u suffers where tanh u is near -1.
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

inline void row_generic(const float* gate, const float* up, int64_t f, int act, float* out) {
  for (int64_t i = 0; i < f; ++i) {
    const float x = gate[i];
    const float z = act == 0 ? -x : -2.f * kSqrt2OverPi * (x + kGeluCubic * x * x * x);
    out[i] = x / (1.f + std::exp(std::min(z, 88.f))) * up[i];
  }
}

// Row r of x [rows, 2F] (gate, then up) into out [rows, F], the op's kernel choice.
inline void gated_row(const float* row, int64_t f, int act, float* out, bool avx512) {
  (avx512 ? row_avx512 : row_generic)(row, row + f, f, act, out);
}

}  // namespace gated
}  // namespace fd_cpu
