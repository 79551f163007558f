// C ABI launcher: validates the parameters, carves the workspace, and enqueues
// RoPE + cache write, prefill attention, decode attention + merge (twice and a per-head stitch for
// the dual-pass baseline). Nothing here synchronizes the stream.
#include <stdio.h>
#include <string.h>

#include <string>

#include "append_attn_common.cuh"

namespace append_attn {
namespace {

thread_local std::string g_last_error;

int fail(int status, const std::string& msg) {
  g_last_error = msg;
  return status;
}

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

size_t dtype_bytes(int) { return 2; }  // bf16 and fp16

struct Layout {
  size_t q_rot, tile_prefix, partial, swa_out, dual_window, total;
  int decode_max_splits, decode_pages_per_split;
};

// Decode splits: enough thread blocks for about 16 per SM over the whole batch, so long contexts
// stream at full bandwidth, capped at 64 partials per query. The split size is in blocks of the
// query's live list, so a SWA head (few live blocks) gets few splits.
Layout make_layout(const AppendAttnParams& p) {
  int device = 0;
  int sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      sms <= 0) {
    cudaGetLastError();  // no device visible: size for a large GPU, launches fail later anyway
    sms = 132;
  }
  const long long items = (long long)p.bsz * p.kv_num_heads;
  const long long target = 16LL * sms;
  long long splits = (target + items - 1) / items;
  splits = splits < 1 ? 1 : (splits > 64 ? 64 : splits);
  const int max_blocks = p.max_blocks_per_seq > 0 ? p.max_blocks_per_seq : 1;
  if (splits > max_blocks) splits = max_blocks;
  Layout l;
  l.decode_pages_per_split = (int)((max_blocks + splits - 1) / splits);
  l.decode_max_splits = (max_blocks + l.decode_pages_per_split - 1) / l.decode_pages_per_split;

