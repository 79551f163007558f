// Paddle custom op `append_attention_gpu`: a thin wrapper over the C ABI launcher in
// append_attn/ (same arguments, semantics and input checks as the CPU op; bf16/fp16 tensors on
// the GPU; int8 / float8_e4m3fn caches, or uint8 caches of int4 pairs [..., head_dim / 2], or k8v4's
// int8 keys beside uint8 int4 values, with their scales for quantized pages, bf16 qkv). key_cache /
// value_cache (and the scales) are updated in place. Built by custom_ops/setup_ops.py, or
// JIT-built on first use (fastdeploy/.../ops/gpu_op_loader.py), when Paddle has CUDA.
//
// Checks: everything that needs no value of the int32 inputs (places, dtypes, shapes, table
// rank/dims; custom_ops/cpu_ops/append_attention_checks.h, shared with the CPU op) before any
// launch. No device sync inside a layer: the kernels record a needed -1 table entry (a scheduler
// bug) in `error_info` (4 device ints, updated in place, first error of the launch wins) and the
// caller reads it back once per step (ops/append_attention.py: check_device_errors).
#include <string>
#include <vector>

#include "append_attention_checks.h"  // custom_ops/cpu_ops, shared with the CPU op
#include "append_attn/append_attn_api.cuh"
#include "paddle/extension.h"

namespace {

int to_attn_dtype(paddle::DataType t) {
  return t == paddle::DataType::BFLOAT16 ? APPEND_ATTN_BF16 : APPEND_ATTN_FP16;
}

}  // namespace

std::vector<paddle::Tensor> AppendAttentionGpu(
    const paddle::Tensor& qkv, paddle::Tensor& key_cache, paddle::Tensor& value_cache,
    const paddle::Tensor& seq_lens_encoder, const paddle::Tensor& seq_lens_decoder,
    const paddle::Tensor& seq_lens_this_time, const paddle::Tensor& cu_seqlens_q,
    const paddle::Tensor& block_tables, const paddle::Tensor& rotary_cos,
    const paddle::Tensor& rotary_sin, const paddle::Tensor& head_windows,
    const paddle::Tensor& kv_head_slots, paddle::Tensor& key_cache_scales,
    paddle::Tensor& value_cache_scales, const paddle::Tensor& attention_sinks, paddle::Tensor& error_info,
    int num_heads, int kv_num_heads, int head_dim, bool visit_all_pages, float softcap, bool dual_pass) {
  // The CPU op's metadata checks (one header); the value checks run on the device (error_info).
  const fd_attn::Geometry g = fd_attn::check_inputs(
      fd_attn::gpu_rules(), qkv, key_cache, value_cache, seq_lens_encoder, seq_lens_decoder, seq_lens_this_time,
      cu_seqlens_q, block_tables, rotary_cos, rotary_sin, head_windows, kv_head_slots, key_cache_scales,
      value_cache_scales, num_heads, kv_num_heads, head_dim, visit_all_pages);
  const fd_attn::ScoreMods mods = fd_attn::check_score_mods(fd_attn::gpu_rules(), attention_sinks, softcap, num_heads);
  PD_CHECK(error_info.is_gpu() && error_info.dtype() == paddle::DataType::INT32 &&
               error_info.numel() == 4,
           "append_attention_gpu: error_info must be 4 int32 on the GPU");
  const auto& cache_shape = key_cache.shape();  // [num_blocks, kv_slots, block_size, head_dim]
  const auto& table_shape = block_tables.shape();

  AppendAttnParams p;
  p.dtype = to_attn_dtype(qkv.dtype());
  p.token_num = static_cast<int>(qkv.shape()[0]);
  p.bsz = static_cast<int>(seq_lens_this_time.shape()[0]);
  p.num_heads = num_heads;
  p.kv_num_heads = kv_num_heads;
  p.kv_slots = static_cast<int>(cache_shape[1]);
  p.head_dim = head_dim;
  p.block_size = static_cast<int>(cache_shape[2]);
  p.num_blocks = static_cast<int>(cache_shape[0]);
  p.max_blocks_per_seq = static_cast<int>(table_shape.back());
  p.head_wise_table = table_shape.size() == 3;
  p.max_position = static_cast<int>(rotary_cos.shape()[0]);
  p.visit_all_pages = visit_all_pages;
  p.dual_pass = dual_pass ? 1 : 0;
  p.cache_quant = g.page_format();  // the (key, value) lane pair the checks accepted, as AppendAttnCacheQuant
  p.softcap = mods.softcap;
  const bool quantized = p.cache_quant != APPEND_ATTN_CACHE_FLOAT;

  auto out = paddle::empty({p.token_num, num_heads * head_dim}, qkv.dtype(), qkv.place());
  AppendAttnBuffers b;
  b.qkv = qkv.data();
  b.key_cache = key_cache.data();
  b.value_cache = value_cache.data();
  b.seq_lens_encoder = seq_lens_encoder.data<int>();
  b.seq_lens_decoder = seq_lens_decoder.data<int>();
  b.seq_lens_this_time = seq_lens_this_time.data<int>();
  b.cu_seqlens_q = cu_seqlens_q.data<int>();
  b.block_tables = block_tables.data<int>();
  b.rotary_cos = rotary_cos.data<float>();
  b.rotary_sin = rotary_sin.data<float>();
  b.head_windows = head_windows.data<int>();  // [2, kv_num_heads]: windows and sinks per head
  b.kv_head_slots = kv_head_slots.data<int>();
  b.key_cache_scales = quantized ? key_cache_scales.data<float>() : nullptr;
  b.value_cache_scales = quantized ? value_cache_scales.data<float>() : nullptr;
  b.attention_sinks = mods.sinks;
  b.out = out.data();

  const size_t ws_bytes = append_attention_workspace_bytes(&p);
  PD_CHECK(ws_bytes > 0, "append_attention_gpu: unsupported shapes");
  auto workspace = paddle::empty({static_cast<int64_t>(ws_bytes)}, paddle::DataType::UINT8,
                                 qkv.place());
  const int status = append_attention_launch(&p, &b, workspace.data(), ws_bytes,
                                             error_info.data<int>(), qkv.stream());
  PD_CHECK(status == APPEND_ATTN_OK, "append_attention_gpu: ", append_attention_last_error());
  return {out};
}

