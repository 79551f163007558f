// The CPU op's quantized pages, 8 values at a time with AVX2 (kv_quant_rows.h says what they promise:
// the portable rule's operations in its order). The reads: int8 -> float, e4m3 -> fp16 bits -> float
// times 2^8, int4 -> its signed code -> float, each exact, then one multiply by the row's scale (the
// AVX-512 read's table holds the same products).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "attention_tiles.h"
#include "kv_quant.h"
#include "kv_quant_rows.h"

#define KVQ_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

namespace fd_cpu {

// out[r * d + i] = float(q[r * d + i]) * scales[r]; d a multiple of 8.
KVQ_AVX2_TARGET inline const float* dequantize_rows_avx2(const int8_t* q, const float* scales, float* out, int64_t n,
                                                     int d) {
  for (int64_t r = 0; r < n; ++r) {
    const __m256 s = _mm256_set1_ps(scales[r]);
    for (int i = 0; i < d; i += kAvx2Width) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + r * d + i));
      _mm256_storeu_ps(out + r * d + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), s));
    }
  }
  return out;
}

// 8 e4m3fn bytes (the low 64 bits) as floats: the fp16 with the byte's exponent and mantissa in place
// (kv_quant_rows_avx512.h's e4m3_x16_to_float says why that is the value / 2^8); the NaN code stays NaN.
KVQ_AVX2_TARGET inline __m256 e4m3_x8_to_float(__m128i bytes) {
  const __m128i w = _mm_cvtepu8_epi16(bytes);
  const __m128i magnitude = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7);
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
  const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(magnitude, sign)), _mm256_set1_ps(256.f));
  const __m256i low7 = _mm256_and_si256(_mm256_cvtepu8_epi32(bytes), _mm256_set1_epi32(0x7F));
  const __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(low7, _mm256_set1_epi32(0x7F)));
  return _mm256_blendv_ps(v, _mm256_set1_ps(__builtin_nanf("")), nan);
}

KVQ_AVX2_TARGET inline const float* dequantize_rows_avx2(const fd_kvq::e4m3* q, const float* scales, float* out,
                                                     int64_t n, int d) {
  for (int64_t r = 0; r < n; ++r) {
    const __m256 s = _mm256_set1_ps(scales[r]);
    for (int i = 0; i < d; i += kAvx2Width) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + r * d + i));
      _mm256_storeu_ps(out + r * d + i, _mm256_mul_ps(e4m3_x8_to_float(bytes), s));
    }
  }
  return out;
}

// The 8 signed codes of 4 bytes of int4 pairs (element order: each byte's low nibble, then its high one).
KVQ_AVX2_TARGET inline __m256 int4_x8_codes(const uint8_t* four) {
  int32_t word;
  std::memcpy(&word, four, 4);
  const __m128i doubled = _mm_unpacklo_epi8(_mm_cvtsi32_si128(word), _mm_cvtsi32_si128(word));
  const __m256i lanes = _mm256_cvtepu8_epi32(doubled);  // b0 b0 b1 b1 b2 b2 b3 b3
  // The nibble to the top of the lane, then an arithmetic shift back: its sign-extended value.
  const __m256i top = _mm256_sllv_epi32(lanes, _mm256_setr_epi32(28, 24, 28, 24, 28, 24, 28, 24));
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(top, 28));
}

// int4 rows: out[r * d + i] = code_i * scales[r]; d a multiple of 8.
KVQ_AVX2_TARGET inline const float* dequantize_rows_avx2(const Int4Pair* q, const float* scales, float* out, int64_t n,
                                                     int d) {
  const int64_t bytes_per_row = d / 2;
  for (int64_t r = 0; r < n; ++r) {
    const __m256 s = _mm256_set1_ps(scales[r]);
    const uint8_t* row = &q[r * bytes_per_row].bits;
    for (int64_t i = 0; i < bytes_per_row; i += 4)
      _mm256_storeu_ps(out + r * d + 2 * i, _mm256_mul_ps(int4_x8_codes(row + i), s));
  }
  return out;
}

// x <- H x (kv_quant.h's butterflies, span 1, 2, 4, ... in this order); d a multiple of 8. Spans below
// 8 pair lanes inside a register: the lower lane of a pair takes a + b, the upper one a - b (a the lower).
KVQ_AVX2_TARGET inline void hadamard_avx2(float* x, int d) {
  for (int i = 0; i < d; i += kAvx2Width) {
    __m256 v = _mm256_loadu_ps(x + i);
    __m256 p = _mm256_permute_ps(v, 0xB1);  // span 1: lanes (0 1)(2 3)...
    v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xAA);
    p = _mm256_permute_ps(v, 0x4E);  // span 2
    v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xCC);
    p = _mm256_permute2f128_ps(v, v, 0x01);  // span 4
    v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xF0);
    _mm256_storeu_ps(x + i, v);
  }
  for (int span = kAvx2Width; span < d; span *= 2) {
    for (int i = 0; i < d; i += 2 * span) {
      for (int j = i; j < i + span; j += kAvx2Width) {
        const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + span);
        _mm256_storeu_ps(x + j, _mm256_add_ps(a, b));
        _mm256_storeu_ps(x + j + span, _mm256_sub_ps(a, b));
      }
    }
  }
}