  const size_t tokens = p.token_num > 0 ? (size_t)p.token_num : 0;
  const size_t hd = (size_t)p.num_heads * p.head_dim;
  size_t off = 0;
  l.q_rot = off;
  off = align256(off + sizeof(float) * tokens * hd);
  l.tile_prefix = off;
  off = align256(off + sizeof(int) * ((size_t)p.bsz + 1));
  l.partial = off;
  off = align256(off + sizeof(float) * (size_t)l.decode_max_splits * p.bsz * p.num_heads *
                           (p.head_dim + 2));
  l.swa_out = off;
  if (p.dual_pass) off = align256(off + dtype_bytes(p.dtype) * tokens * hd);
  l.dual_window = off;
  if (p.dual_pass) off = align256(off + 2 * sizeof(int));
  l.total = off;
  return l;
}

std::string validate(const AppendAttnParams& p) {
  char buf[256];
  if (p.dtype != APPEND_ATTN_BF16 && p.dtype != APPEND_ATTN_FP16) return "dtype must be bf16 or fp16";
  if (p.head_dim != 64 && p.head_dim != 128 && p.head_dim != 256) {
    snprintf(buf, sizeof(buf), "head_dim %d unsupported (64, 128 or 256)", p.head_dim);
    return buf;
  }
  if (p.block_size != 16 && p.block_size != 64) {
    snprintf(buf, sizeof(buf), "block_size %d unsupported (16 or 64)", p.block_size);
    return buf;
  }
  if (p.num_heads <= 0 || p.kv_num_heads <= 0 || p.num_heads % p.kv_num_heads != 0 ||
      p.num_heads / p.kv_num_heads > kMaxGroup) {
    snprintf(buf, sizeof(buf),
             "num_heads %d / kv_num_heads %d must be a whole group size in 1..%d", p.num_heads,
             p.kv_num_heads, kMaxGroup);
    return buf;
  }
  if (p.kv_slots != 0 && (p.kv_slots < p.kv_num_heads || p.kv_slots > 65535)) {
    snprintf(buf, sizeof(buf), "kv_slots %d must be 0 or in kv_num_heads (%d)..65535", p.kv_slots,
             p.kv_num_heads);
    return buf;
  }
  if (p.dual_pass != 0 && p.dual_pass != 1) {
    snprintf(buf, sizeof(buf), "dual_pass %d must be 0 or 1", p.dual_pass);
    return buf;
  }
  if (!(p.softcap >= 0.f) || p.softcap > 3.0e38f) {  // NaN fails the first test
    snprintf(buf, sizeof(buf), "softcap %g must be >= 0 and finite (0 = no soft-capping)", p.softcap);
    return buf;
  }
  if (p.cache_quant < APPEND_ATTN_CACHE_FLOAT || p.cache_quant > APPEND_ATTN_CACHE_K8V4) {
    snprintf(buf, sizeof(buf), "cache_quant %d unknown (0 float, 1 int8, 2 e4m3, 3 int4, 4 k8v4)", p.cache_quant);
    return buf;
  }
  if (p.cache_quant != APPEND_ATTN_CACHE_FLOAT && p.dtype != APPEND_ATTN_BF16) {
    return "quantized caches (cache_quant != 0) need dtype bf16";
  }
  // The quantized cache write stages a token's rows in shared memory (227 KB on sm_90, 163 on sm_80).
  if (p.cache_quant != APPEND_ATTN_CACHE_FLOAT &&
      quantized_rope_write_smem_bytes(p.num_heads, p.kv_num_heads, p.head_dim) > 160 * 1024) {
    snprintf(buf, sizeof(buf), "quantized caches: %d q + %d kv heads of head_dim %d need more shared memory "
             "than the cache write has", p.num_heads, p.kv_num_heads, p.head_dim);
    return buf;
  }
  if (p.token_num < 0 || p.bsz < 1 || p.bsz > 65535 || p.num_blocks < 1 ||
      p.max_blocks_per_seq < 1 || p.max_position < 1 || p.kv_num_heads > 65535) {
    snprintf(buf, sizeof(buf),
             "bad sizes: token_num %d, bsz %d, num_blocks %d, max_blocks_per_seq %d, "
             "max_position %d",
             p.token_num, p.bsz, p.num_blocks, p.max_blocks_per_seq, p.max_position);
    return buf;
  }
  return "";
}

// Dual pass: copy the SWA pass's output over the full pass's for the SWA heads (a window > 0 in row 0
// of head_windows).
template <typename T>
__global__ void __launch_bounds__(256) stitch_heads_kernel(Args a, const T* __restrict__ swa_out, T* __restrict__ out) {
  const int token = blockIdx.x;
  if (find_request(a.cu_seqlens_q, a.bsz, token) < 0) return;  // zeroed by the RoPE kernel
  const int group = a.num_heads / a.kv_num_heads;
  const long long row = (long long)token * a.num_heads * a.head_dim;
  for (int i = threadIdx.x; i < a.num_heads * a.head_dim; i += blockDim.x) {
    const int head = i / a.head_dim / group;
    if (a.head_windows[head] > 0) out[row + i] = swa_out[row + i];
  }
}

}  // namespace

cudaError_t launch_stitch_heads(const Args& a, int dtype, const void* swa_out, void* out,
                                cudaStream_t stream) {
  if (a.token_num == 0) return cudaSuccess;
  if (dtype == APPEND_ATTN_BF16) {
    CUDA_LAUNCH(a.token_num, 256, 0, stream, stitch_heads_kernel<__nv_bfloat16>)(
        a, static_cast<const __nv_bfloat16*>(swa_out), static_cast<__nv_bfloat16*>(out));
  } else {
    CUDA_LAUNCH(a.token_num, 256, 0, stream, stitch_heads_kernel<__half>)(
        a, static_cast<const __half*>(swa_out), static_cast<__half*>(out));
  }
  return cudaGetLastError();
}

}  // namespace append_attn

using namespace append_attn;

