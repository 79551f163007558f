// The CPU op's quantized pages, 16 values at a time with AVX-512 (kv_quant_rows.h says what they
// promise). The reads: int8 -> float, or e4m3 -> fp16 bits -> float times 2^8, exact, then one
// multiply by the row's scale; int4: the row's 16 possible values (code x scale, the same one
// multiply) looked up by nibble.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "attention_tiles.h"
#include "kv_quant.h"
#include "kv_quant_rows.h"

namespace fd_cpu {

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

// The 16 possible values of an int4 row with this scale, indexed by nibble (0..7, then -8..-1): code
// x scale, the portable read's one multiply, once per row.
__attribute__((target("avx512f"))) inline __m512 int4_row_values(float scale) {
  const __m512 codes = _mm512_cvtepi32_ps(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1));
  return _mm512_mul_ps(codes, _mm512_set1_ps(scale));
}

// The 32 values of 16 bytes of int4 pairs, in element order: the bytes are split into their low and
// high nibbles and interleaved back as bytes (128-bit operations), then each 16 are widened and
// looked up in the row's table (vpermps reads a lane's low 4 bits). No int -> float conversion and
// no multiply per value.
__attribute__((target("avx512f"))) inline void int4_x32(const uint8_t* bytes, __m512 table, __m512* first,
                                                       __m512* second) {
  const __m128i nibble = _mm_set1_epi8(0xF);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  const __m128i even = _mm_and_si128(b, nibble), odd = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
  *first = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(even, odd)), table);
  *second = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(even, odd)), table);
}

// int4 rows: out[r * d + i] = code_i * scales[r]; d a multiple of 32. Half the int8 read's bytes for
// about its instructions (a microbenchmark of the read alone: ~5% under int8's, both bound by the
// float stores into the scratch).
__attribute__((target("avx512f"))) inline const float* dequantize_rows_avx512(const Int4Pair* q,
                                                                             const float* scales,
                                                                             float* out, int64_t n, int d) {
  const int64_t bytes_per_row = d / 2;
  for (int64_t r = 0; r < n; ++r) {
    const __m512 table = int4_row_values(scales[r]);
    const uint8_t* row = &q[r * bytes_per_row].bits;
    float* o = out + r * d;
    for (int64_t i = 0; i < bytes_per_row; i += kLanes) {
      __m512 a, b;
      int4_x32(row + i, table, &a, &b);
      _mm512_storeu_ps(o + 2 * i, a);
      _mm512_storeu_ps(o + 2 * i + kLanes, b);
    }
  }
  return out;
}

// weighted_values_shared<4, NR> (attention_tiles.h) over int4 value rows of d = 64 read straight
// from the page: each row's 64 values are built in registers (the floats dequantize_rows_avx512
// stores) and folded with the same fused multiply-adds in the same order, so the bits are those of
// the scratch path, without its 16 KB of stores and loads per page. For a tile whose readers fit
// one batch (a decode token's query heads); wider tiles dequantize once into the scratch instead.
template <int NR>
__attribute__((target("avx512f"))) void weighted_values_int4_d64(const float* const* ws, float* const* accs,
                                                                const Int4Pair* v, const float* scales, int n) {
  constexpr int B = 4;
  __m512 a[NR][B];
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < B; ++b) a[r][b] = _mm512_loadu_ps(accs[r] + b * kLanes);
  for (int j = 0; j < n; ++j) {
    const __m512 table = int4_row_values(scales[j]);
    const uint8_t* row = &v[int64_t(j) * 32].bits;
    __m512 vb[B];
    int4_x32(row, table, &vb[0], &vb[1]);
    int4_x32(row + 16, table, &vb[2], &vb[3]);
    for (int r = 0; r < NR; ++r) {
      const __m512 wj = _mm512_set1_ps(ws[r][j]);
      for (int b = 0; b < B; ++b) a[r][b] = _mm512_fmadd_ps(wj, vb[b], a[r][b]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(accs[r] + b * kLanes, a[r][b]);
}

// x <- H x (kv_quant.h's butterflies, span 1, 2, 4, ... in this order); d a multiple of 16. Spans
// below 16 pair lanes inside a register: lane l takes x[l] + x[l ^ s] in the lower half of each pair
// of runs and x[l ^ s] - x[l] in the upper half (= a - b with a the lower element).
__attribute__((target("avx512f"))) inline void hadamard_avx512(float* x, int d) {
  static const __m512i partner[4] = {
      _mm512_setr_epi32(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14),
      _mm512_setr_epi32(2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13),
      _mm512_setr_epi32(4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11),
      _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)};
  static const __mmask16 upper[4] = {0xAAAA, 0xCCCC, 0xF0F0, 0xFF00};
  for (int i = 0; i < d; i += kLanes) {
    __m512 v = _mm512_loadu_ps(x + i);
    for (int k = 0; k < 4; ++k) {
      const __m512 p = _mm512_permutexvar_ps(partner[k], v);
      v = _mm512_mask_sub_ps(_mm512_add_ps(v, p), upper[k], p, v);
    }
    _mm512_storeu_ps(x + i, v);
  }
  for (int span = kLanes; span < d; span *= 2) {
    for (int i = 0; i < d; i += 2 * span) {
      for (int j = i; j < i + span; j += kLanes) {
        const __m512 a = _mm512_loadu_ps(x + j), b = _mm512_loadu_ps(x + j + span);
        _mm512_storeu_ps(x + j, _mm512_add_ps(a, b));
        _mm512_storeu_ps(x + j + span, _mm512_sub_ps(a, b));
      }
    }
  }
}

// max |x[i]| (NaN values ignored, as fmaxf does); d a multiple of 16.
__attribute__((target("avx512f"))) inline float absmax_avx512(const float* x, int d) {
  __m512 m = _mm512_setzero_ps();
  for (int i = 0; i < d; i += kLanes) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), m);
  return _mm512_reduce_max_ps(m);
}

