// Step (a): RoPE on the new q and k (interleaved pairs), new K/V written into the paged cache.
// Rotated q goes to a float workspace, pre-scaled by 1/sqrt(head_dim), so the attention kernels
// read it once per tile without re-rotating and keep fp32 precision (the CPU op's math).
#include "append_attn_common.cuh"

namespace append_attn {
namespace {

constexpr int kThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    rope_write_cache_kernel(Args a, float q_scale, T* __restrict__ out) {
  using T2 = typename Num<T>::T2;
  const int token = blockIdx.x;
  const int D = a.head_dim;
  const int pairs = D / 2;
  const int nh = a.num_heads;
  const int kvh = a.kv_num_heads;

  const int req = find_request(a.cu_seqlens_q, a.bsz, token);
  const int local = req < 0 ? 0 : token - a.cu_seqlens_q[req];
  if (req < 0 || local >= a.seq_lens_this_time[req]) {
    // A row no request owns gets zeros: every output element is written.
    T2* row_out = reinterpret_cast<T2*>(out + (long long)token * nh * D);
    for (int i = threadIdx.x; i < nh * pairs; i += blockDim.x) {
      row_out[i] = Num<T>::from_float2(0.f, 0.f);
    }
    return;
  }
  const int pos = a.seq_lens_decoder[req] + local;
  if (pos < 0 || pos >= a.max_position) {
    if (threadIdx.x == 0) record_error(a.error_info, APPEND_ATTN_ERR_POSITION, req, -1, pos);
    return;
  }

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

template <typename T>
cudaError_t launch_typed(const Args& a, void* out, cudaStream_t stream) {
  const float q_scale = 1.0f / sqrtf(static_cast<float>(a.head_dim));
  rope_write_cache_kernel<T><<<a.token_num, kThreads, 0, stream>>>(a, q_scale, static_cast<T*>(out));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_rope_write_cache(const Args& a, int dtype, void* out, cudaStream_t stream) {
  if (a.token_num == 0) return cudaSuccess;
  return dtype == APPEND_ATTN_BF16 ? launch_typed<__nv_bfloat16>(a, out, stream)
                                   : launch_typed<__half>(a, out, stream);
}

}  // namespace append_attn
