// A decoder layer's dense work in two op calls instead of seven, on GGUF-block weights:
//   norm_qkv_blocks:  hidden (+ delta) -> RMSNorm -> the fused q/k/v product
//   mlp_blocks:       attention output -> o_proj -> + hidden -> RMSNorm -> gate/up -> act -> down
// Why: a one-request decode step of a 135M model is ~10 ms, and each Paddle custom-op call costs
// ~6 us of dispatch and output allocation (more on a busy machine), ~240 of them a step; the layer
// between two attention calls needs no Python. The pieces are the very functions the single ops
// run (blocks_product / int8_blocks_product, norm_row, gated_row) on this op's scratch buffers,
// in the same order, so the outputs have the bits of the op-by-op path (tests/layers/
// test_decoder_block_ops.py), and a row's bits never depend on its batch mates.
//
// A weight is (q, scale, offset | None) plus attributes n, group and kind: 0 the exact product
// with two roundings per rebuilt weight, 1 the exact product with one (PackedBlocks.one_rounding),
// 2 int8 activations (linear_blocks_int8.cc, FD_CPU_INT8_ACTIVATIONS).

#include <cstring>
#include <vector>

#include "decoder_block_ops.h"
#include "scratch.h"
#include "gated_activation_row.h"
#include "linear_blocks.h"
#include "paddle/extension.h"
#include "rms_norm_row.h"
#include "work_pool.h"

namespace {

constexpr int64_t kRowsPerItem = 64;
constexpr int64_t kParallelElements = 1 << 18;  // rms_norm.cc's: below this one thread is faster

struct Weight {
  const paddle::Tensor& q;
  const paddle::Tensor& scale;
  const paddle::optional<paddle::Tensor>& offset;
  int64_t n, group, kind;
};

void product(const Weight& w, const float* x, int64_t m, int64_t k, float* y) {
  PD_CHECK(w.kind >= 0 && w.kind <= 2, "decoder block: weight kind must be 0, 1 or 2, got ", w.kind);
  if (w.kind == 2) return fd_cpu::linear::int8_blocks_product(w.q, w.scale, w.offset, w.n, x, m, k, y);
  fd_cpu::linear::blocks_product(w.q, w.scale, w.offset, w.n, w.group, w.kind == 1, x, m, k, y);
}

paddle::Tensor contiguous_float32(const paddle::Tensor& t, const char* name) {
  PD_CHECK(t.dtype() == paddle::DataType::FLOAT32 && t.is_cpu(), "decoder block: ", name, " must be CPU float32");
  return t.is_contiguous() ? t : t.contiguous();
}

// sum = x (+ delta), normed = rms_norm(sum): add_rms_norm_rows' (or rms_norm_rows') arithmetic.
void add_norm(const float* x, const float* delta, const float* w, int64_t rows, int64_t d, float eps, float* sum,
              float* normed) {
  fd_cpu::for_each_row(rows, kRowsPerItem, rows * d > kParallelElements, [&](int64_t r) {
    if (delta != nullptr) {
      for (int64_t j = 0; j < d; ++j) sum[r * d + j] = x[r * d + j] + delta[r * d + j];
    } else {
      std::memcpy(sum + r * d, x + r * d, sizeof(float) * size_t(d));
    }
    fd_cpu::norm_row(sum + r * d, w, d, eps, normed + r * d);
  });
}

}  // namespace

void fd_cpu::decoder::block_weight_product(const paddle::Tensor& q, const paddle::Tensor& scale,
                                           const paddle::optional<paddle::Tensor>& offset, int64_t n,
                                           int64_t group, int64_t kind, const float* x, int64_t m, int64_t k,
                                           float* y) {
  product(Weight{q, scale, offset, n, group, kind}, x, m, k, y);
}

std::vector<paddle::Tensor> fd_cpu::decoder::NormQkvBlocks(const paddle::Tensor& hidden_in,
                                          const paddle::optional<paddle::Tensor>& delta_in,
                                          const paddle::Tensor& norm_in, const paddle::Tensor& q,
                                          const paddle::Tensor& scale, const paddle::optional<paddle::Tensor>& offset,
                                          int64_t n, int64_t group, int64_t kind, float eps) {
  const paddle::Tensor hidden = contiguous_float32(hidden_in, "hidden");
  const paddle::Tensor norm = contiguous_float32(norm_in, "norm weight");
  PD_CHECK(hidden.shape().size() == 2, "norm_qkv_blocks: hidden must be [rows, hidden]");
  const int64_t rows = hidden.shape()[0], d = hidden.shape()[1];
  PD_CHECK(norm.numel() == d, "norm_qkv_blocks: the norm weight has ", norm.numel(), " elements, hidden ", d);
  paddle::Tensor delta;
  if (delta_in) {
    delta = contiguous_float32(*delta_in, "delta");
    PD_CHECK(delta.shape() == hidden.shape(), "norm_qkv_blocks: delta must be shaped like hidden");
  }
  paddle::Tensor sum = paddle::empty({rows, d}, paddle::DataType::FLOAT32, hidden.place());
  paddle::Tensor qkv = paddle::empty({rows, n}, paddle::DataType::FLOAT32, hidden.place());
  thread_local std::vector<float> normed_buf;
  float* normed = fd_cpu::grown(normed_buf, size_t(rows * d));
  add_norm(hidden.data<float>(), delta_in ? delta.data<float>() : nullptr, norm.data<float>(), rows, d, eps,
           sum.data<float>(), normed);
  product(Weight{q, scale, offset, n, group, kind}, normed, rows, d, qkv.data<float>());
  return {sum, qkv};
}

