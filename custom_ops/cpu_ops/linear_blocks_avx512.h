// The GGUF-block dense layer's AVX-512 kernels (linear_blocks.cc has the layout and the rules): a
// panel's 32 weights at one input are two 16-lane registers.
#pragma once

#include <immintrin.h>

#include "linear_blocks_form.h"

namespace fd_cpu {
namespace linear {

// A u4 word register's low nibbles as floats (vpermps reads only the low 4 bits of each index).
__attribute__((target("avx512f"), always_inline)) inline __m512 nibble_values(__m512i words) {
  return _mm512_permutexvar_ps(words, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

// ONE_ROUNDING: the caller knows every scale * q of these blocks is exact in float32 (Q4_1's f16
// scale times a 4-bit q has at most 15 significant bits; Q4_K's f16 d times a 6-bit sc times q at
// most 21), so the multiply's rounding is a no-op and one fused multiply-add gives the very
// (scale * q) + offset of the two roundings, with one instruction less per 16 weights.
template <bool ONE_ROUNDING>
__attribute__((target("avx512f"), always_inline)) inline __m512 u4_weights(__m512i words, __m512 d, __m512 o) {
  if constexpr (ONE_ROUNDING) return _mm512_fmadd_ps(d, nibble_values(words), o);
  return _mm512_add_ps(_mm512_mul_ps(d, nibble_values(words)), o);
}

__attribute__((target("avx512f"), always_inline)) inline __m512 i8_weights(const uint8_t* q16, __m512 d) {
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q16)))));
}

// fn(k, w0, w1) for k = 0..K-1 with panel p's 32 weights at k (columns 0-15 in w0, 16-31 in w1).
template <bool U4, bool HALF, bool ONE_ROUNDING, typename Fn>
__attribute__((target("avx512f"), always_inline)) inline void for_each_k(const Blocks& b, int64_t p, Fn fn) {
  const uint8_t* q = b.q + p * b.q_stride();
  const int64_t s0 = p * b.s_stride();
  for (int64_t g = 0; g < b.k_dim / b.group; ++g) {
    const __m512 d0 = load_table16<HALF>(b.scale, s0 + g * kPanel);
    const __m512 d1 = load_table16<HALF>(b.scale, s0 + g * kPanel + 16);
    if constexpr (U4) {
      const __m512 o0 = load_table16<HALF>(b.offset, s0 + g * kPanel);
      const __m512 o1 = load_table16<HALF>(b.offset, s0 + g * kPanel + 16);
      for (int64_t k = g * b.group; k < (g + 1) * b.group; k += kU4Inputs) {
        __m512i lo = _mm512_loadu_si512(q + k * 16), hi = _mm512_loadu_si512(q + k * 16 + 64);
#pragma GCC unroll 8
        for (int s = 0; s < kU4Inputs; ++s) {
          fn(k + s, u4_weights<ONE_ROUNDING>(lo, d0, o0), u4_weights<ONE_ROUNDING>(hi, d1, o1));
          lo = _mm512_srli_epi32(lo, 4);
          hi = _mm512_srli_epi32(hi, 4);
        }
      }
    } else {
      for (int64_t k = g * b.group; k < (g + 1) * b.group; ++k)
        fn(k, i8_weights(q + k * 32, d0), i8_weights(q + k * 32 + 16, d1));
    }
  }
}

// Panel p as float32 [K, 32] in `out`.
template <bool U4, bool HALF>
__attribute__((target("avx512f"))) void dequant_panel_avx512(const Blocks& b, int64_t p, float* out) {
  for_each_k<U4, HALF, false>(b, p, [&](int64_t k, __m512 w0, __m512 w1) __attribute__((target("avx512f"))) {
    _mm512_storeu_ps(out + k * kPanel, w0);
    _mm512_storeu_ps(out + k * kPanel + 16, w1);
  });
}

// R rows x the 32 outputs of panel p, the weights decoded next to the FMAs.
template <bool U4, bool HALF, bool ONE_ROUNDING, int R>
__attribute__((target("avx512f"))) void fused_tile(const float* x, const Blocks& b, int64_t p,
                                                  float* y, int64_t ldy, int cols) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t k_dim = b.k_dim;
  for_each_k<U4, HALF, ONE_ROUNDING>(b, p, [&](int64_t k, __m512 w0, __m512 w1) __attribute__((target("avx512f"))) {
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * k_dim + k]);
      acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
    }
  });
  store_tile_avx512<R>(acc, y, ldy, cols);
}