std::vector<std::vector<int64_t>> AppendAttentionGpuInferShape(
    const std::vector<int64_t>& qkv_shape, const std::vector<int64_t>& key_cache_shape,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, int num_heads, int kv_num_heads, int head_dim, bool,
    float, bool) {
  return {{qkv_shape[0], static_cast<int64_t>(num_heads) * head_dim}};
}

std::vector<paddle::DataType> AppendAttentionGpuInferDtype(
    const paddle::DataType& qkv_dtype, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&, const paddle::DataType&) {
  return {qkv_dtype};
}

PD_BUILD_OP(append_attention_gpu)
    .Inputs({"qkv", "key_cache", "value_cache", "seq_lens_encoder", "seq_lens_decoder",
             "seq_lens_this_time", "cu_seqlens_q", "block_tables", "rotary_cos", "rotary_sin",
             "head_windows", "kv_head_slots", "key_cache_scales", "value_cache_scales",
             "attention_sinks", "error_info"})
    .Outputs({"out", "key_cache_out", "value_cache_out", "key_cache_scales_out",
              "value_cache_scales_out", "error_info_out"})
    .SetInplaceMap({{"key_cache", "key_cache_out"},
                    {"value_cache", "value_cache_out"},
                    {"key_cache_scales", "key_cache_scales_out"},
                    {"value_cache_scales", "value_cache_scales_out"},
                    {"error_info", "error_info_out"}})
    .Attrs({"num_heads: int", "kv_num_heads: int", "head_dim: int", "visit_all_pages: bool",
            "softcap: float", "dual_pass: bool"})
    .SetKernelFn(PD_KERNEL(AppendAttentionGpu))
    .SetInferShapeFn(PD_INFER_SHAPE(AppendAttentionGpuInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(AppendAttentionGpuInferDtype));
