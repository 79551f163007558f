// The GGUF-block products as plain functions on buffers: the linear_blocks / linear_blocks_int8
// ops wrap them, and the fused decoder blocks (decoder_block_ops.cc) chain them without a Paddle
// op call per product. Both check their operands as the ops do.
#pragma once

#include <cstdint>
#include <vector>

#include "paddle/extension.h"

namespace fd_cpu {
namespace linear {

// linear_blocks.cc: exact (each weight the file's float32 value; the bits of linear_packed).
void blocks_product(const paddle::Tensor& q, const paddle::Tensor& scale,
                    const paddle::optional<paddle::Tensor>& offset, int64_t n, int64_t group, bool one_rounding,
                    const float* x, int64_t m, int64_t k_dim, float* y);

// linear_blocks_int8.cc: activations quantized to int8 per block of 32 (FD_CPU_INT8_ACTIVATIONS).
void int8_blocks_product(const paddle::Tensor& q, const paddle::Tensor& scale,
                         const paddle::optional<paddle::Tensor>& offset, int64_t n, const float* x, int64_t m,
                         int64_t k_dim, float* y);

// Which kernel the int8-activation products run here: VNNI's vpdpbusd (AVX-512), AVX2's vpmaddubsw /
// vpmaddwd, or portable C++ (the same bits; the numbering is cpu_kernel_isas' answer).
enum class Int8Kernels { kVnni = 0, kAvx2 = 1, kPortable = 2 };
Int8Kernels int8_kernels();

// A row product's operand and result: x as contiguous CPU float32 rows [m, k] (any leading shape) and
// an empty float32 output of x's shape with the last axis n. Every weight format's op wrapper takes it.
struct RowsProduct {
  paddle::Tensor x;
  int64_t m;
  int64_t k;
  paddle::Tensor y;
};

inline RowsProduct rows_product(const paddle::Tensor& x_in, int64_t n, const char* op) {
  const paddle::Tensor x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && x.is_cpu(), op, ": x must be a CPU float32 tensor");
  const auto& xs = x.shape();
  PD_CHECK(!xs.empty(), op, ": x must have at least one dimension");
  const int64_t k = xs.back();
  std::vector<int64_t> out_shape(xs.begin(), xs.end());
  out_shape.back() = n;
  return {x, k == 0 ? 0 : x.numel() / k, k, paddle::empty(out_shape, paddle::DataType::FLOAT32, x.place())};
}

}  // namespace linear
}  // namespace fd_cpu