// max |x[i]| (NaN values ignored, as fmaxf does); d a multiple of 8.
KVQ_AVX2_TARGET inline float absmax_avx2(const float* x, int d) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < d; i += kAvx2Width) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), magnitude), m);
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
}

// nearest-even of x / scale, clamped to +-limit (NaN -> -limit, as fmaxf), as 8 int32 codes.
KVQ_AVX2_TARGET inline __m256i clamped_codes8(const float* x, __m256 scale, float limit) {
  const __m256 y = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x), scale), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-limit)), _mm256_set1_ps(limit)));
}

// fd_kvq::int8_code of d values (d a multiple of 8).
KVQ_AVX2_TARGET inline void int8_codes_avx2(const float* x, int d, float scale, int8_t* out) {
  const __m256 s = _mm256_set1_ps(scale);
  for (int i = 0; i < d; i += kAvx2Width) {
    const __m256i c = clamped_codes8(x + i, s, fd_kvq::kInt8Max);
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), _mm_packs_epi16(words, words));
  }
}

// fd_kvq::int4_code of d values packed two per byte, the even element's nibble low (d a multiple of 8).
KVQ_AVX2_TARGET inline void int4_codes_avx2(const float* x, int d, float scale, Int4Pair* out) {
  const __m256 s = _mm256_set1_ps(scale);
  for (int i = 0; i < d; i += kAvx2Width) {
    const __m256i nibbles = _mm256_and_si256(clamped_codes8(x + i, s, fd_kvq::kInt4Max), _mm256_set1_epi32(0xF));
    // 64-bit lane j holds elements 2j (bits 0..3) and 2j + 1 (bits 32..35): move the latter to 4..7.
    const __m256i pairs = _mm256_or_si256(nibbles, _mm256_srli_epi64(nibbles, 28));
    const __m256i bytes = _mm256_shuffle_epi8(pairs, _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                      -1, -1, -1, -1, 0, 8, -1, -1, -1, -1, -1, -1,
                                                                      -1, -1, -1, -1, -1, -1, -1, -1));
    const uint16_t lo = uint16_t(_mm256_extract_epi16(bytes, 0)), hi = uint16_t(_mm256_extract_epi16(bytes, 8));
    std::memcpy(&out[i / 2].bits, &lo, 2);
    std::memcpy(&out[i / 2 + 2].bits, &hi, 2);
  }
}

// fd_kvq::e4m3_from_float of x / scale, 8 at a time (the same branches as blends).
KVQ_AVX2_TARGET inline void e4m3_codes_avx2(const float* x, int d, float scale, fd_kvq::e4m3* out) {
  const __m256 s = _mm256_set1_ps(scale);
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int i = 0; i < d; i += kAvx2Width) {
    const __m256 y = _mm256_div_ps(_mm256_loadu_ps(x + i), s);
    const __m256 a = _mm256_and_ps(y, magnitude);
    const __m256i u = _mm256_castps_si256(a);
    // normal: round the mantissa to 3 bits, ties to even, then exponent - 120 and mantissa.
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFFF),
                                                           _mm256_and_si256(_mm256_srli_epi32(u, 20), _mm256_set1_epi32(1))));
    __m256i code = _mm256_or_si256(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_srli_epi32(r, 23), _mm256_set1_epi32(120)), 3),
                                   _mm256_and_si256(_mm256_srli_epi32(r, 20), _mm256_set1_epi32(7)));
    code = _mm256_min_epi32(code, _mm256_set1_epi32(0x7E));
    const __m256 subnormal = _mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ);
    const __m256i sub = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(512.f)),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    code = _mm256_blendv_epi8(code, sub, _mm256_castps_si256(subnormal));
    const __m256 saturated = _mm256_cmp_ps(a, _mm256_set1_ps(fd_kvq::kE4M3Max), _CMP_GE_OQ);
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7E), _mm256_castps_si256(saturated));
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q)));
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(y), 24), _mm256_set1_epi32(0x80));
    const __m256i c = _mm256_or_si256(code, sign);  // 0..255 per lane
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), _mm_packus_epi16(words, words));
  }
}

}  // namespace fd_cpu
