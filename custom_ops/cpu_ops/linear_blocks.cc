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
//   u4 q      [P, K, 16] uint8: byte j holds column j (low nibble) and j + 16 (high)
//   i8 q      [P, K, 32] int8
//   scale     [P, K / group, 32] float32 (offset: the same, u4 only)
// Columns past N have scale = offset = 0 (weight 0).
//
// Up to kFusedRows rows decode each k's 32 weights in registers next to the
// FMAs (decode steps: the weight read is the cost); a row block of more rows
// dequantizes a panel into a buffer and runs linear_tiles.h's fp32 tiles on
// it; several row blocks (prefill) dequantize the whole weight once first.

#include <cmath>
#include <cstring>
#include <vector>

#include "paddle/extension.h"
#include "linear_blocks.h"
#include "linear_tiles.h"
#include "work_pool.h"

namespace {

using namespace fd_cpu::linear;

constexpr int kFusedRows = 8;
// Largest weight dequantized whole for a many-row product (a 2048-row prefill chunk of SmolLM2's
// gate/up: 7 MB); a larger one (a big LM head) goes a panel at a time.
constexpr int64_t kMaxDenseBytes = int64_t(64) << 20;

inline float* align64(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
}

struct Blocks {
  const uint8_t* q = nullptr;  // u4 nibbles or i8 bytes
  const float* scale = nullptr;
  const float* offset = nullptr;  // u4 only
  bool u4 = true;
  int64_t k_dim = 0;
  int group = 32;

  int64_t q_stride() const { return k_dim * (u4 ? 16 : 32); }  // bytes per panel
  int64_t s_stride() const { return (k_dim / group) * kPanel; }  // scales per panel
};

// The 32 weights of panel column j at k, portable: the same two roundings
// (multiply, then add) as numpy's dequantize and the AVX-512 decode.
inline float weight_at(const Blocks& b, int64_t p, int64_t k, int j) {
  const int64_t s = p * b.s_stride() + (k / b.group) * kPanel + j;
  if (b.u4) {
    const uint8_t byte = b.q[p * b.q_stride() + k * 16 + (j & 15)];
    const float q = float(j < 16 ? byte & 15 : byte >> 4);
    const float scaled = b.scale[s] * q;
    return scaled + b.offset[s];
  }
  const int8_t q = int8_t(b.q[p * b.q_stride() + k * 32 + j]);
  return b.scale[s] * float(q);
}

// ONE_ROUNDING: the caller knows every scale * q of these blocks is exact in float32 (Q4_1's f16
// scale times a 4-bit q has at most 15 significant bits; Q4_K's f16 d times a 6-bit sc times q at
// most 21), so the multiply's rounding is a no-op and one fused multiply-add gives the very
// (scale * q) + offset of the two roundings, with one instruction less per 16 weights.
template <bool U4, bool ONE_ROUNDING = false>
__attribute__((target("avx512f"))) inline void decode_k(const uint8_t* qk, __m512 d0, __m512 d1, __m512 o0,
                                                        __m512 o1, __m512& w0, __m512& w1) {
  if constexpr (U4) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qk)));
    const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(15));
    const __m512i hi = _mm512_srli_epi32(v, 4);
    if constexpr (ONE_ROUNDING) {
      w0 = _mm512_fmadd_ps(d0, _mm512_cvtepi32_ps(lo), o0);
      w1 = _mm512_fmadd_ps(d1, _mm512_cvtepi32_ps(hi), o1);
    } else {
      w0 = _mm512_add_ps(_mm512_mul_ps(d0, _mm512_cvtepi32_ps(lo)), o0);
      w1 = _mm512_add_ps(_mm512_mul_ps(d1, _mm512_cvtepi32_ps(hi)), o1);
    }
  } else {
    const __m512i v0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qk)));
    const __m512i v1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qk + 16)));
    w0 = _mm512_mul_ps(d0, _mm512_cvtepi32_ps(v0));
    w1 = _mm512_mul_ps(d1, _mm512_cvtepi32_ps(v1));
  }
}

