// The GGUF-block dense layer's AVX2 + FMA kernels (linear_blocks.cc has the layout and the rules): a
// panel's 32 weights at one input are four 8-lane registers, each weight rebuilt with the same
// operations as the AVX-512 and portable decodes, and each output the same chain of fused multiply-adds
// over k = 0..K-1 from 0.0f, so every instruction set gives the same bits.
//
// A u4 nibble becomes its float by a mask and a conversion (AVX2's vpermps looks up 8 values, not 16).
// AVX2 has 16 vector registers where AVX-512 has 32: a tile of more than one row walks the panel in two
// halves of 16 columns (each weight is still decoded once), so a row's accumulators and the weights of
// an input fit; one row takes the whole panel, four accumulator chains, enough to hide the FMA latency
// behind the decode's own work.
#pragma once

#include <immintrin.h>

#include "linear_blocks_form.h"

#define BLOCKS_AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define BLOCKS_AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) inline

namespace fd_cpu {
namespace linear {

constexpr int kAvx2Lanes = 8;

// A panel's weight bytes are asked for this far ahead of their use by the kernels that take the whole
// panel (one row: a decode step streams the weights). A decode step's dense work (SmolLM2's 121 products,
// one row, 2 threads, AMD EPYC with AVX2) ran ~20% faster with it; 512 to 8192 bytes tried, 2048 to 4096
// best, near the rate at which the same items merely read their bytes.
constexpr int kAvx2PrefetchBytes = 2048;

// ONE_ROUNDING: every scale * q is exact in float32 (linear_blocks_avx512.h says why one FMA then gives
// the two roundings' value).
template <bool ONE_ROUNDING>
BLOCKS_AVX2_INLINE __m256 u4_weights8(__m256i words, __m256 d, __m256 o) {
  const __m256 q = _mm256_cvtepi32_ps(_mm256_and_si256(words, _mm256_set1_epi32(15)));
  if constexpr (ONE_ROUNDING) return _mm256_fmadd_ps(d, q, o);
  return _mm256_add_ps(_mm256_mul_ps(d, q), o);
}

BLOCKS_AVX2_INLINE __m256 i8_weights8(const uint8_t* q8, __m256 d) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q8));
  return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
}

// fn(k, w) for k = 0..K-1, w[v] panel p's weights of columns 8 (V0 + v) .. 8 (V0 + v) + 7 at k, v < V.
template <bool U4, bool HALF, bool ONE_ROUNDING, int V0, int V, typename Fn>
BLOCKS_AVX2_INLINE void for_each_k_avx2(const Blocks& b, int64_t p, Fn fn) {
  const uint8_t* q = b.q + p * b.q_stride();
  const int64_t s0 = p * b.s_stride() + kAvx2Lanes * V0;
  for (int64_t g = 0; g < b.k_dim / b.group; ++g) {
    __m256 d[V], o[V];
    for (int v = 0; v < V; ++v) d[v] = load_table8<HALF>(b.scale, s0 + g * kPanel + kAvx2Lanes * v);
    if constexpr (U4) {
      for (int v = 0; v < V; ++v) o[v] = load_table8<HALF>(b.offset, s0 + g * kPanel + kAvx2Lanes * v);
      for (int64_t k = g * b.group; k < (g + 1) * b.group; k += kU4Inputs) {
        if constexpr (V == 4) prefetch_lines<2>(q + k * 16 + kAvx2PrefetchBytes);
        __m256i words[V];
        for (int v = 0; v < V; ++v)
          words[v] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k * 16 + 32 * (V0 + v)));
#pragma GCC unroll 8
        for (int s = 0; s < kU4Inputs; ++s) {
          __m256 w[V];
          for (int v = 0; v < V; ++v) {
            w[v] = u4_weights8<ONE_ROUNDING>(words[v], d[v], o[v]);
            words[v] = _mm256_srli_epi32(words[v], 4);
          }
          fn(k + s, w);
        }
      }
    } else {
      for (int64_t k = g * b.group; k < (g + 1) * b.group; ++k) {
        if constexpr (V == 4)
          if (k % 2 == 0) prefetch_lines<1>(q + k * 32 + kAvx2PrefetchBytes);
        __m256 w[V];
        for (int v = 0; v < V; ++v) w[v] = i8_weights8(q + k * 32 + kAvx2Lanes * (V0 + v), d[v]);
        fn(k, w);
      }
    }
  }
}

