// CPU dense layer on weights kept as a GGUF file's quantized blocks:
// y[M, N] = x[M, K] . W[N, K]^T, where every weight is rebuilt in registers
// with the file's own dequantization arithmetic, so it is the very float32
// number the gguf package's dequantize gives (and transformers computes with).
//
// Why: a decode step of a small model reads every weight once; the float32
// copy of SmolLM2-135M is 540 MB per step, its Q4_1/Q8_0 blocks ~110 MB, and
// on a CPU that read is the step's floor. The products are unchanged: each
// output is the same chain of fused multiply-adds over k = 0..K-1 from 0.0f as
// linear_packed.cc's on the dequantized weight, so the two give the same bits
// (tests/layers/test_linear_blocks.py), and a row's bits never depend on its
// batch mates.
//
// Two block formats cover the file types the loader keeps (gguf_blocks.py):
//   u4: w = (scale * q) + offset, q in [0, 15]  (Q4_1, Q4_K)
//   i8: w = scale * q,            q in int8     (Q8_0, Q5_0, Q6_K)
// one scale (and offset) per `group` consecutive k of one output column.
// Packed like linear_packed's panels of 32 output columns, k-major:
//   u4 q      [P, K / 8, 128] uint8: per 8 consecutive inputs k = 8c..8c+7, 32 little-endian 32-bit
//             words, word j holding column j's q at input 8c + s in bits 4s..4s+3
//   i8 q      [P, K, 32] int8
//   scale     [P, K / group, 32] float32, or float16 where every value is one (block_tables.h)
//   offset    the same, u4 only
// Columns past N have scale = offset = 0 (weight 0).
//
// Why the u4 words: a 16-lane register of them holds 16 columns' nibbles of 8 inputs; vpermps picks
// each lane's float from the 16 values 0.0 .. 15.0 by the word's low 4 bits, and a shift by 4 moves
// to the next input. That turns a nibble into its float in one shuffle, with no byte widening, mask
// or conversion (a decode step's weights are rebuilt ~19% faster than from bytes; the same bits).
//
// Up to kFusedRows rows decode each k's 32 weights in registers next to the FMAs (decode steps: the
// weight read is the cost); a row block of more rows dequantizes a panel into a buffer and runs
// linear_tiles.h's fp32 tiles on it; several row blocks (prefill) dequantize the whole weight once first.

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

constexpr int kFusedRows = 8;

constexpr int kU4Inputs = 8;         // inputs per u4 word
constexpr int kU4ChunkBytes = 128;   // one panel's 32 words
// Largest weight dequantized whole for a many-row product (a 2048-row prefill chunk of SmolLM2's
// gate/up: 7 MB); a larger one (a big LM head) goes a panel at a time.
constexpr int64_t kMaxDenseBytes = int64_t(64) << 20;