// fn(k, w0, w1) for k = 0..K-1 with panel p's 32 weights at k (columns 0-15 in w0, 16-31 in w1).
template <bool U4, typename Fn, bool ONE_ROUNDING = false>
__attribute__((target("avx512f"), always_inline)) inline void for_each_k(const Blocks& b, int64_t p, Fn fn) {
  const uint8_t* q = b.q + p * b.q_stride();
  const float* sc = b.scale + p * b.s_stride();
  const float* of = U4 ? b.offset + p * b.s_stride() : nullptr;
  constexpr int64_t qk_bytes = U4 ? 16 : 32;
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t g = 0; g < b.k_dim / b.group; ++g) {
    const __m512 d0 = _mm512_loadu_ps(sc + g * kPanel), d1 = _mm512_loadu_ps(sc + g * kPanel + 16);
    const __m512 o0 = of ? _mm512_loadu_ps(of + g * kPanel) : zero;
    const __m512 o1 = of ? _mm512_loadu_ps(of + g * kPanel + 16) : zero;
    for (int64_t k = g * b.group; k < (g + 1) * b.group; ++k) {
      __m512 w0, w1;
      decode_k<U4, ONE_ROUNDING>(q + k * qk_bytes, d0, d1, o0, o1, w0, w1);
      fn(k, w0, w1);
    }
  }
}

// Panel p as float32 [K, 32] in `out`.
template <bool U4>
__attribute__((target("avx512f"))) void dequant_panel_avx512(const Blocks& b, int64_t p, float* out) {
  for_each_k<U4>(b, p, [&](int64_t k, __m512 w0, __m512 w1) __attribute__((target("avx512f"))) {
    _mm512_storeu_ps(out + k * kPanel, w0);
    _mm512_storeu_ps(out + k * kPanel + 16, w1);
  });
}

void dequant_panel_scalar(const Blocks& b, int64_t p, float* out) {
  for (int64_t k = 0; k < b.k_dim; ++k)
    for (int j = 0; j < kPanel; ++j) out[k * kPanel + j] = weight_at(b, p, k, j);
}

// R rows x the 32 outputs of panel p, the weights decoded next to the FMAs.
template <bool U4, int R, bool ONE_ROUNDING>
__attribute__((target("avx512f"))) void fused_tile(const float* x, const Blocks& b, int64_t p,
                                                  float* y, int64_t ldy, int cols) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t k_dim = b.k_dim;
  auto fma_rows = [&](int64_t k, __m512 w0, __m512 w1) __attribute__((target("avx512f"))) {
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * k_dim + k]);
      acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
    }
  };
  for_each_k<U4, decltype(fma_rows), ONE_ROUNDING>(b, p, fma_rows);
  store_tile_avx512<R>(acc, y, ldy, cols);
}

