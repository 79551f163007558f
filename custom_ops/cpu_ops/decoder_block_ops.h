// A decoder layer's dense work on GGUF-block weights (decoder_block_ops.cc), as functions the
// norm_qkv_blocks / mlp_blocks ops wrap and the whole-stack op (decoder_stack.cc) calls per layer.
#pragma once

#include <vector>

#include "paddle/extension.h"

namespace fd_cpu {
namespace decoder {

// hidden (+ delta) -> RMSNorm -> the fused q/k/v product: {hidden + delta, qkv}.
std::vector<paddle::Tensor> NormQkvBlocks(const paddle::Tensor& hidden_in,
                                          const paddle::optional<paddle::Tensor>& delta_in,
                                          const paddle::Tensor& norm_in, const paddle::Tensor& q,
                                          const paddle::Tensor& scale, const paddle::optional<paddle::Tensor>& offset,
                                          int64_t n, int64_t group, int64_t kind, float eps);

// attention output -> o_proj -> + hidden -> RMSNorm -> gate/up -> act -> down: {hidden + o, ffn}.
std::vector<paddle::Tensor> MlpBlocks(const paddle::Tensor& attn_in, const paddle::Tensor& hidden_in,
                                      const paddle::Tensor& o_q, const paddle::Tensor& o_scale,
                                      const paddle::optional<paddle::Tensor>& o_offset, const paddle::Tensor& norm_in,
                                      const paddle::Tensor& gu_q, const paddle::Tensor& gu_scale,
                                      const paddle::optional<paddle::Tensor>& gu_offset, const paddle::Tensor& down_q,
                                      const paddle::Tensor& down_scale,
                                      const paddle::optional<paddle::Tensor>& down_offset, int64_t o_group,
                                      int64_t o_kind, int64_t gu_n, int64_t gu_group, int64_t gu_kind,
                                      int64_t down_group, int64_t down_kind, float eps, int act);

// y [m, n] = x [m, k] . W^T for a weight of the kinds above (0 / 1 exact, 2 int8 activations).
void block_weight_product(const paddle::Tensor& q, const paddle::Tensor& scale,
                          const paddle::optional<paddle::Tensor>& offset, int64_t n, int64_t group, int64_t kind,
                          const float* x, int64_t m, int64_t k, float* y);

}  // namespace decoder
}  // namespace fd_cpu
