// CPU AppendAttention: one layer's attention step for a mixed batch of
// prefill chunks and decodes over a paged KV cache, addressed through either a
// 1-D block table [bsz, max_blocks] or a head-wise page table
// [bsz, G, max_blocks] (page p = cache[p / G, p % G]). The cache is one lane of
// the slot layout [num_blocks, G, block_size, head_dim] (G >= kv_heads slots);
// kv_head_slots[h] is the slot (table row) of KV head h in this layer.
//
// Quantized lanes (int8, e4m3fn, or uint8 caches of int4 pairs [num_blocks, G, block_size,
// head_dim / 2], kv_quant.h) carry float32 scales [num_blocks, G, block_size] for K and for V, one
// per token row of every page; float lanes take a 1-element placeholder there (docs/op_contract.md).
// K and V lanes share a dtype and shape, except k8v4 pages: int8 keys beside uint8 int4 values.
//
// The step runs in three passes:
//   1. validate every shape and every table entry the step will touch, so a
//      scheduler bug (-1 where a page is needed) is a clear error raised
//      before anything is written, never a wild read;
//   2. rotate q/k (interleaved RoPE) and write the new K/V rows in place
//      (quantized lanes: each row's codes and its scale);
//   3. attention per (tile of a request's tokens, KV head): the tile's query
//      heads and tokens share each K/V page (dequantized once per visit); a SWA head visits only the sink
//      pages and the pages that overlap its window, so its cost is
//      O(window + sink), not O(sequence). Each KV head slides with its own
//      window and sink (head_windows [2, kv_heads]: row 0 windows, 0 = full; row 1 sinks).
// The argument layout is pinned in docs/op_contract.md.

#include "append_attention_step.h"

std::vector<paddle::Tensor> AppendAttentionCpu(
    const paddle::Tensor& qkv, const paddle::Tensor& key_cache,
    const paddle::Tensor& value_cache, const paddle::Tensor& seq_lens_encoder,
    const paddle::Tensor& seq_lens_decoder,
    const paddle::Tensor& seq_lens_this_time,
    const paddle::Tensor& cu_seqlens_q, const paddle::Tensor& block_tables,
    const paddle::Tensor& rotary_cos, const paddle::Tensor& rotary_sin,
    const paddle::Tensor& head_windows, const paddle::Tensor& kv_head_slots,
    const paddle::Tensor& key_cache_scales, const paddle::Tensor& value_cache_scales,
    const paddle::Tensor& attention_sinks, int num_heads, int kv_num_heads, int head_dim, bool visit_all_pages,
    float softcap) {
  const fd_attn::ScoreMods mods = fd_attn::check_score_mods(fd_attn::cpu_rules(), attention_sinks, softcap, num_heads);
  return {fd_cpu::append_attention_step(qkv, key_cache, value_cache, seq_lens_encoder, seq_lens_decoder,
                                        seq_lens_this_time, cu_seqlens_q, block_tables, rotary_cos, rotary_sin,
                                        head_windows, kv_head_slots, key_cache_scales, value_cache_scales,
                                        num_heads, kv_num_heads, head_dim, visit_all_pages, mods)};
}

std::vector<std::vector<int64_t>> AppendAttentionCpuInferShape(
    const std::vector<int64_t>& qkv_shape, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&, int num_heads, int,
    int head_dim, bool, float) {
  return {{qkv_shape[0], int64_t(num_heads) * head_dim}};
}

std::vector<paddle::DataType> AppendAttentionCpuInferDtype(
    const paddle::DataType& qkv_dtype, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&, const paddle::DataType&) {
  return {qkv_dtype};
}

