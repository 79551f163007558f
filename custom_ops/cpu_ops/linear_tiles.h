// The fp32 register tiles of the packed dense layer (linear_packed.cc) and the
// GGUF-block dense layer (linear_blocks.cc, which dequantizes a panel and then
// runs these): rows x 32 outputs of one [K, 32] panel, each output one chain
// of fused multiply-adds over k = 0..K-1 from 0.0f.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu_isa.h"
#include "work_pool.h"

namespace fd_cpu {
namespace linear {

constexpr int kPanel = 32;    // output columns per panel
constexpr int kRowBlock = 48;  // rows of x kept hot while a thread walks its panels
constexpr int kPanelGroup = 4;  // panels per work item

// The first `cols` of each row's 32 accumulated outputs into y (row stride ldy).
template <int R>
__attribute__((target("avx512f"))) inline void store_tile_avx512(const __m512 (&acc)[R][2], float* y, int64_t ldy,
                                                                int cols) {
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : __mmask16((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : __mmask16((1u << (cols - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, acc[r][0]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, acc[r][1]);
  }
}

// rows x 32 outputs of one panel. R is a compile-time row count so the
// accumulators live in registers.
template <int R>
__attribute__((target("avx512f"))) void tile_avx512(const float* x, int64_t k_dim,
                                                   const float* panel, float* y,
                                                   int64_t ldy, int cols) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    const __m512 b0 = _mm512_loadu_ps(panel + k * kPanel);
    const __m512 b1 = _mm512_loadu_ps(panel + k * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * k_dim + k]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  store_tile_avx512<R>(acc, y, ldy, cols);
}

template <int R>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* x, int64_t k_dim,
                                                 const float* panel, float* y,
                                                 int64_t ldy, int cols) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_dim; ++k) {
    __m256 b[4];
    for (int j = 0; j < 4; ++j) b[j] = _mm256_loadu_ps(panel + k * kPanel + 8 * j);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_set1_ps(x[r * k_dim + k]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_fmadd_ps(a, b[j], acc[r][j]);
    }
  }
  alignas(32) float out[kPanel];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) _mm256_store_ps(out + 8 * j, acc[r][j]);
    std::memcpy(y + r * ldy, out, sizeof(float) * size_t(cols));
  }
}

inline void tile_scalar(const float* x, int rows, int64_t k_dim, const float* panel,
                 float* y, int64_t ldy, int cols) {
  for (int r = 0; r < rows; ++r) {
    float acc[kPanel] = {0.0f};
    for (int64_t k = 0; k < k_dim; ++k)
      for (int j = 0; j < kPanel; ++j)
        acc[j] = std::fma(x[r * k_dim + k], panel[k * kPanel + j], acc[j]);
    std::memcpy(y + r * ldy, acc, sizeof(float) * size_t(cols));
  }
}

// The last `rows` (< 12) rows: one tile of exactly that many.
template <int R>
void avx512_tail(int rows, const float* x, int64_t k_dim, const float* panel, float* y,
                 int64_t ldy, int cols) {
  if constexpr (R > 0) {
    if (rows == R) return tile_avx512<R>(x, k_dim, panel, y, ldy, cols);
    avx512_tail<R - 1>(rows, x, k_dim, panel, y, ldy, cols);
  }
}

using fd_cpu::Isa;

// rows [0, rows) of x against one panel, in register tiles.
inline void rows_times_panel(Isa isa, const float* x, int rows, int64_t k_dim,
                      const float* panel, float* y, int64_t ldy, int cols) {
  int r = 0;
  if (isa == Isa::kAvx512) {
    for (; r + 12 <= rows; r += 12) tile_avx512<12>(x + r * k_dim, k_dim, panel, y + r * ldy, ldy, cols);
    avx512_tail<11>(rows - r, x + r * k_dim, k_dim, panel, y + r * ldy, ldy, cols);
  } else if (isa == Isa::kAvx2) {
    for (; r + 3 <= rows; r += 3) tile_avx2<3>(x + r * k_dim, k_dim, panel, y + r * ldy, ldy, cols);
    if (rows - r == 2) tile_avx2<2>(x + r * k_dim, k_dim, panel, y + r * ldy, ldy, cols);
    if (rows - r == 1) tile_avx2<1>(x + r * k_dim, k_dim, panel, y + r * ldy, ldy, cols);
  } else {
    tile_scalar(x, rows, k_dim, panel, y, ldy, cols);
  }
}

// panel_fn(r0, rows, p) for every block of up to kRowBlock rows of an
// [m, panels * 32] output and every panel p, a work item being one row block
// and kPanelGroup panels; on every usable CPU when `parallel`.
template <typename PanelFn>
void for_each_panel(int64_t m, int64_t panels, bool parallel, PanelFn panel_fn) {
  const int64_t row_blocks = (m + kRowBlock - 1) / kRowBlock;
  const int64_t groups = (panels + kPanelGroup - 1) / kPanelGroup;
  const int workers = parallel ? fd_cpu::usable_cpus() : 1;
  fd_cpu::WorkPool::instance().run(row_blocks * groups, workers, [&](int64_t item, int) {
    const int64_t rb = item / groups, g = item % groups;
    const int64_t r0 = rb * kRowBlock;
    const int rows = int(std::min<int64_t>(kRowBlock, m - r0));
    for (int64_t p = g * kPanelGroup; p < std::min<int64_t>(panels, (g + 1) * kPanelGroup); ++p)
      panel_fn(r0, rows, p);
  });
}

// Whether a float32 panel product is worth waking a helper (a few microseconds each way).
inline bool float_product_worth_helpers(int64_t m, int64_t n, int64_t k_dim) {
  return double(m) * double(n) * double(k_dim) > double(1 << 20);
}

// y [m, n] = x [m, K] . W^T on float32 panels w ([P, K, 32], linear_packed's
// layout): the packed kernel's loop, also linear_blocks' on a dequantized weight.
inline void packed_product(const float* x, int64_t m, int64_t k_dim, const float* w, int64_t panels, float* y,
                           int64_t n, bool parallel) {
  const Isa isa = kernels_isa();
  for_each_panel(m, panels, parallel, [&](int64_t r0, int rows, int64_t p) {
    rows_times_panel(isa, x + r0 * k_dim, rows, k_dim, w + p * k_dim * kPanel, y + r0 * n + p * kPanel, n,
                     int(std::min<int64_t>(kPanel, n - p * kPanel)));
  });
}

}  // namespace linear
}  // namespace fd_cpu