// One row (a decode step's GEMV) x panels p and p + 1 together: four independent accumulator chains
// instead of two hide the FMA latency a single panel's chain waits on. Each output is still the one
// chain over k = 0..K-1 from 0.0f, so the bits are the one-panel tile's.
template <bool U4, bool ONE_ROUNDING>
__attribute__((target("avx512f"))) void fused_row_two_panels(const float* x, const Blocks& b, int64_t p,
                                                            float* y, int cols0, int cols1) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  constexpr int64_t qk_bytes = U4 ? 16 : 32;
  const uint8_t* q0 = b.q + p * b.q_stride();
  const uint8_t* q1 = q0 + b.q_stride();
  const float* sc0 = b.scale + p * b.s_stride();
  const float* sc1 = sc0 + b.s_stride();
  const float* of0 = U4 ? b.offset + p * b.s_stride() : nullptr;
  const float* of1 = U4 ? of0 + b.s_stride() : nullptr;
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t g = 0; g < b.k_dim / b.group; ++g) {
    const int64_t s = g * kPanel;
    const __m512 d00 = _mm512_loadu_ps(sc0 + s), d01 = _mm512_loadu_ps(sc0 + s + 16);
    const __m512 d10 = _mm512_loadu_ps(sc1 + s), d11 = _mm512_loadu_ps(sc1 + s + 16);
    const __m512 o00 = U4 ? _mm512_loadu_ps(of0 + s) : zero, o01 = U4 ? _mm512_loadu_ps(of0 + s + 16) : zero;
    const __m512 o10 = U4 ? _mm512_loadu_ps(of1 + s) : zero, o11 = U4 ? _mm512_loadu_ps(of1 + s + 16) : zero;
    for (int64_t k = g * b.group; k < (g + 1) * b.group; ++k) {
      __m512 w00, w01, w10, w11;
      decode_k<U4, ONE_ROUNDING>(q0 + k * qk_bytes, d00, d01, o00, o01, w00, w01);
      decode_k<U4, ONE_ROUNDING>(q1 + k * qk_bytes, d10, d11, o10, o11, w10, w11);
      const __m512 a = _mm512_set1_ps(x[k]);
      acc[0] = _mm512_fmadd_ps(a, w00, acc[0]);
      acc[1] = _mm512_fmadd_ps(a, w01, acc[1]);
      acc[2] = _mm512_fmadd_ps(a, w10, acc[2]);
      acc[3] = _mm512_fmadd_ps(a, w11, acc[3]);
    }
  }
  const __m512 first[1][2] = {{acc[0], acc[1]}}, second[1][2] = {{acc[2], acc[3]}};
  store_tile_avx512<1>(first, y, 0, cols0);
  store_tile_avx512<1>(second, y + kPanel, 0, cols1);
}

template <int R, bool ONE_ROUNDING>
void fused_rows(int rows, const float* x, const Blocks& b, int64_t p, float* y, int64_t ldy, int cols) {
  if constexpr (R > 0) {
    if (rows == R)
      return b.u4 ? fused_tile<true, R, ONE_ROUNDING>(x, b, p, y, ldy, cols)
                  : fused_tile<false, R, false>(x, b, p, y, ldy, cols);
    fused_rows<R - 1, ONE_ROUNDING>(rows, x, b, p, y, ldy, cols);
  }
}