// Panel p as float32 [K, 32] in `out`.
template <bool U4, bool HALF>
BLOCKS_AVX2_TARGET void dequant_panel_avx2(const Blocks& b, int64_t p, float* out) {
  for_each_k_avx2<U4, HALF, false, 0, 4>(b, p, [&](int64_t k, const __m256* w) BLOCKS_AVX2_TARGET {
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(out + k * kPanel + kAvx2Lanes * v, w[v]);
  });
}

// The first `cols` (of 8) lanes of acc at y.
BLOCKS_AVX2_INLINE void store_lanes(float* y, __m256 acc, int cols) {
  if (cols >= kAvx2Lanes) return _mm256_storeu_ps(y, acc);
  if (cols <= 0) return;
  const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  _mm256_maskstore_ps(y, live, acc);
}

// R rows x panel p's columns 8 V0 .. 8 (V0 + V) - 1, the weights decoded next to the FMAs; `cols` counts
// the panel's live columns (from its column 0).
template <bool U4, bool HALF, bool ONE_ROUNDING, int R, int V0, int V>
BLOCKS_AVX2_TARGET void fused_tile_avx2(const float* x, const Blocks& b, int64_t p, float* y, int64_t ldy, int cols) {
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  const int64_t k_dim = b.k_dim;
  for_each_k_avx2<U4, HALF, ONE_ROUNDING, V0, V>(b, p, [&](int64_t k, const __m256* w) BLOCKS_AVX2_TARGET {
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * k_dim + k);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(a, w[v], acc[r][v]);
    }
  });
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      store_lanes(y + r * ldy + kAvx2Lanes * (V0 + v), acc[r][v], cols - kAvx2Lanes * (V0 + v));
}

// Panels per work item of a one-row product (a decode step's): each worker streams the same number of
// contiguous runs. Groups of 4 (kPanelGroup), 8, 12 and 16 measured within this machine's noise of one
// another (SmolLM2 decode, AMD EPYC with AVX2, 2 threads, interleaved rounds); 8 is the run a product
// of SmolLM2's smallest shape (18 panels) still splits evenly over two workers.
constexpr int64_t kAvx2RowPanels = 8;

// Up to kFusedRowsAvx2 rows (a decode step's): one or two rows over the whole panel (4 or 8 accumulator
// chains), more in two halves of 16 columns. Past 5 rows the accumulators spill and a panel dequantized
// once into a buffer for linear_tiles.h's tiles is faster (measured on SmolLM2's shapes, 1 to 32 rows).
constexpr int kFusedRowsAvx2 = 5;

template <bool U4, bool HALF, bool ONE_ROUNDING, int R>
void fused_rows_avx2(int rows, const float* x, const Blocks& b, int64_t p, float* y, int64_t ldy, int cols) {
  if constexpr (R <= 2) {
    if (R == 2 && rows < 2) return fused_tile_avx2<U4, HALF, ONE_ROUNDING, 1, 0, 4>(x, b, p, y, ldy, cols);
    fused_tile_avx2<U4, HALF, ONE_ROUNDING, R, 0, 4>(x, b, p, y, ldy, cols);
  } else {
    if (rows < R) return fused_rows_avx2<U4, HALF, ONE_ROUNDING, R - 1>(rows, x, b, p, y, ldy, cols);
    fused_tile_avx2<U4, HALF, ONE_ROUNDING, R, 0, 2>(x, b, p, y, ldy, cols);
    if (cols > 2 * kAvx2Lanes) fused_tile_avx2<U4, HALF, ONE_ROUNDING, R, 2, 2>(x, b, p, y, ldy, cols);
  }
}

}  // namespace linear
}  // namespace fd_cpu