#define RETURN_IF_CUDA_ERROR(expr)                                                       \
  do {                                                                                   \
    const cudaError_t err_ = (expr);                                                     \
    if (err_ != cudaSuccess) {                                                           \
      return fail(APPEND_ATTN_CUDA_ERROR, std::string(#expr) + ": " + cudaGetErrorString(err_)); \
    }                                                                                    \
  } while (0)

extern "C" size_t append_attention_workspace_bytes(const AppendAttnParams* params) {
  if (params == nullptr) return 0;
  const std::string why = validate(*params);
  if (!why.empty()) {
    g_last_error = why;  // what the caller reports (append_attention_last_error)
    return 0;
  }
  return make_layout(*params).total;
}

extern "C" size_t append_attention_dynamic_smem_bytes(const AppendAttnParams* params, int kernel) {
  if (params == nullptr || !validate(*params).empty()) return 0;
  const AppendAttnParams& p = *params;
  switch (kernel) {
    case APPEND_ATTN_KERNEL_ROPE_WRITE:  // only the quantized write stages rows in shared memory
      return p.cache_quant == APPEND_ATTN_CACHE_FLOAT
                 ? 0
                 : quantized_rope_write_smem_bytes(p.num_heads, p.kv_num_heads, p.head_dim);
    case APPEND_ATTN_KERNEL_PREFILL:
      return prefill_attention_smem_bytes(p.cache_quant, p.head_dim);
    default:  // the other kernels are launched with 0 bytes of dynamic shared memory
      return 0;
  }
}

extern "C" int append_attention_launch(const AppendAttnParams* params,
                                       const AppendAttnBuffers* buffers, void* workspace,
                                       size_t workspace_bytes, int* error_info,
                                       cudaStream_t stream) {
  g_last_error.clear();
  if (params == nullptr || buffers == nullptr || error_info == nullptr) {
    return fail(APPEND_ATTN_INVALID_ARGUMENT, "params, buffers and error_info are required");
  }
  const AppendAttnParams& p = *params;
  const AppendAttnBuffers& b = *buffers;
  const std::string bad = validate(p);
  if (!bad.empty()) return fail(APPEND_ATTN_INVALID_ARGUMENT, bad);
  const Layout layout = make_layout(p);
  if (workspace == nullptr || workspace_bytes < layout.total) {
    return fail(APPEND_ATTN_INVALID_ARGUMENT,
                "workspace smaller than append_attention_workspace_bytes()");
  }
  RETURN_IF_CUDA_ERROR(cudaMemsetAsync(error_info, 0, 4 * sizeof(int), stream));
  if (p.token_num == 0) return APPEND_ATTN_OK;
  if (b.qkv == nullptr || b.key_cache == nullptr || b.value_cache == nullptr ||
      b.seq_lens_decoder == nullptr || b.seq_lens_this_time == nullptr ||
      b.cu_seqlens_q == nullptr || b.block_tables == nullptr || b.rotary_cos == nullptr ||
      b.rotary_sin == nullptr || b.head_windows == nullptr || b.out == nullptr) {
    return fail(APPEND_ATTN_INVALID_ARGUMENT, "a required device buffer is NULL");
  }
  if (p.cache_quant != APPEND_ATTN_CACHE_FLOAT &&
      (b.key_cache_scales == nullptr || b.value_cache_scales == nullptr)) {
    return fail(APPEND_ATTN_INVALID_ARGUMENT, "quantized caches need key_cache_scales and value_cache_scales");
  }

  unsigned char* ws = static_cast<unsigned char*>(workspace);
  Args a;
  a.qkv = b.qkv;
  a.key_cache = b.key_cache;
  a.value_cache = b.value_cache;
  a.seq_lens_decoder = b.seq_lens_decoder;
  a.seq_lens_this_time = b.seq_lens_this_time;
  a.cu_seqlens_q = b.cu_seqlens_q;
  a.block_tables = b.block_tables;
  a.rotary_cos = b.rotary_cos;
  a.rotary_sin = b.rotary_sin;
  a.head_windows = b.head_windows;
  a.kv_head_slots = b.kv_head_slots;
  a.key_scales = p.cache_quant != APPEND_ATTN_CACHE_FLOAT ? b.key_cache_scales : nullptr;
  a.value_scales = p.cache_quant != APPEND_ATTN_CACHE_FLOAT ? b.value_cache_scales : nullptr;
  a.cache_quant = p.cache_quant;
  a.sinks = b.attention_sinks;
  a.softcap = p.softcap;
  a.q_rot = reinterpret_cast<float*>(ws + layout.q_rot);
  a.tile_prefix = reinterpret_cast<int*>(ws + layout.tile_prefix);
  a.partial = reinterpret_cast<float*>(ws + layout.partial);
  a.error_info = error_info;
  a.dual_window = p.dual_pass ? reinterpret_cast<int*>(ws + layout.dual_window) : nullptr;
  a.token_num = p.token_num;
  a.bsz = p.bsz;
  a.num_heads = p.num_heads;
  a.kv_num_heads = p.kv_num_heads;
  a.kv_slots = p.kv_slots > 0 ? p.kv_slots : p.kv_num_heads;
  a.head_dim = p.head_dim;
  a.block_size = p.block_size;
  a.num_blocks = p.num_blocks;
  a.max_blocks_per_seq = p.max_blocks_per_seq;
  a.head_wise_table = p.head_wise_table != 0;
  a.max_position = p.max_position;
  a.visit_all_pages = p.visit_all_pages != 0;
  a.decode_max_splits = layout.decode_max_splits;
  a.decode_pages_per_split = layout.decode_pages_per_split;

  RETURN_IF_CUDA_ERROR(launch_rope_write_cache(a, p.dtype, b.out, stream));
  RETURN_IF_CUDA_ERROR(launch_prefill_tiles(a, stream));
  if (!p.dual_pass) {
    RETURN_IF_CUDA_ERROR(launch_prefill_attention(a, p.dtype, kUseMask, b.out, stream));
    RETURN_IF_CUDA_ERROR(launch_decode_attention(a, p.dtype, kUseMask, b.out, stream));
    return APPEND_ATTN_OK;
  }
  // Upstream's head-wise SWA on a 1-D table: attention once with every head sliding-window (the
  // sliding heads' one window and sink, derived by the tile prefix kernel into dual_window) and once
  // with every head full, then each head keeps the pass of its kind.
  void* swa_out = ws + layout.swa_out;
  RETURN_IF_CUDA_ERROR(launch_prefill_attention(a, p.dtype, kForceSwa, swa_out, stream));
  RETURN_IF_CUDA_ERROR(launch_decode_attention(a, p.dtype, kForceSwa, swa_out, stream));
  RETURN_IF_CUDA_ERROR(launch_prefill_attention(a, p.dtype, kForceFull, b.out, stream));
  RETURN_IF_CUDA_ERROR(launch_decode_attention(a, p.dtype, kForceFull, b.out, stream));
  RETURN_IF_CUDA_ERROR(launch_stitch_heads(a, p.dtype, swa_out, b.out, stream));
  return APPEND_ATTN_OK;
}

extern "C" const char* append_attention_last_error(void) { return g_last_error.c_str(); }

extern "C" const char* append_attention_describe_error(const int* info, char* buf,
                                                       size_t buf_len) {
  if (buf == nullptr || buf_len == 0) return "";
  const int code = info == nullptr ? 0 : info[0];
  switch (code) {
    case APPEND_ATTN_ERR_NONE:
      snprintf(buf, buf_len, "no error");
      break;
    case APPEND_ATTN_ERR_DEAD_ENTRY:
      snprintf(buf, buf_len,
               "block table entry is -1 but the step needs it (request %d, kv head %d, block "
               "index %d): the page was recycled or never allocated (scheduler bug)",
               info[1], info[2], info[3]);
      break;
    case APPEND_ATTN_ERR_DEAD_ENTRY_MASKED:
      snprintf(buf, buf_len,
               "visit_all_pages met a -1 block table entry (request %d, kv head %d, block index "
               "%d): the masked baseline needs every page of [0, t] allocated",
               info[1], info[2], info[3]);
      break;
    case APPEND_ATTN_ERR_OUT_OF_RANGE:
      snprintf(buf, buf_len,
               "block table entry out of range (request %d, kv head %d, block index %d): id "
               "beyond the cache or index beyond max_blocks_per_seq",
               info[1], info[2], info[3]);
      break;
    case APPEND_ATTN_ERR_HEAD_WINDOW:
      snprintf(buf, buf_len, "head_windows[%d][%d] (the %s of kv head %d) is %d; it must be >= 0",
               info[1], info[2], info[1] == 0 ? "window" : "sink", info[2], info[3]);
      break;
    case APPEND_ATTN_ERR_DUAL_PASS_WINDOWS:
      snprintf(buf, buf_len,
               "dual_pass slides every head with one window, but kv heads %d and %d of head_windows "
               "slide with different (window, sink) pairs: every sliding head must share one",
               info[1], info[2]);
      break;
    case APPEND_ATTN_ERR_POSITION:
      snprintf(buf, buf_len, "position %d of request %d is beyond the rotary tables", info[3],
               info[1]);
      break;
    default:
      snprintf(buf, buf_len, "unknown device error code %d", code);
  }
  return buf;
}
