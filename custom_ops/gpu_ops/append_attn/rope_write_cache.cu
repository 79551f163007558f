// Step (a): RoPE on the new q and k (interleaved pairs), new K/V written into the paged cache.
// Rotated q goes to a float workspace, pre-scaled by 1/sqrt(head_dim), so the attention kernels
// read it once per tile without re-rotating and keep fp32 precision (the CPU op's math).
// Quantized pages (cache_quant) take the CPU op's rule, the same header (kv_quant.h): each row's
// absmax scale, codes rounded to nearest even; int8 and int4 keys and the queries Hadamard-rotated.
// Each lane is written in its own format (k8v4: int8 keys, int4 values).
#include <type_traits>

#include "append_attn_common.cuh"

namespace append_attn {
namespace {

constexpr int kThreads = 128;

// The cache write's code type for int4 pages (a tag: two codes share a byte, see kv_quant.h).
struct Int4Pair;

template <typename Code>
__device__ __forceinline__ fd_kvq::Format format_of_code() {
  if constexpr (std::is_same<Code, Int4Pair>::value) {
    return fd_kvq::kInt4;
  } else {
    return fd_kvq::format_of<Code>();
  }
}

// Request and position of qkv row `token`: false for a row no request owns (its output row is
// zeroed here, so every output element is written) and for a position past the rotary tables
// (recorded); both cache-write kernels start here.
template <typename T>
__device__ __forceinline__ bool locate_token(const Args& a, int token, T* out, int* req_out, int* pos_out) {
  const int req = find_request(a.cu_seqlens_q, a.bsz, token);
  const int local = req < 0 ? 0 : token - a.cu_seqlens_q[req];
  if (req < 0 || local >= a.seq_lens_this_time[req]) {
    const int width = a.num_heads * a.head_dim;
    for (int i = threadIdx.x; i < width; i += blockDim.x) out[(long long)token * width + i] = Num<T>::from_float(0.f);
    return false;
  }
  const int pos = a.seq_lens_decoder[req] + local;
  if (pos < 0 || pos >= a.max_position) {
    if (threadIdx.x == 0) record_error(a.error_info, APPEND_ATTN_ERR_POSITION, req, -1, pos);
    return false;
  }
  *req_out = req;
  *pos_out = pos;
  return true;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    rope_write_cache_kernel(Args a, float q_scale, T* __restrict__ out) {
  using T2 = typename Num<T>::T2;
  const int token = blockIdx.x;
  const int D = a.head_dim;
  const int pairs = D / 2;
  const int nh = a.num_heads;
  const int kvh = a.kv_num_heads;

  int req, pos;
  if (!locate_token(a, token, out, &req, &pos)) return;

  const T2* row = reinterpret_cast<const T2*>(static_cast<const T*>(a.qkv) +
                                              (long long)token * (nh + 2 * kvh) * D);
  const float* cos_row = a.rotary_cos + (long long)pos * pairs;
  const float* sin_row = a.rotary_sin + (long long)pos * pairs;

  float2* q_out = reinterpret_cast<float2*>(a.q_rot + (long long)token * nh * D);
  for (int i = threadIdx.x; i < nh * pairs; i += blockDim.x) {
    const int p = i % pairs;
    const float2 x = Num<T>::to_float2(row[i]);
    const float c = cos_row[p];
    const float s = sin_row[p];
    q_out[i] = make_float2((x.x * c - x.y * s) * q_scale, (x.y * c + x.x * s) * q_scale);
  }

  const int block = pos / a.block_size;
  const int row_in_block = pos % a.block_size;
  T2* k_cache = static_cast<T2*>(a.key_cache);
  T2* v_cache = static_cast<T2*>(a.value_cache);
  for (int i = threadIdx.x; i < kvh * pairs; i += blockDim.x) {
    const int h = i / pairs;
    const int p = i % pairs;
    const long long base = page_offset(a, req, h, block, APPEND_ATTN_ERR_DEAD_ENTRY);
    if (base < 0) continue;  // recorded; never write through a -1 entry
    const long long dst = (base + (long long)row_in_block * D) / 2 + p;
    const float2 k = Num<T>::to_float2(row[(nh + h) * pairs + p]);
    const float c = cos_row[p];
    const float s = sin_row[p];
    k_cache[dst] = Num<T>::from_float2(k.x * c - k.y * s, k.y * c + k.x * s);
    v_cache[dst] = row[(nh + kvh + h) * pairs + p];
  }
}

// The codes of the token's kv_num_heads staged rows (head h's at rows + h * stride, its scale scales[h])
// into the page row `row_in_block` of block `block` of one lane, whose format is Code: a byte of two
// codes per thread step for int4, one code for the 8-bit formats. Every thread of the block takes part.
template <typename Code>
__device__ __forceinline__ void write_lane_codes(const Args& a, void* cache, const float* rows, int stride,
                                                 const float* scales, int req, int block, long long row_in_block) {
  const int D = a.head_dim;
  const int kvh = a.kv_num_heads;
  if constexpr (std::is_same<Code, Int4Pair>::value) {
    // A page row of D codes is D / 2 bytes: the byte offset of an element offset is its half.
    uint8_t* codes = static_cast<uint8_t*>(cache);
    const int pairs = D / 2;
    for (int i = threadIdx.x; i < kvh * pairs; i += blockDim.x) {
      const int h = i / pairs;
      const int p = i % pairs;
      const long long base = page_offset(a, req, h, block, APPEND_ATTN_ERR_DEAD_ENTRY);
      if (base < 0) continue;  // recorded; never write through a -1 entry
      const float* x = rows + h * stride + 2 * p;
      codes[(base + row_in_block * D) / 2 + p] =
          fd_kvq::int4_pack(fd_kvq::int4_code(x[0], scales[h]), fd_kvq::int4_code(x[1], scales[h]));
    }
  } else {
    Code* codes = static_cast<Code*>(cache);
    for (int i = threadIdx.x; i < kvh * D; i += blockDim.x) {
      const int h = i / D;
      const int d = i % D;
      const long long base = page_offset(a, req, h, block, APPEND_ATTN_ERR_DEAD_ENTRY);
      if (base < 0) continue;  // recorded; never write through a -1 entry
      codes[base + row_in_block * D + d] = fd_kvq::code_of<Code>(rows[h * stride + d], scales[h]);
    }
  }
}

// Quantized pages: one block per token. The token's rotated q and k rows and its v rows are staged
// in shared memory ([rows][D + 1] floats: one thread walks a row without bank conflicts); a thread
// per row applies the Hadamard rotation (int8, int4 keys) and takes the absmax of each K/V row, then
// every thread writes codes, each lane in its own format (int4: a byte of two codes each). Shared
// memory: quantized_smem_bytes(). Min 1 block per SM: left to its default ptxas spilled a few bytes
// (int8 on sm_90).
template <typename T, typename KeyCode, typename ValueCode>
__global__ void __launch_bounds__(kThreads, 1)
    rope_write_quantized_kernel(Args a, float q_scale, T* __restrict__ out) {
  const int token = blockIdx.x;
  const int D = a.head_dim;
  const int pairs = D / 2;
  const int nh = a.num_heads;
  const int kvh = a.kv_num_heads;
  const int stride = D + 1;
  float* rows_s = reinterpret_cast<float*>(dynamic_shared_memory);  // q rows, k rows, v rows, then 2 * kvh scales
  float* q_s = rows_s;
  float* k_s = q_s + nh * stride;
  float* v_s = k_s + kvh * stride;
  float* scale_s = v_s + kvh * stride;  // [kvh] K scales, then [kvh] V scales

  int req, pos;
  if (!locate_token(a, token, out, &req, &pos)) return;
  const T* row = static_cast<const T*>(a.qkv) + (long long)token * (nh + 2 * kvh) * D;
  const float* cos_row = a.rotary_cos + (long long)pos * pairs;
  const float* sin_row = a.rotary_sin + (long long)pos * pairs;
  for (int i = threadIdx.x; i < (nh + kvh) * pairs; i += blockDim.x) {
    const int r = i / pairs;
    const int p = i % pairs;
    const float x0 = Num<T>::to_float(row[r * D + 2 * p]);
    const float x1 = Num<T>::to_float(row[r * D + 2 * p + 1]);
    float* dst = (r < nh ? q_s + r * stride : k_s + (r - nh) * stride) + 2 * p;
    dst[0] = x0 * cos_row[p] - x1 * sin_row[p];
    dst[1] = x1 * cos_row[p] + x0 * sin_row[p];
  }
  for (int i = threadIdx.x; i < kvh * D; i += blockDim.x) {
    v_s[(i / D) * stride + i % D] = Num<T>::to_float(row[(nh + kvh) * D + i]);
  }
  __syncthreads();

  const fd_kvq::Format key_format = format_of_code<KeyCode>();
  const fd_kvq::Format value_format = format_of_code<ValueCode>();
  const bool rotate = fd_kvq::rotates_keys(key_format, D);  // the key lane's format decides (kv_quant.h)
  for (int r = threadIdx.x; r < nh + 2 * kvh; r += blockDim.x) {
    float* x = rows_s + r * stride;
    if (rotate && r < nh + kvh) fd_kvq::hadamard_in_place(x, D);
    if (r >= nh) {
      float absmax = 0.f;
      for (int i = 0; i < D; ++i) absmax = fmaxf(absmax, fabsf(x[i]));
      scale_s[r - nh] = fd_kvq::scale_for(absmax, r < nh + kvh ? key_format : value_format);
    }
  }
  __syncthreads();

  // q . k is unchanged when both are rotated: H q / D pairs with H k (the 1 / D is exact).
  const float q_mul = rotate ? q_scale / static_cast<float>(D) : q_scale;
  for (int i = threadIdx.x; i < nh * D; i += blockDim.x) {
    a.q_rot[(long long)token * nh * D + i] = q_s[(i / D) * stride + i % D] * q_mul;
  }
  const int block = pos / a.block_size;
  const long long row_in_block = pos % a.block_size;
  write_lane_codes<KeyCode>(a, a.key_cache, k_s, stride, scale_s, req, block, row_in_block);
  write_lane_codes<ValueCode>(a, a.value_cache, v_s, stride, scale_s + kvh, req, block, row_in_block);
  for (int h = threadIdx.x; h < kvh; h += blockDim.x) {
    const long long base = page_offset(a, req, h, block, APPEND_ATTN_ERR_DEAD_ENTRY);
    if (base < 0) continue;
    a.key_scales[base / D + row_in_block] = scale_s[h];
    a.value_scales[base / D + row_in_block] = scale_s[kvh + h];
  }
}

template <typename T>
cudaError_t launch_typed(const Args& a, void* out, cudaStream_t stream) {
  const float q_scale = 1.0f / sqrtf(static_cast<float>(a.head_dim));
  CUDA_LAUNCH(a.token_num, kThreads, 0, stream, rope_write_cache_kernel<T>)(a, q_scale, static_cast<T*>(out));
  return cudaGetLastError();
}

template <typename KeyCode, typename ValueCode>
cudaError_t launch_quantized(const Args& a, void* out, cudaStream_t stream) {
  const float q_scale = 1.0f / sqrtf(static_cast<float>(a.head_dim));
  const size_t smem = quantized_rope_write_smem_bytes(a.num_heads, a.kv_num_heads, a.head_dim);
  auto kernel = rope_write_quantized_kernel<__nv_bfloat16, KeyCode, ValueCode>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return err;
  CUDA_LAUNCH(a.token_num, kThreads, smem, stream, rope_write_quantized_kernel<__nv_bfloat16, KeyCode, ValueCode>)(
      a, q_scale, static_cast<__nv_bfloat16*>(out));
  return cudaGetLastError();
}

}  // namespace

size_t quantized_rope_write_smem_bytes(int num_heads, int kv_num_heads, int head_dim) {
  return sizeof(float) * ((size_t)(num_heads + 2 * kv_num_heads) * (head_dim + 1) + 2 * kv_num_heads);
}

cudaError_t launch_rope_write_cache(const Args& a, int dtype, void* out, cudaStream_t stream) {
  if (a.token_num == 0) return cudaSuccess;
  // Quantized pages come with bf16 compute only (the launcher checks it).
  if (a.cache_quant == APPEND_ATTN_CACHE_INT8) return launch_quantized<int8_t, int8_t>(a, out, stream);
  if (a.cache_quant == APPEND_ATTN_CACHE_FP8_E4M3) return launch_quantized<fd_kvq::e4m3, fd_kvq::e4m3>(a, out, stream);
  if (a.cache_quant == APPEND_ATTN_CACHE_INT4) return launch_quantized<Int4Pair, Int4Pair>(a, out, stream);
  if (a.cache_quant == APPEND_ATTN_CACHE_K8V4) return launch_quantized<int8_t, Int4Pair>(a, out, stream);
  return dtype == APPEND_ATTN_BF16 ? launch_typed<__nv_bfloat16>(a, out, stream)
                                   : launch_typed<__half>(a, out, stream);
}

}  // namespace append_attn
