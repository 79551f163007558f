// Plain C ABI of the CUDA AppendAttention kernels (head-wise SWA KV caches).
//
// One call = one layer's attention step for a mixed batch of prefill chunks and decodes, with the
// semantics and argument layout of the CPU op (docs/op_contract.md): RoPE on q and
// k, new K/V written into the paged cache, then attention over each request's cached keys through
// a 1-D ([bsz, max_blocks]) or head-wise ([bsz, kv_slots, max_blocks]) table; KV head h lives in
// slot kv_head_slots[h] of the cache (a lane of the slot layout, docs/memory_model.md). All pointers are
// device pointers. The same entry serves the Paddle op wrapper and the ctypes test harness, so it
// carries no framework types.
#pragma once

#include <stddef.h>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

enum AppendAttnDtype { APPEND_ATTN_BF16 = 0, APPEND_ATTN_FP16 = 1 };

// Page format of the caches (the values of fd_kvq::Format and fd_kvq::kK8V4, custom_ops/cpu_ops/
// kv_quant.h): 16-bit pages of `dtype`, 8-bit codes (int8 / e4m3fn bytes), or 4-bit int4 codes two per
// byte (element 2i in the low nibble; the caches are [num_blocks, kv_slots, block_size, head_dim / 2]
// bytes), with one float32 scale per token row of every page in key_cache_scales / value_cache_scales.
// Both caches hold the one format, except K8V4: int8 keys [..., head_dim] (rotated, as INT8's) and
// int4 values [..., head_dim / 2] (as INT4's). Quantized pages need dtype bf16.
enum AppendAttnCacheQuant {
  APPEND_ATTN_CACHE_FLOAT = 0,
  APPEND_ATTN_CACHE_INT8 = 1,
  APPEND_ATTN_CACHE_FP8_E4M3 = 2,
  APPEND_ATTN_CACHE_INT4 = 3,
  APPEND_ATTN_CACHE_K8V4 = 4,
};

// Return codes of append_attention_launch.
enum AppendAttnStatus {
  APPEND_ATTN_OK = 0,
  APPEND_ATTN_INVALID_ARGUMENT = 1,  // see append_attention_last_error()
  APPEND_ATTN_CUDA_ERROR = 2,        // a launch or runtime call failed
};

// Device-side error codes, written to error_info[0]; error_info[1..3] = request, kv head, block
// index (the position for APPEND_ATTN_ERR_POSITION). The first error of a launch wins.
enum AppendAttnDeviceError {
  APPEND_ATTN_ERR_NONE = 0,
  APPEND_ATTN_ERR_DEAD_ENTRY = 1,        // a needed table entry (visible key or destination) is -1
  APPEND_ATTN_ERR_DEAD_ENTRY_MASKED = 2, // visit_all_pages met a -1 entry in [0, t]
  APPEND_ATTN_ERR_OUT_OF_RANGE = 3,      // entry beyond the cache, or block index beyond the table
  APPEND_ATTN_ERR_POSITION = 4,          // position beyond the rotary tables
  APPEND_ATTN_ERR_HEAD_WINDOW = 5,       // head_windows[row][kv head] is negative; error_info[1] =
                                         // row (0 window, 1 sink), [2] = kv head, [3] = the value
  APPEND_ATTN_ERR_DUAL_PASS_WINDOWS = 6, // dual_pass: two sliding heads with different (window,
                                         // sink); error_info[1], [2] = the two kv heads
};

typedef struct AppendAttnParams {
  int dtype;               // AppendAttnDtype of qkv, out and float caches
  int token_num;           // rows of qkv / out
  int bsz;                 // request slots
  int num_heads;           // q heads
  int kv_num_heads;        // KV heads (num_heads % kv_num_heads == 0, group size 1..8)
  int head_dim;            // 64, 128 or 256
  int block_size;          // 16 or 64
  int num_blocks;          // dim 0 of the caches
  int max_blocks_per_seq;  // last dim of block_tables
  int head_wise_table;     // 0: [bsz, max_blocks]; 1: [bsz, kv_num_heads, max_blocks] of page ids
  int max_position;        // rows of rotary_cos / rotary_sin
  int visit_all_pages;     // baseline arm: visit every page of [0, t], mask instead of skip
  int dual_pass;           // baseline arm (upstream): an all-SWA pass (every head with the sliding
                           // heads' one window and sink, which they must share) and an all-full
                           // pass, stitched per head (a window > 0 in head_windows takes the SWA pass)
  int kv_slots;            // dim 1 of the caches and of a head-wise table (a lane's G slots,
                           // >= kv_num_heads); 0 means kv_num_heads
  int cache_quant;         // AppendAttnCacheQuant of the caches
  float softcap;           // > 0: every scaled score s becomes softcap * tanh(s / softcap) before the
                           // softmax (Gemma 2's attention soft-capping); 0: off
} AppendAttnParams;