Blocks blocks_of(const paddle::Tensor& q, const paddle::Tensor& scale,
                 const paddle::optional<paddle::Tensor>& offset, int64_t group, const char* op) {
  PD_CHECK(q.is_cpu() && scale.is_cpu(), op, ": CPU tensors only");
  PD_CHECK(q.is_contiguous() && scale.is_contiguous() && q.shape().size() == 3 && scale.shape().size() == 3,
           op, ": blocks must be packed (q [panels, in, 16|32], scale [panels, in / group, 32])");
  Blocks b;
  b.u4 = q.dtype() == paddle::DataType::UINT8;
  PD_CHECK(b.u4 || q.dtype() == paddle::DataType::INT8, op, ": q must be uint8 (u4) or int8 (i8)");
  PD_CHECK(q.shape()[2] == (b.u4 ? 16 : 32), op, ": q's last dimension must be 16 (u4) or 32 (i8)");
  PD_CHECK(scale.dtype() == paddle::DataType::FLOAT32, op, ": scale must be float32");
  b.k_dim = q.shape()[1];
  b.group = int(group);
  PD_CHECK(group > 0 && b.k_dim % group == 0, op, ": in-features ", b.k_dim, " are not a multiple of group ", group);
  PD_CHECK(scale.shape()[0] == q.shape()[0] && scale.shape()[1] == b.k_dim / group && scale.shape()[2] == kPanel,
           op, ": scale must be [panels, in / group, 32]");
  PD_CHECK(b.u4 == bool(offset), op, ": u4 blocks need an offset, i8 blocks take none");
  if (offset) {
    PD_CHECK(offset->is_cpu() && offset->is_contiguous() && offset->dtype() == paddle::DataType::FLOAT32 &&
                 offset->shape() == scale.shape(),
             op, ": offset must be float32 shaped like scale");
    b.offset = offset->data<float>();
  }
  b.q = reinterpret_cast<const uint8_t*>(b.u4 ? static_cast<const void*>(q.data<uint8_t>())
                                               : static_cast<const void*>(q.data<int8_t>()));
  b.scale = scale.data<float>();
  return b;
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
  const Isa isa = tiles_isa();
  const bool avx512 = isa == Isa::kAvx512;
  const auto dequant_panel = [&](int64_t p, float* out) {
    if (!avx512) return dequant_panel_scalar(b, p, out);
    b.u4 ? dequant_panel_avx512<true>(b, p, out) : dequant_panel_avx512<false>(b, p, out);
  };
  const int64_t dense_floats = panels * b.k_dim * kPanel;
  if (m > kRowBlock && dense_floats * int64_t(sizeof(float)) <= kMaxDenseBytes) {
    // Several row blocks (prefill): dequantize the whole weight once, then the packed float32
    // kernel's loop; per row block it would be dequantized again (15-19% slower at 2048 rows).
    thread_local std::vector<float> scratch;  // the caller's; helpers get its address, not their own
    scratch.resize(size_t(dense_floats) + 16);
    float* dense = align64(scratch.data());  // whole-line panel loads, as on the packed tensor
    fd_cpu::WorkPool::instance().run(panels, fd_cpu::usable_cpus(), [&](int64_t p, int) {
      dequant_panel(p, dense + p * b.k_dim * kPanel);
    });
    packed_product(xp, m, b.k_dim, dense, panels, yp, n, true);
    return;
  }
  // A decode step streams the weight: worth both cores once it is past ~L2 scale.
  const bool parallel = double(m) * double(n) * double(b.k_dim) > double(1 << 18);
  const bool fma_rebuild = one_rounding && b.u4;
  if (avx512 && m == 1) {
    // One row: panels in pairs (fused_row_two_panels), kPanelGroup panels to a work item.
    const int64_t groups = (panels + kPanelGroup - 1) / kPanelGroup;
    const auto cols_of = [&](int64_t p) { return int(std::min<int64_t>(kPanel, n - p * kPanel)); };
    fd_cpu::WorkPool::instance().run(groups, parallel ? fd_cpu::usable_cpus() : 1, [&](int64_t g, int) {
      const int64_t end = std::min<int64_t>(panels, (g + 1) * kPanelGroup);
      int64_t p = g * kPanelGroup;
      for (; p + 2 <= end; p += 2) {
        float* yo = yp + p * kPanel;
        if (!b.u4) fused_row_two_panels<false, false>(xp, b, p, yo, cols_of(p), cols_of(p + 1));
        else if (fma_rebuild) fused_row_two_panels<true, true>(xp, b, p, yo, cols_of(p), cols_of(p + 1));
        else fused_row_two_panels<true, false>(xp, b, p, yo, cols_of(p), cols_of(p + 1));
      }
      if (p < end) {
        fma_rebuild ? fused_rows<1, true>(1, xp, b, p, yp + p * kPanel, n, cols_of(p))
                    : fused_rows<1, false>(1, xp, b, p, yp + p * kPanel, n, cols_of(p));
      }
    });
    return;
  }
  for_each_panel(m, panels, parallel, [&](int64_t r0, int rows, int64_t p) {
    const int cols = int(std::min<int64_t>(kPanel, n - p * kPanel));
    float* yo = yp + r0 * n + p * kPanel;
    if (avx512 && rows <= kFusedRows) {
      return fma_rebuild ? fused_rows<kFusedRows, true>(rows, xp + r0 * b.k_dim, b, p, yo, n, cols)
                         : fused_rows<kFusedRows, false>(rows, xp + r0 * b.k_dim, b, p, yo, n, cols);
    }
    thread_local std::vector<float> panel;
    panel.resize(size_t(b.k_dim) * kPanel + 16);
    dequant_panel(p, align64(panel.data()));
    rows_times_panel(isa, xp + r0 * b.k_dim, rows, b.k_dim, align64(panel.data()), yo, n, cols);
  });
  }

namespace {

// one_rounding: the caller checked that every scale * q is exact in float32 (gguf_blocks.pack), so a
// u4 weight may be rebuilt with one fused multiply-add (decode_k); wrong, it would change bits.
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
