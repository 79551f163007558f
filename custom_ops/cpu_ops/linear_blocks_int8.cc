// CPU dense layer on GGUF blocks with int8 activations (opt-in: FD_CPU_INT8_ACTIVATIONS=1):
// y[M, N] ~= x[M, K] . W[N, K]^T, where each row of x is quantized per block of 32 inputs to int8
// (one float32 scale per block, round to nearest even) and each block's products are integer dot
// products (AVX-512 VNNI vpdpbusd: 4 products of u8 x s8 summed into an int32 lane; AVX2's vpmaddubsw
// and vpmaddwd, the same sums), as llama.cpp multiplies Q4/Q8 weights with its Q8 activations.
//
// Why: the exact kernel (linear_blocks.cc) rebuilds every float32 weight and runs one FMA per
// weight: on a small model's decode step that arithmetic, not the ~110 MB read, is the cost. Here
// one vpdpbusd does 64 multiply-adds of a 16-column group, so the step approaches the read.
// Not exact: the activations lose bits (error ~ |x| / 254 per element, relative), so the outputs
// differ from transformers' by that much; docs/benchmarks.md states the measured accuracy.
//
// A row's bits never depend on its batch mates: a row is quantized on its own, its integer sums
// are exact, and its float epilogue is the same sequence of operations whatever the row count or
// the row's place in a tile; the AVX2 kernel and the portable C++ twin (FD_CPU_LINEAR_ISA=avx2 / generic,
// or a CPU without VNNI / AVX2) perform the same float operations in the same order, so they give the
// same bits.
//
// Per block g of 32 inputs of one output column, with the row's int8 activations a_k, their scale
// dx and their sum sa, and the weight's integers q_k:
//   u4 (w = d * q + m):   block = dx * fma(d, float(sum a_k q_k), m * float(sa))
//   i8 (w = d * q):       block = dx * (d * float(sum a_k q_k))
//   y = sum over blocks in order g = 0, 1, ..., each added with one fma(dx, t, y) from 0.0f.
// (i8 weights are stored as q + 128, unsigned, and 128 * sa taken off the integer sum.)
//
// Layout, per panel of 32 output columns, per quad of 4 consecutive inputs k = 4i..4i+3:
//   u4: q [P, K / 4, 64] uint8: byte 4j + t holds column j's q at k = 4i + t (low nibble) and
//       column j + 16's (high nibble), j < 16
//   i8: q [P, K / 4, 128] uint8: byte 4j + t holds column j's q + 128 at k = 4i + t, j < 32
//   scale, offset: [P, K / 32, 32] as linear_blocks' (columns past N: 0), float32, or float16 where
//   every value is one (Q4_1 and Q8_0 store f16 scales: 4 bytes less per 32 weights to read; the
//   conversion is exact, so the same bits).

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "paddle/extension.h"
#include "block_tables.h"
#include "linear_blocks.h"
#include "linear_tiles.h"
#include "scratch.h"
#include "work_pool.h"

namespace {

using namespace fd_cpu::linear;

constexpr int kGroup = 32;     // inputs per activation block and per weight block
constexpr int kRowTile = 4;    // rows sharing one decode of the weight bytes

struct Int8Blocks {
  const uint8_t* q = nullptr;
  const void* scale = nullptr;   // float32, or float16 bits (half)
  const void* offset = nullptr;  // u4 only, the same type
  bool u4 = true;
  bool half = false;
  int64_t k_dim = 0;

  int64_t quad_bytes() const { return u4 ? 64 : 128; }
  int64_t q_stride() const { return (k_dim / 4) * quad_bytes(); }
  int64_t s_stride() const { return (k_dim / kGroup) * kPanel; }
};

// A row of activations quantized per block of 32: int8 values, the block's scale and sum.
struct QuantRow {
  const int8_t* a;
  const float* dx;
  const int32_t* sa;
};

// The same arithmetic in both builds: amax over the block, dx = amax / 127, a = nearest-even of
// x * (1 / dx), sums in int32. -ffp-contract=off keeps x * inv one rounding here, as in the AVX path.
void quantize_row(const float* x, int64_t k_dim, int8_t* a, float* dx, int32_t* sa) {
  for (int64_t g = 0; g < k_dim / kGroup; ++g) {
    const float* xg = x + g * kGroup;
    float amax = 0.0f;
    for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(xg[i]));
    const float d = amax / 127.0f;
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < kGroup; ++i) {
      const float v = std::nearbyint(xg[i] * inv);
      const int32_t qv = int32_t(std::min(127.0f, std::max(-127.0f, v)));
      a[g * kGroup + i] = int8_t(qv);
      sum += qv;
    }
    dx[g] = d;
    sa[g] = sum;
  }
}