// fd_kvq::int8_code of 16 values: nearest-even of x / scale, clamped to +-127 (NaN -> -127).
__attribute__((target("avx512f"))) inline void int8_codes_avx512(const float* x, int d, float scale, int8_t* out) {
  const __m512 s = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-fd_kvq::kInt8Max), hi = _mm512_set1_ps(fd_kvq::kInt8Max);
  for (int i = 0; i < d; i += kLanes) {
    const __m512 y = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), s),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 c = _mm512_min_ps(_mm512_max_ps(y, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(c)));
  }
}

// fd_kvq::int4_code of d values packed two per byte (kv_quant.h's int4_pack): nearest-even of
// x / scale clamped to +-7 (NaN -> -7, as fmaxf), then each pair of 32-bit codes (one 64-bit lane)
// into one byte, the even element's nibble low. d a multiple of 16.
__attribute__((target("avx512f"))) inline void int4_codes_avx512(const float* x, int d, float scale, Int4Pair* out) {
  const __m512 s = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-fd_kvq::kInt4Max), hi = _mm512_set1_ps(fd_kvq::kInt4Max);
  for (int i = 0; i < d; i += kLanes) {
    const __m512 y = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), s),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i nibbles = _mm512_and_si512(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(y, lo), hi)),
                                             _mm512_set1_epi32(0xF));
    // 64-bit lane j holds elements 2j (bits 0..3) and 2j + 1 (bits 32..35): move the latter to 4..7.
    const __m512i pairs = _mm512_or_si512(nibbles, _mm512_srli_epi64(nibbles, 28));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i / 2), _mm512_cvtepi64_epi8(pairs));
  }
}

// fd_kvq::e4m3_from_float of x / scale, 16 at a time (the same branches as masks).
__attribute__((target("avx512f"))) inline void e4m3_codes_avx512(const float* x, int d, float scale, fd_kvq::e4m3* out) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int i = 0; i < d; i += kLanes) {
    const __m512 y = _mm512_div_ps(_mm512_loadu_ps(x + i), s);
    const __m512 a = _mm512_abs_ps(y);
    const __m512i u = _mm512_castps_si512(a);
    // normal: round the mantissa to 3 bits, ties to even, then exponent - 120 and mantissa.
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF),
                                                            _mm512_and_si512(_mm512_srli_epi32(u, 20), _mm512_set1_epi32(1))));
    __m512i code = _mm512_or_si512(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_srli_epi32(r, 23), _mm512_set1_epi32(120)), 3),
                                   _mm512_and_si512(_mm512_srli_epi32(r, 20), _mm512_set1_epi32(7)));
    code = _mm512_min_epi32(code, _mm512_set1_epi32(0x7E));
    const __mmask16 subnormal = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
    const __m512i sub = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(512.f)),
                                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    code = _mm512_mask_mov_epi32(code, subnormal, sub);
    code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(fd_kvq::kE4M3Max), _CMP_GE_OQ),
                                 _mm512_set1_epi32(0x7E));
    code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7F));
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(y), 24), _mm512_set1_epi32(0x80));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign)));
  }
}

}  // namespace fd_cpu