typedef struct AppendAttnBuffers {
  const void* qkv;                // [token_num, (num_heads + 2 * kv_num_heads) * head_dim]
  void* key_cache;                // [num_blocks, kv_slots, block_size, head_dim] (int4: head_dim / 2
                                  // bytes), updated
  void* value_cache;              // same shape (K8V4: int4, head_dim / 2 bytes), updated
  const int* seq_lens_encoder;    // [bsz], informational, may be NULL
  const int* seq_lens_decoder;    // [bsz], cached tokens = position of the first new token
  const int* seq_lens_this_time;  // [bsz], new tokens; 0 = idle slot
  const int* cu_seqlens_q;        // [bsz + 1]
  const int* block_tables;        // see head_wise_table; -1 = recycled / unallocated
  const float* rotary_cos;        // [max_position, head_dim / 2]
  const float* rotary_sin;        // [max_position, head_dim / 2]
  const int* head_windows;        // [2, kv_num_heads]: row 0 the window of each KV head (0 = full
                                  // attention), row 1 its sink (>= 0)
  void* out;                      // [token_num, num_heads * head_dim]
  const int* kv_head_slots;       // [kv_num_heads]: slot (table row, cache slot) of each KV head,
                                  // distinct, < kv_slots; NULL means head h in slot h
  float* key_cache_scales;        // quantized caches: [num_blocks, kv_slots, block_size], updated;
  float* value_cache_scales;      // same; both NULL for float caches
  const float* attention_sinks;   // [num_heads] float32: a learned logit per q head that joins the
                                  // softmax's denominator (gpt-oss), or NULL for none
} AppendAttnBuffers;

// Bytes of device workspace append_attention_launch needs for these parameters (on the current
// device: the decode split count depends on its SM count); 0 for parameters the launch would refuse,
// with the reason in append_attention_last_error().
size_t append_attention_workspace_bytes(const AppendAttnParams* params);

// The kernels a step launches, for append_attention_dynamic_smem_bytes.
enum AppendAttnKernel {
  APPEND_ATTN_KERNEL_ROPE_WRITE = 0,     // rope_write_cache_kernel / rope_write_quantized_kernel
  APPEND_ATTN_KERNEL_PREFILL_TILES = 1,  // prefill_tile_prefix_kernel
  APPEND_ATTN_KERNEL_PREFILL = 2,        // prefill_attention_kernel
  APPEND_ATTN_KERNEL_DECODE = 3,         // decode_attention_kernel
  APPEND_ATTN_KERNEL_DECODE_MERGE = 4,   // decode_merge_kernel
  APPEND_ATTN_KERNEL_STITCH = 5,         // stitch_heads_kernel (dual pass)
};

// Dynamic shared memory per thread block (bytes) that `kernel` is launched with for these
// parameters, from the constants the launches use: what a tool checks against a GPU's per-block
// limit without a GPU (benchmarks/kernel_resources.py). 0 for a kernel launched without any, for
// unsupported parameters and for an unknown kernel.
size_t append_attention_dynamic_smem_bytes(const AppendAttnParams* params, int kernel);

// Enqueues the whole step on `stream` and returns without synchronizing. error_info is 4 device
// ints, cleared by the call; read them after the stream completes and pass them to
// append_attention_describe_error.
int append_attention_launch(const AppendAttnParams* params, const AppendAttnBuffers* buffers,
                            void* workspace, size_t workspace_bytes, int* error_info,
                            cudaStream_t stream);

// Message of the last failed launch on this thread (empty when none).
const char* append_attention_last_error(void);

// Human-readable text for host-side copy of error_info; returns buf.
const char* append_attention_describe_error(const int* error_info, char* buf, size_t buf_len);

#ifdef __cplusplus
}  // extern "C"
#endif