// Column j's integer at input k of panel p, and the weight's integers' zero point (i8: 128).
inline int32_t q_at(const Int8Blocks& b, int64_t p, int64_t k, int j) {
  const uint8_t* quad = b.q + p * b.q_stride() + (k / 4) * b.quad_bytes();
  const int t = int(k % 4);
  if (b.u4) {
    const uint8_t byte = quad[4 * (j & 15) + t];
    return j < 16 ? (byte & 15) : (byte >> 4);
  }
  return int32_t(quad[4 * j + t]) - 128;
}

// Portable: rows [0, rows) of panel p, the same float operations in the same order as the VNNI tile.
void panel_rows_portable(const QuantRow* rows_q, int rows, const Int8Blocks& b, int64_t p, float* y,
                         int64_t ldy, int cols) {
  const int64_t groups = b.k_dim / kGroup;
  const int64_t s0 = p * b.s_stride();
  for (int r = 0; r < rows; ++r) {
    const QuantRow& row = rows_q[r];
    for (int j = 0; j < cols; ++j) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t dot = 0;
        for (int i = 0; i < kGroup; ++i) dot += int32_t(row.a[g * kGroup + i]) * q_at(b, p, g * kGroup + i, j);
        const int64_t i = s0 + g * kPanel + j;
        const float d = table_at(b.scale, b.half, i);
        const float t = b.u4 ? std::fma(d, float(dot), table_at(b.offset, b.half, i) * float(row.sa[g]))
                             : d * float(dot);
        acc = std::fma(row.dx[g], t, acc);
      }
      y[r * ldy + j] = acc;
    }
  }
}


#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))

// R rows x the 32 columns of panel p: per quad, the weight bytes are loaded and split once and
// multiplied into every row's int32 sums; per block the sums become floats in the order above.
template <bool U4, int R, bool HALF>
VNNI_TARGET void panel_rows_vnni(const QuantRow* rows_q, const Int8Blocks& b, int64_t p, float* y, int64_t ldy,
                                 int cols) {
  const uint8_t* q = b.q + p * b.q_stride();
  const int64_t s0 = p * b.s_stride();
  const __m512i low4 = _mm512_set1_epi8(15);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  constexpr int64_t quads_per_group = kGroup / 4;
  constexpr int64_t quad_bytes = U4 ? 64 : 128;
  const int64_t groups = b.k_dim / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
    const uint8_t* qg = q + g * quads_per_group * quad_bytes;
    for (int64_t i = 0; i < quads_per_group; ++i) {
      __m512i w0, w1;
      if constexpr (U4) {
        const __m512i v = _mm512_loadu_si512(qg + i * 64);
        w0 = _mm512_and_si512(v, low4);
        w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      } else {
        w0 = _mm512_loadu_si512(qg + i * 128);
        w1 = _mm512_loadu_si512(qg + i * 128 + 64);
      }
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, rows_q[r].a + g * kGroup + 4 * i, 4);
        const __m512i a = _mm512_set1_epi32(four);
        dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], w0, a);
        dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], w1, a);
      }
    }
    const __m512 d0 = load_table16<HALF>(b.scale, s0 + g * kPanel);
    const __m512 d1 = load_table16<HALF>(b.scale, s0 + g * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(rows_q[r].dx[g]);
      __m512 t0, t1;
      if constexpr (U4) {
        const __m512 sa = _mm512_set1_ps(float(rows_q[r].sa[g]));
        const __m512 m0 = _mm512_mul_ps(load_table16<HALF>(b.offset, s0 + g * kPanel), sa);
        const __m512 m1 = _mm512_mul_ps(load_table16<HALF>(b.offset, s0 + g * kPanel + 16), sa);
        t0 = _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(dot[r][0]), m0);
        t1 = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(dot[r][1]), m1);
      } else {
        // The stored q + 128: take 128 * sa off each column's sum (exact in int32).
        const __m512i bias = _mm512_set1_epi32(128 * rows_q[r].sa[g]);
        t0 = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][0], bias)));
        t1 = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][1], bias)));
      }
      acc[r][0] = _mm512_fmadd_ps(dx, t0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(dx, t1, acc[r][1]);
    }
  }
  store_tile_avx512<R>(acc, y, ldy, cols);
}