// One row (a decode step's GEMV) x panels p and p + 1 together: four independent accumulator chains
// instead of two hide the FMA latency a single panel's chain waits on. Each output is still the one
// chain over k = 0..K-1 from 0.0f, so the bits are the one-panel tile's.
template <bool U4, bool HALF, bool ONE_ROUNDING>
__attribute__((target("avx512f"))) void fused_row_two_panels(const float* x, const Blocks& b, int64_t p,
                                                            float* y, int cols0, int cols1) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  const uint8_t* q0 = b.q + p * b.q_stride();
  const uint8_t* q1 = q0 + b.q_stride();
  const int64_t s0 = p * b.s_stride(), s1 = s0 + b.s_stride();
  const auto fma4 = [&](int64_t k, __m512 w00, __m512 w01, __m512 w10, __m512 w11)
                        __attribute__((target("avx512f"), always_inline)) {
    const __m512 a = _mm512_set1_ps(x[k]);
    acc[0] = _mm512_fmadd_ps(a, w00, acc[0]);
    acc[1] = _mm512_fmadd_ps(a, w01, acc[1]);
    acc[2] = _mm512_fmadd_ps(a, w10, acc[2]);
    acc[3] = _mm512_fmadd_ps(a, w11, acc[3]);
  };
  for (int64_t g = 0; g < b.k_dim / b.group; ++g) {
    const int64_t s = g * kPanel;
    const __m512 d00 = load_table16<HALF>(b.scale, s0 + s), d01 = load_table16<HALF>(b.scale, s0 + s + 16);
    const __m512 d10 = load_table16<HALF>(b.scale, s1 + s), d11 = load_table16<HALF>(b.scale, s1 + s + 16);
    if constexpr (U4) {
      const __m512 o00 = load_table16<HALF>(b.offset, s0 + s), o01 = load_table16<HALF>(b.offset, s0 + s + 16);
      const __m512 o10 = load_table16<HALF>(b.offset, s1 + s), o11 = load_table16<HALF>(b.offset, s1 + s + 16);
      for (int64_t k = g * b.group; k < (g + 1) * b.group; k += kU4Inputs) {
        prefetch_lines<2>(q0 + k * 16 + kPrefetchBytes);
        prefetch_lines<2>(q1 + k * 16 + kPrefetchBytes);
        __m512i a0 = _mm512_loadu_si512(q0 + k * 16), a1 = _mm512_loadu_si512(q0 + k * 16 + 64);
        __m512i b0 = _mm512_loadu_si512(q1 + k * 16), b1 = _mm512_loadu_si512(q1 + k * 16 + 64);
#pragma GCC unroll 8
        for (int t = 0; t < kU4Inputs; ++t) {
          fma4(k + t, u4_weights<ONE_ROUNDING>(a0, d00, o00), u4_weights<ONE_ROUNDING>(a1, d01, o01),
               u4_weights<ONE_ROUNDING>(b0, d10, o10), u4_weights<ONE_ROUNDING>(b1, d11, o11));
          a0 = _mm512_srli_epi32(a0, 4);
          a1 = _mm512_srli_epi32(a1, 4);
          b0 = _mm512_srli_epi32(b0, 4);
          b1 = _mm512_srli_epi32(b1, 4);
        }
      }
    } else {
      for (int64_t k = g * b.group; k < (g + 1) * b.group; ++k)
        fma4(k, i8_weights(q0 + k * 32, d00), i8_weights(q0 + k * 32 + 16, d01), i8_weights(q1 + k * 32, d10),
             i8_weights(q1 + k * 32 + 16, d11));
    }
  }
  const __m512 first[1][2] = {{acc[0], acc[1]}}, second[1][2] = {{acc[2], acc[3]}};
  store_tile_avx512<1>(first, y, 0, cols0);
  store_tile_avx512<1>(second, y + kPanel, 0, cols1);
}

template <bool U4, bool HALF, bool ONE_ROUNDING, int R>
void fused_rows(int rows, const float* x, const Blocks& b, int64_t p, float* y, int64_t ldy, int cols) {
  if constexpr (R > 0) {
    if (rows == R) return fused_tile<U4, HALF, ONE_ROUNDING, R>(x, b, p, y, ldy, cols);
    fused_rows<U4, HALF, ONE_ROUNDING, R - 1>(rows, x, b, p, y, ldy, cols);
  }
}

}  // namespace linear
}  // namespace fd_cpu