inline float* align64(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

struct Blocks {
  const uint8_t* q = nullptr;  // u4 words or i8 bytes
  const void* scale = nullptr;   // float32, or float16 bits (half)
  const void* offset = nullptr;  // u4 only, the same type
  bool u4 = true;
  bool half = false;
  int64_t k_dim = 0;
  int group = 32;

  int64_t q_stride() const { return k_dim * (u4 ? 16 : 32); }  // bytes per panel
  int64_t s_stride() const { return (k_dim / group) * kPanel; }  // scales per panel
};

// The weight of panel column j at k, portable: the same two roundings (multiply, then add) as
// numpy's dequantize and the AVX-512 decode.
inline float weight_at(const Blocks& b, int64_t p, int64_t k, int j) {
  const int64_t s = p * b.s_stride() + (k / b.group) * kPanel + j;
  if (b.u4) {
    uint32_t word;
    std::memcpy(&word, b.q + p * b.q_stride() + (k / kU4Inputs) * kU4ChunkBytes + j * 4, 4);
    const float q = float((word >> (4 * (k % kU4Inputs))) & 15);
    const float scaled = table_at(b.scale, b.half, s) * q;
    return scaled + table_at(b.offset, b.half, s);
  }
  const int8_t q = int8_t(b.q[p * b.q_stride() + k * 32 + j]);
  return table_at(b.scale, b.half, s) * float(q);
}

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

// A one-row product's u4 words are asked for this far ahead of their use (16 chunks of 8 inputs; past a
// panel's end, the next panel's start, which the next pair reads). The hardware prefetchers alone left
// the two streams of a pair ~5% slower (one request's decode, in-process A/B, medians of paired
// rounds: +2.6 to +9% at 512 to 4096 bytes, 2048 best); an i8 weight's (the LM head's) showed nothing.
constexpr int kPrefetchBytes = 2048;

template <int LINES>
__attribute__((always_inline)) inline void prefetch_lines(const uint8_t* p) {
  for (int i = 0; i < LINES; ++i) _mm_prefetch(reinterpret_cast<const char*>(p + 64 * i), _MM_HINT_T0);
}

// The block form as compile-time flags: fn(U4, HALF, ONE_ROUNDING) with std::bool_constant arguments.
template <typename Fn>
void with_form(const Blocks& b, bool one_rounding, Fn fn) {
  using T = std::true_type;
  using F = std::false_type;
  if (!b.u4) return b.half ? fn(F{}, T{}, F{}) : fn(F{}, F{}, F{});
  if (one_rounding) return b.half ? fn(T{}, T{}, T{}) : fn(T{}, F{}, T{});
  b.half ? fn(T{}, T{}, F{}) : fn(T{}, F{}, F{});
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

void dequant_panel_scalar(const Blocks& b, int64_t p, float* out) {
  for (int64_t k = 0; k < b.k_dim; ++k)
    for (int j = 0; j < kPanel; ++j) out[k * kPanel + j] = weight_at(b, p, k, j);
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

Blocks blocks_of(const paddle::Tensor& q, const paddle::Tensor& scale,
                 const paddle::optional<paddle::Tensor>& offset, int64_t group, const char* op) {
  PD_CHECK(q.is_cpu() && scale.is_cpu(), op, ": CPU tensors only");
  PD_CHECK(q.is_contiguous() && scale.is_contiguous() && q.shape().size() == 3 && scale.shape().size() == 3,
           op, ": blocks must be packed (q [panels, in / 8, 128] u4 or [panels, in, 32] i8, scale [panels, in / group, 32])");
  Blocks b;
  b.u4 = q.dtype() == paddle::DataType::UINT8;
  PD_CHECK(b.u4 || q.dtype() == paddle::DataType::INT8, op, ": q must be uint8 (u4) or int8 (i8)");
  PD_CHECK(q.shape()[2] == (b.u4 ? kU4ChunkBytes : 32), op, ": q's last dimension must be 128 (u4) or 32 (i8)");
  b.half = scale.dtype() == paddle::DataType::FLOAT16;
  PD_CHECK(b.half || scale.dtype() == paddle::DataType::FLOAT32, op, ": scale must be float32 or float16");
  b.k_dim = q.shape()[1] * (b.u4 ? kU4Inputs : 1);
  b.group = int(group);
  PD_CHECK(group > 0 && b.k_dim % group == 0, op, ": in-features ", b.k_dim, " are not a multiple of group ", group);
  PD_CHECK(!b.u4 || group % kU4Inputs == 0, op, ": a u4 group must be a multiple of 8 inputs, got ", group);
  PD_CHECK(scale.shape()[0] == q.shape()[0] && scale.shape()[1] == b.k_dim / group && scale.shape()[2] == kPanel,
           op, ": scale must be [panels, in / group, 32]");
  PD_CHECK(b.u4 == bool(offset), op, ": u4 blocks need an offset, i8 blocks take none");
  if (offset) {
    PD_CHECK(offset->is_cpu() && offset->is_contiguous() && offset->dtype() == scale.dtype() &&
                 offset->shape() == scale.shape(),
             op, ": offset must be shaped and typed like scale");
    b.offset = offset->data();
  }
  b.q = reinterpret_cast<const uint8_t*>(b.u4 ? static_cast<const void*>(q.data<uint8_t>())
                                               : static_cast<const void*>(q.data<int8_t>()));
  b.scale = scale.data();
  return b;
}

// y [m, n] = x [m, K] . W^T for one block form (with_form's flags).
template <bool U4, bool HALF, bool ONE_ROUNDING>
void product_of_form(const Blocks& b, const float* xp, int64_t m, int64_t n, int64_t panels, float* yp) {
  const Isa isa = tiles_isa();
  const bool avx512 = isa == Isa::kAvx512;
  const auto dequant_panel = [&](int64_t p, float* out) {
    avx512 ? dequant_panel_avx512<U4, HALF>(b, p, out) : dequant_panel_scalar(b, p, out);
  };
  const int64_t dense_floats = panels * b.k_dim * kPanel;
  if (m > kRowBlock && dense_floats * int64_t(sizeof(float)) <= kMaxDenseBytes) {
    // Several row blocks (prefill): dequantize the whole weight once, then the packed float32
    // kernel's loop; per row block it would be dequantized again (15-19% slower at 2048 rows).
    thread_local std::vector<float> scratch;  // the caller's; helpers get its address, not their own
    float* dense = align64(fd_cpu::grown(scratch, size_t(dense_floats) + 16));  // whole-line panel loads, as on the packed tensor
    fd_cpu::WorkPool::instance().run(panels, fd_cpu::usable_cpus(), [&](int64_t p, int) {
      dequant_panel(p, dense + p * b.k_dim * kPanel);
    });
    packed_product(xp, m, b.k_dim, dense, panels, yp, n, true);
    return;
  }
  // A decode step streams the weight: worth both cores once it is past ~L2 scale.
  const bool parallel = double(m) * double(n) * double(b.k_dim) > double(1 << 18);
  const auto cols_of = [&](int64_t p) { return int(std::min<int64_t>(kPanel, n - p * kPanel)); };
  if (avx512 && m == 1) {
    // One row: panels in pairs (fused_row_two_panels), kPanelGroup panels to a work item.
    const int64_t groups = (panels + kPanelGroup - 1) / kPanelGroup;
    fd_cpu::WorkPool::instance().run(groups, parallel ? fd_cpu::usable_cpus() : 1, [&](int64_t g, int) {
      const int64_t end = std::min<int64_t>(panels, (g + 1) * kPanelGroup);
      int64_t p = g * kPanelGroup;
      for (; p + 2 <= end; p += 2)
        fused_row_two_panels<U4, HALF, ONE_ROUNDING>(xp, b, p, yp + p * kPanel, cols_of(p), cols_of(p + 1));
      if (p < end) fused_tile<U4, HALF, ONE_ROUNDING, 1>(xp, b, p, yp + p * kPanel, n, cols_of(p));
    });
    return;
  }
  for_each_panel(m, panels, parallel, [&](int64_t r0, int rows, int64_t p) {
    float* yo = yp + r0 * n + p * kPanel;
    if (avx512 && rows <= kFusedRows)
      return fused_rows<U4, HALF, ONE_ROUNDING, kFusedRows>(rows, xp + r0 * b.k_dim, b, p, yo, n, cols_of(p));
    thread_local std::vector<float> panel;
    float* buffer = align64(fd_cpu::grown(panel, size_t(b.k_dim) * kPanel + 16));
    dequant_panel(p, buffer);
    rows_times_panel(isa, xp + r0 * b.k_dim, rows, b.k_dim, buffer, yo, n, cols_of(p));
  });
}

}  // namespace

// y [m, n] = x [m, K] . W^T on packed blocks (checked here): the op below, and the fused decoder
// blocks (decoder_block_ops.cc), which call it on their own buffers.
void fd_cpu::linear::blocks_product(const paddle::Tensor& q, const paddle::Tensor& scale,
                                    const paddle::optional<paddle::Tensor>& offset, int64_t n, int64_t group,
                                    bool one_rounding, const float* xp, int64_t m, int64_t k_dim, float* yp) {
  const Blocks b = blocks_of(q, scale, offset, group, "linear_blocks");
  PD_CHECK(k_dim == b.k_dim, "linear_blocks: x's last dimension must equal the weight's in-features (", b.k_dim, ")");
  const int64_t panels = q.shape()[0];
  PD_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel,
           "linear_blocks: out-features ", n, " do not match ", panels, " panels");
  if (m == 0 || n == 0) return;
  if (b.k_dim == 0) {
    std::memset(yp, 0, sizeof(float) * size_t(m * n));
    return;
  }
  with_form(b, one_rounding, [&](auto u4, auto half, auto one) {
    product_of_form<decltype(u4)::value, decltype(half)::value, decltype(one)::value>(b, xp, m, n, panels, yp);
  });
}

namespace {

// one_rounding: the caller checked that every scale * q is exact in float32 (gguf_blocks.pack), so a
// u4 weight may be rebuilt with one fused multiply-add (u4_weights); wrong, it would change bits.
std::vector<paddle::Tensor> LinearBlocks(const paddle::Tensor& x_in, const paddle::Tensor& q,
                                         const paddle::Tensor& scale,
                                         const paddle::optional<paddle::Tensor>& offset,
                                         int64_t n, int64_t group, bool one_rounding) {
  fd_cpu::linear::RowsProduct r = fd_cpu::linear::rows_product(x_in, n, "linear_blocks");
  fd_cpu::linear::blocks_product(q, scale, offset, n, group, one_rounding, r.x.data<float>(), r.m, r.k,
                                 r.y.data<float>());
  return {r.y};
}

template <typename Id>
void gather_block_rows(const Blocks& b, const Id* id, int64_t t, int64_t n, float* out) {
  for (int64_t i = 0; i < t; ++i) {
    const int64_t v = int64_t(id[i]);
    PD_CHECK(v >= 0 && v < n, "block_rows: id ", v, " out of range [0, ", n, ")");
    for (int64_t k = 0; k < b.k_dim; ++k) out[i * b.k_dim + k] = weight_at(b, v / kPanel, k, int(v % kPanel));
  }
}

// Rows `ids` of the dequantized [N, K] weight: a tied embedding's lookup, and
// the load-time check that the blocks give the checkpoint's float32 weights.
std::vector<paddle::Tensor> BlockRows(const paddle::Tensor& q, const paddle::Tensor& scale,
                                      const paddle::optional<paddle::Tensor>& offset,
                                      const paddle::Tensor& ids_in, int64_t n, int64_t group) {
  const paddle::Tensor ids = ids_in.is_contiguous() ? ids_in : ids_in.contiguous();
  PD_CHECK(ids.dtype() == paddle::DataType::INT64 || ids.dtype() == paddle::DataType::INT32,
           "block_rows: ids must be int32 or int64");
  const Blocks b = blocks_of(q, scale, offset, group, "block_rows");
  const int64_t t = ids.numel();
  paddle::Tensor out = paddle::empty({t, b.k_dim}, paddle::DataType::FLOAT32, q.place());
  if (ids.dtype() == paddle::DataType::INT64)
    gather_block_rows(b, ids.data<int64_t>(), t, n, out.data<float>());
  else
    gather_block_rows(b, ids.data<int32_t>(), t, n, out.data<float>());
  return {out};
}

}  // namespace

PD_BUILD_OP(linear_blocks)
    .Inputs({"x", "q", "scale", paddle::Optional("offset")})
    .Outputs({"out"})
    .Attrs({"n: int64_t", "group: int64_t", "one_rounding: bool"})
    .SetKernelFn(PD_KERNEL(LinearBlocks));

PD_BUILD_OP(block_rows)
    .Inputs({"q", "scale", paddle::Optional("offset"), "ids"})
    .Outputs({"out"})
    .Attrs({"n: int64_t", "group: int64_t"})
    .SetKernelFn(PD_KERNEL(BlockRows));
