// The CPU op's reads of quantized pages: a page's rows dequantized into the tile scratch once per
// page visit, 16 values at a time with AVX-512. The conversions are exact (int8 -> float; e4m3 ->
// fp16 bits -> float, times 2^8) and each value then takes one multiply by its row's scale, so these
// give the bits of fd_kvq::dequantize (kv_quant.h) and of the portable loops in attention_math.h.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "attention_tiles.h"
#include "kv_quant.h"

namespace fd_cpu {

// The exact value of every e4m3fn byte (the portable read).
struct E4M3Table {
  float value[256];
  E4M3Table() {
    for (int b = 0; b < 256; ++b) value[b] = fd_kvq::e4m3_to_float(uint8_t(b));
  }
};

// out[r * d + i] = float(q[r * d + i]) * scales[r]; d a multiple of 16.
__attribute__((target("avx512f"))) inline const float* dequantize_rows_avx512(const int8_t* q,
                                                                             const float* scales,
                                                                             float* out, int64_t n, int d) {
  for (int64_t r = 0; r < n; ++r) {
    const __m512 s = _mm512_set1_ps(scales[r]);
    for (int i = 0; i < d; i += kLanes) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * d + i));
      _mm512_storeu_ps(out + r * d + i, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), s));
    }
  }
  return out;
}

// e4m3fn byte b -> the fp16 with b's exponent and mantissa bits in place (sign moved to bit 15),
// whose value is b's / 2^8 for normals and subnormals alike (fp16's exponent bias is 8 more); the
// NaN code 0x7F (written only for a NaN input) stays NaN, as in the table.
__attribute__((target("avx512f,avx2,f16c"))) inline __m512 e4m3_x16_to_float(__m128i bytes) {
  const __m256i w = _mm256_cvtepu8_epi16(bytes);
  const __m256i magnitude = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7);
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(magnitude, sign)), _mm512_set1_ps(256.f));
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_epi32(_mm512_cvtepu8_epi32(bytes), _mm512_set1_epi32(0x7F)),
                                                _mm512_set1_epi32(0x7F));
  return _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(__builtin_nanf("")));
}

__attribute__((target("avx512f,avx2,f16c"))) inline const float* dequantize_rows_avx512(const fd_kvq::e4m3* q,
                                                                                       const float* scales,
                                                                                       float* out, int64_t n,
                                                                                       int d) {
  for (int64_t r = 0; r < n; ++r) {
    const __m512 s = _mm512_set1_ps(scales[r]);
    for (int i = 0; i < d; i += kLanes) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * d + i));
      _mm512_storeu_ps(out + r * d + i, _mm512_mul_ps(e4m3_x16_to_float(bytes), s));
    }
  }
  return out;
}

}  // namespace fd_cpu