std::vector<paddle::Tensor> fd_cpu::decoder::MlpBlocks(const paddle::Tensor& attn_in, const paddle::Tensor& hidden_in,
                                      const paddle::Tensor& o_q, const paddle::Tensor& o_scale,
                                      const paddle::optional<paddle::Tensor>& o_offset, const paddle::Tensor& norm_in,
                                      const paddle::Tensor& gu_q, const paddle::Tensor& gu_scale,
                                      const paddle::optional<paddle::Tensor>& gu_offset, const paddle::Tensor& down_q,
                                      const paddle::Tensor& down_scale,
                                      const paddle::optional<paddle::Tensor>& down_offset, int64_t o_group,
                                      int64_t o_kind, int64_t gu_n, int64_t gu_group, int64_t gu_kind,
                                      int64_t down_group, int64_t down_kind, float eps, int act) {
  const paddle::Tensor attn = contiguous_float32(attn_in, "attention output");
  const paddle::Tensor hidden = contiguous_float32(hidden_in, "hidden");
  const paddle::Tensor norm = contiguous_float32(norm_in, "norm weight");
  PD_CHECK(attn.shape().size() == 2 && hidden.shape().size() == 2 && attn.shape()[0] == hidden.shape()[0],
           "mlp_blocks: attention output [rows, heads * head_dim] and hidden [rows, hidden] must share rows");
  PD_CHECK(act == 0 || act == 1, "mlp_blocks: act must be 0 (silu) or 1 (gelu_tanh), got ", act);
  PD_CHECK(gu_n % 2 == 0, "mlp_blocks: the gate/up product must be an even width (gate, then up)");
  const int64_t rows = hidden.shape()[0], d = hidden.shape()[1], f = gu_n / 2;
  PD_CHECK(norm.numel() == d, "mlp_blocks: the norm weight has ", norm.numel(), " elements, hidden ", d);
  paddle::Tensor sum = paddle::empty({rows, d}, paddle::DataType::FLOAT32, hidden.place());
  paddle::Tensor ffn = paddle::empty({rows, d}, paddle::DataType::FLOAT32, hidden.place());
  thread_local std::vector<float> o_out_buf, normed_buf, gate_up_buf, gated_buf;
  float* o_out = fd_cpu::grown(o_out_buf, size_t(rows * d));
  float* normed = fd_cpu::grown(normed_buf, size_t(rows * d));
  float* gate_up = fd_cpu::grown(gate_up_buf, size_t(rows * gu_n));
  float* gated = fd_cpu::grown(gated_buf, size_t(rows * f));
  product(Weight{o_q, o_scale, o_offset, d, o_group, o_kind}, attn.data<float>(), rows, attn.shape()[1], o_out);
  add_norm(hidden.data<float>(), o_out, norm.data<float>(), rows, d, eps, sum.data<float>(), normed);
  product(Weight{gu_q, gu_scale, gu_offset, gu_n, gu_group, gu_kind}, normed, rows, d, gate_up);
  const float* gu = gate_up;
  float* out = gated;
  // gated_activation.cc's rows, items and threshold
  fd_cpu::for_each_row(rows, 16, rows * f > (1 << 16),
                       [&](int64_t r) { fd_cpu::gated::gated_row(gu + r * gu_n, f, act, out + r * f); });
  product(Weight{down_q, down_scale, down_offset, d, down_group, down_kind}, gated, rows, f,
          ffn.data<float>());
  return {sum, ffn};
}

PD_BUILD_OP(norm_qkv_blocks)
    .Inputs({"hidden", paddle::Optional("delta"), "norm", "q", "scale", paddle::Optional("offset")})
    .Outputs({"sum", "qkv"})
    .Attrs({"n: int64_t", "group: int64_t", "kind: int64_t", "eps: float"})
    .SetKernelFn(PD_KERNEL(fd_cpu::decoder::NormQkvBlocks));

PD_BUILD_OP(mlp_blocks)
    .Inputs({"attn", "hidden", "o_q", "o_scale", paddle::Optional("o_offset"), "norm", "gu_q", "gu_scale",
             paddle::Optional("gu_offset"), "down_q", "down_scale", paddle::Optional("down_offset")})
    .Outputs({"sum", "ffn"})
    .Attrs({"o_group: int64_t", "o_kind: int64_t", "gu_n: int64_t", "gu_group: int64_t", "gu_kind: int64_t",
            "down_group: int64_t", "down_kind: int64_t", "eps: float", "act: int"})
    .SetKernelFn(PD_KERNEL(fd_cpu::decoder::MlpBlocks));
