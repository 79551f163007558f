// The GGUF-block products as plain functions on buffers: the linear_blocks / linear_blocks_int8
// ops wrap them, and the fused decoder blocks (decoder_block_ops.cc) chain them without a Paddle
// op call per product. Both check their operands as the ops do.
#pragma once

#include <cstdint>

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

}  // namespace linear
}  // namespace fd_cpu