template <int R>
void panel_rows_vnni_tail(int rows, const QuantRow* rows_q, const Int8Blocks& b, int64_t p, float* y, int64_t ldy,
                          int cols) {
  if constexpr (R > 0) {
    if (rows == R) {
      if (b.half)
        return b.u4 ? panel_rows_vnni<true, R, true>(rows_q, b, p, y, ldy, cols)
                    : panel_rows_vnni<false, R, true>(rows_q, b, p, y, ldy, cols);
      return b.u4 ? panel_rows_vnni<true, R, false>(rows_q, b, p, y, ldy, cols)
                  : panel_rows_vnni<false, R, false>(rows_q, b, p, y, ldy, cols);
    }
    panel_rows_vnni_tail<R - 1>(rows, rows_q, b, p, y, ldy, cols);
  }
}

// AVX2 has no vpdpbusd: vpmaddubsw multiplies unsigned bytes by signed ones and adds pairs into int16,
// vpmaddwd adds those pairs into int32, the same exact integer sums. u4: a product is at most 15 x 127,
// so a block's 8 quads add up in int16 without saturating (8 x 2 x 1905 < 32767) before one vpmaddwd.
// i8: the stored q + 128 would saturate; the signed q's magnitude times the activation with q's sign
// does not (2 x 128 x 127 < 32767), a quad at a time. R rows x the 32 columns of panel p.
template <bool U4, int R, bool HALF>
__attribute__((target("avx2,fma,f16c"))) void panel_rows_avx2(const QuantRow* rows_q, const Int8Blocks& b,
                                                             int64_t p, float* y, int64_t ldy, int cols) {
  const uint8_t* q = b.q + p * b.q_stride();
  const int64_t s0 = p * b.s_stride();
  const __m256i low4 = _mm256_set1_epi8(15), flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
  constexpr int64_t quads_per_group = kGroup / 4;
  constexpr int64_t quad_bytes = U4 ? 64 : 128;
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t g = 0; g < b.k_dim / kGroup; ++g) {
    __m256i dot[R][4];  // int16 pair sums (u4) or int32 sums (i8) of columns 8v .. 8v + 7
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < 4; ++v) dot[r][v] = _mm256_setzero_si256();
    const uint8_t* qg = q + g * quads_per_group * quad_bytes;
    for (int64_t i = 0; i < quads_per_group; ++i) {
      __m256i w[4];  // columns 8v .. 8v + 7, 4 inputs each
      if constexpr (U4) {
        const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + i * 64));
        const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + i * 64 + 32));
        w[0] = _mm256_and_si256(first, low4);
        w[1] = _mm256_and_si256(second, low4);
        w[2] = _mm256_and_si256(_mm256_srli_epi16(first, 4), low4);
        w[3] = _mm256_and_si256(_mm256_srli_epi16(second, 4), low4);
      } else {
        for (int v = 0; v < 4; ++v)  // the signed q
          w[v] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + i * 128 + 32 * v)), flip);
      }
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, rows_q[r].a + g * kGroup + 4 * i, 4);
        const __m256i a = _mm256_set1_epi32(four);
        for (int v = 0; v < 4; ++v) {
          if constexpr (U4) {
            dot[r][v] = _mm256_add_epi16(dot[r][v], _mm256_maddubs_epi16(w[v], a));
          } else {
            const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w[v]), _mm256_sign_epi8(a, w[v]));
            dot[r][v] = _mm256_add_epi32(dot[r][v], _mm256_madd_epi16(pairs, ones));
          }
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(rows_q[r].dx[g]);
      const __m256 sa = _mm256_set1_ps(float(rows_q[r].sa[g]));
      for (int v = 0; v < 4; ++v) {
        const int64_t at = s0 + g * kPanel + 8 * v;
        const __m256 d = load_table8<HALF>(b.scale, at);
        __m256 t;
        if constexpr (U4) {
          const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[r][v], ones));
          t = _mm256_fmadd_ps(d, sums, _mm256_mul_ps(load_table8<HALF>(b.offset, at), sa));
        } else {
          t = _mm256_mul_ps(d, _mm256_cvtepi32_ps(dot[r][v]));
        }
        acc[r][v] = _mm256_fmadd_ps(dx, t, acc[r][v]);
      }
    }
  }
  alignas(32) float out[kPanel];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) _mm256_store_ps(out + 8 * v, acc[r][v]);
    std::memcpy(y + r * ldy, out, sizeof(float) * size_t(cols));
  }
}