PD_BUILD_OP(append_attention_cpu)
    .Inputs({"qkv", "key_cache", "value_cache", "seq_lens_encoder",
             "seq_lens_decoder", "seq_lens_this_time", "cu_seqlens_q",
             "block_tables", "rotary_cos", "rotary_sin", "head_windows",
             "kv_head_slots", "key_cache_scales", "value_cache_scales", "attention_sinks"})
    .Outputs({"out", "key_cache_out", "value_cache_out", "key_cache_scales_out",
              "value_cache_scales_out"})
    .SetInplaceMap({{"key_cache", "key_cache_out"},
                    {"value_cache", "value_cache_out"},
                    {"key_cache_scales", "key_cache_scales_out"},
                    {"value_cache_scales", "value_cache_scales_out"}})
    .Attrs({"num_heads: int", "kv_num_heads: int", "head_dim: int", "visit_all_pages: bool", "softcap: float"})
    .SetKernelFn(PD_KERNEL(AppendAttentionCpu))
    .SetInferShapeFn(PD_INFER_SHAPE(AppendAttentionCpuInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(AppendAttentionCpuInferDtype));

// Validation only, with the CPU op's or the CUDA wrapper's rules, on CPU tensors: lets the
// GPU wrapper's checks (fd_attn::gpu_rules) be unit-tested on machines without a GPU.
// Returns [token_num] so the op has an output.
std::vector<paddle::Tensor> AppendAttentionValidate(
    const paddle::Tensor& qkv, const paddle::Tensor& key_cache,
    const paddle::Tensor& value_cache, const paddle::Tensor& seq_lens_encoder,
    const paddle::Tensor& seq_lens_decoder,
    const paddle::Tensor& seq_lens_this_time,
    const paddle::Tensor& cu_seqlens_q, const paddle::Tensor& block_tables,
    const paddle::Tensor& rotary_cos, const paddle::Tensor& rotary_sin,
    const paddle::Tensor& head_windows, const paddle::Tensor& kv_head_slots,
    const paddle::Tensor& key_cache_scales, const paddle::Tensor& value_cache_scales,
    const paddle::Tensor& attention_sinks, int num_heads, int kv_num_heads, int head_dim, bool visit_all_pages,
    float softcap, bool gpu_rules, bool check_place) {
  fd_attn::DeviceRules rules = gpu_rules ? fd_attn::gpu_rules() : fd_attn::cpu_rules();
  rules.check_place = check_place;
  const fd_attn::CheckedStep step = fd_attn::check_step(
      rules, qkv, key_cache, value_cache, seq_lens_encoder, seq_lens_decoder, seq_lens_this_time, cu_seqlens_q,
      block_tables, rotary_cos, rotary_sin, head_windows, kv_head_slots, key_cache_scales, value_cache_scales,
      num_heads, kv_num_heads, head_dim, visit_all_pages);
  fd_attn::check_score_mods(rules, attention_sinks, softcap, num_heads);
  paddle::Tensor rows = paddle::empty({1}, paddle::DataType::INT64, paddle::CPUPlace());
  rows.data<int64_t>()[0] = step.g.token_num;
  return {rows};
}

std::vector<std::vector<int64_t>> AppendAttentionValidateInferShape(
    const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&,
    const std::vector<int64_t>&, const std::vector<int64_t>&, const std::vector<int64_t>&, int, int, int, bool,
    float, bool, bool) {
  return {{1}};
}

std::vector<paddle::DataType> AppendAttentionValidateInferDtype(
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&,
    const paddle::DataType&, const paddle::DataType&, const paddle::DataType&) {
  return {paddle::DataType::INT64};
}

PD_BUILD_OP(append_attention_validate)
    .Inputs({"qkv", "key_cache", "value_cache", "seq_lens_encoder",
             "seq_lens_decoder", "seq_lens_this_time", "cu_seqlens_q",
             "block_tables", "rotary_cos", "rotary_sin", "head_windows",
             "kv_head_slots", "key_cache_scales", "value_cache_scales", "attention_sinks"})
    .Outputs({"token_num"})
    .Attrs({"num_heads: int", "kv_num_heads: int", "head_dim: int", "visit_all_pages: bool",
            "softcap: float", "gpu_rules: bool", "check_place: bool"})
    .SetKernelFn(PD_KERNEL(AppendAttentionValidate))
    .SetInferShapeFn(PD_INFER_SHAPE(AppendAttentionValidateInferShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(AppendAttentionValidateInferDtype));
