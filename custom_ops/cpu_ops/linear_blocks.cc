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
// The kernels of each instruction set are in linear_blocks_avx512.h and linear_blocks_avx2.h; the
// portable ones here. Every one rebuilds a weight with the same operations, so all give the same bits.
//
// Why the u4 words: a 16-lane register of them holds 16 columns' nibbles of 8 inputs; vpermps picks
// each lane's float from the 16 values 0.0 .. 15.0 by the word's low 4 bits, and a shift by 4 moves
// to the next input. That turns a nibble into its float in one shuffle, with no byte widening, mask
// or conversion (a decode step's weights are rebuilt ~19% faster than from bytes; the same bits).
//
// Up to kFusedRows rows (AVX-512; kFusedRowsAvx2 with AVX2) decode each k's 32 weights in registers next
// to the FMAs (decode steps: the weight read is the cost); a row block of more rows dequantizes a panel into a buffer and runs
// linear_tiles.h's fp32 tiles on it; several row blocks (prefill) dequantize the whole weight once first.

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "paddle/extension.h"
#include "block_tables.h"
#include "linear_blocks.h"
#include "linear_blocks_avx2.h"
#include "linear_blocks_avx512.h"
#include "linear_tiles.h"
#include "scratch.h"
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

// Panel p as float32 [K, 32] in `out`, in plain loops over the 32 columns that the compiler turns into
// whatever vectors the machine has (the same two roundings as weight_at, so the same floats).
template <bool U4, bool HALF>
void dequant_panel_portable(const Blocks& b, int64_t p, float* out) {
  const uint8_t* q = b.q + p * b.q_stride();
  const int64_t s0 = p * b.s_stride();
  for (int64_t g = 0; g < b.k_dim / b.group; ++g) {
    float d[kPanel], o[kPanel];
    for (int j = 0; j < kPanel; ++j) {
      d[j] = table_at(b.scale, HALF, s0 + g * kPanel + j);
      o[j] = U4 ? table_at(b.offset, HALF, s0 + g * kPanel + j) : 0.f;
    }
    for (int64_t k = g * b.group; k < (g + 1) * b.group; ++k) {
      float* row = out + k * kPanel;
      if constexpr (U4) {
        uint32_t words[kPanel];
        std::memcpy(words, q + (k / kU4Inputs) * kU4ChunkBytes, sizeof(words));
        const int shift = 4 * int(k % kU4Inputs);
        for (int j = 0; j < kPanel; ++j) {
          const float scaled = d[j] * float((words[j] >> shift) & 15u);
          row[j] = scaled + o[j];
        }
      } else {
        const int8_t* qk = reinterpret_cast<const int8_t*>(q + k * kPanel);
        for (int j = 0; j < kPanel; ++j) row[j] = d[j] * float(qk[j]);
      }
    }
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

// y [m, n] = x [m, K] . W^T for one block form (with_form's flags), on this process's instruction set.
template <bool U4, bool HALF, bool ONE_ROUNDING>
void product_of_form(const Blocks& b, const float* xp, int64_t m, int64_t n, int64_t panels, float* yp) {
  const Isa isa = fd_cpu::kernels_isa();
  const auto dequant_panel = [&](int64_t p, float* out) {
    if (isa == Isa::kAvx512) return dequant_panel_avx512<U4, HALF>(b, p, out);
    if (isa == Isa::kAvx2) return dequant_panel_avx2<U4, HALF>(b, p, out);
    dequant_panel_portable<U4, HALF>(b, p, out);
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
  if (isa == Isa::kAvx512 && m == 1) {
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
  if (isa == Isa::kAvx2 && m == 1) {
    // One row: every worker gets the same number of contiguous runs of about kAvx2RowPanels panels
    // (fewer, longer streams than the tiles' groups of kPanelGroup, and no worker left with the tail).
    const int workers = parallel ? fd_cpu::usable_cpus() : 1;
    const int64_t items = std::min<int64_t>(panels, workers * ((panels + workers * kAvx2RowPanels - 1) /
                                                               (workers * kAvx2RowPanels)));
    fd_cpu::WorkPool::instance().run(items, workers, [&](int64_t item, int) {
      for (int64_t p = item * panels / items; p < (item + 1) * panels / items; ++p)
        fused_tile_avx2<U4, HALF, ONE_ROUNDING, 1, 0, 4>(xp, b, p, yp + p * kPanel, n, cols_of(p));
    });
    return;
  }
  for_each_panel(m, panels, parallel, [&](int64_t r0, int rows, int64_t p) {
    float* yo = yp + r0 * n + p * kPanel;
    const float* xo = xp + r0 * b.k_dim;
    if (isa == Isa::kAvx512 && rows <= kFusedRows)
      return fused_rows<U4, HALF, ONE_ROUNDING, kFusedRows>(rows, xo, b, p, yo, n, cols_of(p));
    if (isa == Isa::kAvx2 && rows <= kFusedRowsAvx2)
      return fused_rows_avx2<U4, HALF, ONE_ROUNDING, kFusedRowsAvx2>(rows, xo, b, p, yo, n, cols_of(p));
    thread_local std::vector<float> panel;
    float* buffer = align64(fd_cpu::grown(panel, size_t(b.k_dim) * kPanel + 16));
    dequant_panel(p, buffer);
    rows_times_panel(isa, xo, rows, b.k_dim, buffer, yo, n, cols_of(p));
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