// AVX2 tiles of up to 2 rows (the int16 sums of 4 columns' vectors per row fill the 16 registers).
constexpr int kAvx2RowTile = 2;

void panel_rows_avx2_tail(int rows, const QuantRow* rows_q, const Int8Blocks& b, int64_t p, float* y, int64_t ldy,
                          int cols) {
  const auto tile = [&](auto u4, auto half, auto r) {
    panel_rows_avx2<decltype(u4)::value, decltype(r)::value, decltype(half)::value>(rows_q, b, p, y, ldy, cols);
  };
  using T = std::true_type;
  using F = std::false_type;
  using One = std::integral_constant<int, 1>;
  using Two = std::integral_constant<int, 2>;
  if (rows == 2) {
    if (b.u4) return b.half ? tile(T{}, T{}, Two{}) : tile(T{}, F{}, Two{});
    return b.half ? tile(F{}, T{}, Two{}) : tile(F{}, F{}, Two{});
  }
  if (b.u4) return b.half ? tile(T{}, T{}, One{}) : tile(T{}, F{}, One{});
  b.half ? tile(F{}, T{}, One{}) : tile(F{}, F{}, One{});
}

}  // namespace

// AVX-512 without VNNI (Skylake-X) runs the AVX2 kernel: the same bits, and far faster than portable C++.
fd_cpu::linear::Int8Kernels fd_cpu::linear::int8_kernels() {
  static const bool vnni = [] {
    __builtin_cpu_init();
    return bool(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vnni"));
  }();
  const Isa isa = kernels_isa();
  if (vnni && isa == Isa::kAvx512) return Int8Kernels::kVnni;
  return isa == Isa::kScalar ? Int8Kernels::kPortable : Int8Kernels::kAvx2;
}

void fd_cpu::linear::int8_blocks_product(const paddle::Tensor& q, const paddle::Tensor& scale,
                                         const paddle::optional<paddle::Tensor>& offset, int64_t n, const float* xp,
                                         int64_t m, int64_t k_dim, float* yp) {
  PD_CHECK(q.is_cpu() && scale.is_cpu() && q.is_contiguous() && scale.is_contiguous(),
           "linear_blocks_int8: CPU contiguous operands only");
  PD_CHECK(q.dtype() == paddle::DataType::UINT8 && q.shape().size() == 3 && (q.shape()[2] == 64 || q.shape()[2] == 128),
           "linear_blocks_int8: q must be uint8 [panels, in / 4, 64 (u4) | 128 (i8)]");
  Int8Blocks b;
  b.u4 = q.shape()[2] == 64;
  b.k_dim = q.shape()[1] * 4;
  PD_CHECK(b.k_dim % kGroup == 0, "linear_blocks_int8: in-features ", b.k_dim, " are not a multiple of 32");
  b.half = scale.dtype() == paddle::DataType::FLOAT16;
  PD_CHECK((b.half || scale.dtype() == paddle::DataType::FLOAT32) && scale.shape().size() == 3 &&
               scale.shape()[0] == q.shape()[0] && scale.shape()[1] == b.k_dim / kGroup && scale.shape()[2] == kPanel,
           "linear_blocks_int8: scale must be float32 or float16 [panels, in / 32, 32]");
  PD_CHECK(b.u4 == bool(offset), "linear_blocks_int8: u4 blocks need an offset, i8 blocks take none");
  if (offset) {
    PD_CHECK(offset->is_cpu() && offset->is_contiguous() && offset->dtype() == scale.dtype() &&
                 offset->shape() == scale.shape(),
             "linear_blocks_int8: offset must be shaped and typed like scale");
    b.offset = offset->data();
  }
  b.q = q.data<uint8_t>();
  b.scale = scale.data();
  PD_CHECK(k_dim == b.k_dim, "linear_blocks_int8: x's last dimension must equal the weight's in-features (",
           b.k_dim, ")");
  const int64_t panels = q.shape()[0];
  PD_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel,
           "linear_blocks_int8: out-features ", n, " do not match ", panels, " panels");
  if (m == 0 || n == 0) return;
  // Every row quantized once (the caller's thread: helpers read it through the pointers).
  const int64_t groups = b.k_dim / kGroup;
  thread_local std::vector<int8_t> a_buf;
  thread_local std::vector<float> dx_buf;
  thread_local std::vector<int32_t> sa_buf;
  int8_t* a = fd_cpu::grown(a_buf, size_t(m * b.k_dim));
  float* dx = fd_cpu::grown(dx_buf, size_t(m * groups));
  int32_t* sa = fd_cpu::grown(sa_buf, size_t(m * groups));
  for (int64_t r = 0; r < m; ++r)
    quantize_row(xp + r * b.k_dim, b.k_dim, a + r * b.k_dim, dx + r * groups, sa + r * groups);

  const Int8Kernels kernels = int8_kernels();
  const bool vnni = kernels == Int8Kernels::kVnni;
  const bool avx2 = kernels == Int8Kernels::kAvx2;
  const int row_tile = avx2 ? kAvx2RowTile : kRowTile;
  const bool parallel = double(m) * double(n) * double(b.k_dim) > double(1 << 18);
  for_each_panel(m, panels, parallel, [&](int64_t r0, int rows, int64_t p) {
    const int cols = int(std::min<int64_t>(kPanel, n - p * kPanel));
    for (int r = 0; r < rows; r += row_tile) {
      const int tile = std::min(row_tile, rows - r);
      QuantRow rows_q[kRowTile];
      for (int t = 0; t < tile; ++t) {
        const int64_t row = r0 + r + t;
        rows_q[t] = QuantRow{a + row * b.k_dim, dx + row * groups, sa + row * groups};
      }
      float* yo = yp + (r0 + r) * n + p * kPanel;
      if (vnni) panel_rows_vnni_tail<kRowTile>(tile, rows_q, b, p, yo, n, cols);
      else if (avx2) panel_rows_avx2_tail(tile, rows_q, b, p, yo, n, cols);
      else panel_rows_portable(rows_q, tile, b, p, yo, n, cols);
    }
  });
}

namespace {

std::vector<paddle::Tensor> LinearBlocksInt8(const paddle::Tensor& x_in, const paddle::Tensor& q,
                                             const paddle::Tensor& scale,
                                             const paddle::optional<paddle::Tensor>& offset, int64_t n) {
  fd_cpu::linear::RowsProduct r = fd_cpu::linear::rows_product(x_in, n, "linear_blocks_int8");
  fd_cpu::linear::int8_blocks_product(q, scale, offset, n, r.x.data<float>(), r.m, r.k, r.y.data<float>());
  return {r.y};
}

}  // namespace

PD_BUILD_OP(linear_blocks_int8)
    .Inputs({"x", "q", "scale", paddle::Optional("offset")})
    .Outputs({"out"})
    .Attrs({"n: int64_t"})
    .SetKernelFn(PD_KERNEL(LinearBlocksInt8));
