// Step (c): decode attention (requests with exactly one new token), split-KV plus a merge.
//
// Thread block = (split, request, KV head): the G q heads of the group share every K/V page the
// block reads. A query's live blocks (LiveBlocks: for a SWA head only its sink and window pages)
// are cut into splits of decode_pages_per_split blocks; each split writes an unnormalized partial
// (max, sum, acc) and the merge kernel combines them with the usual log-sum-exp rescaling.
//
// Partial layout in the workspace, for split s, request r, q head qh:
//   acc  at partial[((s * bsz + r) * num_heads + qh) * head_dim + d]
//   m, l at partial[acc_floats + ((s * bsz + r) * num_heads + qh) * 2 + {0, 1}]
// with acc_floats = decode_max_splits * bsz * num_heads * head_dim.
//
// Each lane is read through its codec, PK for keys and PV for values (append_attn_common.cuh; they
// differ only for k8v4 pages): T pages as they are, or 8-bit codes (half the bytes of a bf16 page)
// or 4-bit codes (a quarter) dequantized with their row's scale where they are used; k_s holds the
// page's stored key units, kPerUnit elements each.
#include "append_attn_common.cuh"

namespace append_attn {
namespace {

constexpr int kThreads = 128;

// Min 1 block per SM: lets ptxas take the registers it needs; left to its default it spilled
// (head_dim 128, block 16 on sm_90: benchmarks/kernel_resources.py).
template <typename T, typename PK, typename PV, int D, int BS>
__global__ void __launch_bounds__(kThreads, 1) decode_attention_kernel(Args a, int swa_override) {
  using KElem = typename PK::Elem;
  using VElem = typename PV::Elem;
  constexpr bool kQuantized = LanePair<PK, PV>::kQuantized;
  constexpr int kVec = 16 / sizeof(KElem);        // stored key units per 16-byte load
  constexpr int kRowUnits = D / PK::kPerUnit;     // stored key units per page row
  constexpr int kKStride = kRowUnits + kVec;      // 16-byte rows, staggered banks
  constexpr int kThreadsPerKey = kThreads / BS;   // q.k: threads sharing one key
  constexpr int kDimsPerThread = D / kThreadsPerKey;
  constexpr int kKeyGroups = kThreads / (D / 2);  // p.v: thread owns a dim pair, keys strided
  constexpr int kKeysPerThread = BS / kKeyGroups;
  static_assert(kThreads % BS == 0 && kDimsPerThread % 8 == 0, "q.k mapping");
  static_assert(kThreads % (D / 2) == 0 && BS % kKeyGroups == 0, "p.v mapping");
  static_assert(kRowUnits % kVec == 0, "a page row is whole 16-byte loads");

  const int split = blockIdx.x;
  const int req = blockIdx.y;
  const int head = blockIdx.z;
  if (a.seq_lens_this_time[req] != 1) return;

  const int group = a.num_heads / a.kv_num_heads;
  const int pos = a.seq_lens_decoder[req];
  const long long token = a.cu_seqlens_q[req];
  const HeadWindow hw = head_window(a, head, swa_override);  // this KV head's own window and sink
  const bool swa = hw.swa;
  const int window = hw.window;
  const int sink = hw.sink;
  const LiveBlocks live = live_blocks(pos, pos, swa, a.visit_all_pages != 0, window, sink, BS);
  const int n_splits = decode_num_splits(a, live.count);
  if (split >= n_splits) return;
  const int it_begin = split * a.decode_pages_per_split;
  const int it_end = min(live.count, it_begin + a.decode_pages_per_split);
  const int dead_code =
      a.visit_all_pages ? APPEND_ATTN_ERR_DEAD_ENTRY_MASKED : APPEND_ATTN_ERR_DEAD_ENTRY;

  // k_s is dead after the page loop (its last barrier) and red_s only lives after it, so they
  // share bytes: at head_dim 256 the two together would pass the 48 KB of static shared memory.
  constexpr size_t kKBytes = sizeof(KElem) * BS * kKStride;
  constexpr size_t kRedBytes = sizeof(float) * kKeyGroups * kMaxGroup * D;
  __shared__ __align__(16) float q_s[kMaxGroup][D];
  __shared__ __align__(16) unsigned char k_red_s[kKBytes > kRedBytes ? kKBytes : kRedBytes];
  __shared__ float k_scale_s[BS], v_scale_s[BS];  // quantized pages: the rows' scales
  __shared__ float p_s[kMaxGroup][BS];
  __shared__ float row_m[kMaxGroup], row_l[kMaxGroup], row_scale[kMaxGroup];
  __shared__ long long page_base_s;
  auto k_s = reinterpret_cast<KElem (*)[kKStride]>(k_red_s);
  auto red_s = reinterpret_cast<float (*)[kMaxGroup][D]>(k_red_s);

  const int tid = threadIdx.x;
  for (int i = tid; i < kMaxGroup * D; i += kThreads) {
    const int g = i / D;
    const int d = i % D;
    q_s[g][d] = g < group ? a.q_rot[(token * a.num_heads + head * group + g) * D + d] : 0.f;
  }
  if (tid < kMaxGroup) {
    row_m[tid] = -INFINITY;
    row_l[tid] = 0.f;
  }

  const int qk_key = tid / kThreadsPerKey;
  const int qk_part = tid % kThreadsPerKey;
  const int pv_pair = tid % (D / 2);
  const int pv_group = tid / (D / 2);
  float acc[kMaxGroup][2];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) acc[g][0] = acc[g][1] = 0.f;

  const KElem* k_cache = static_cast<const KElem*>(a.key_cache);
  const VElem* v_cache = static_cast<const VElem*>(a.value_cache);
  for (int it = it_begin; it < it_end; ++it) {
    const int blk = live.nth(it);
    if (tid == 0) page_base_s = page_offset(a, req, head, blk, dead_code);
    __syncthreads();
    const long long base = page_base_s;
    // Rows past the query's position are not written yet and may hold anything (even NaN).
    const int n_valid = base < 0 ? 0 : min(BS, pos - blk * BS + 1);

    // V of this thread's keys is fetched first so its latency overlaps the q.k pass (their scales
    // go to shared memory: kKeysPerThread registers fewer, 64 at head_dim 256 with block 64).
    uint32_t v_reg[kKeysPerThread];
#pragma unroll
    for (int i = 0; i < kKeysPerThread; ++i) {
      const int key = pv_group + i * kKeyGroups;
      v_reg[i] = key < n_valid ? PV::pair_bits(unit_at<PV>(v_cache, base + (long long)key * D + 2 * pv_pair)) : 0u;
    }
    for (int i = tid; i < BS * (kRowUnits / kVec); i += kThreads) {
      const int key = i / (kRowUnits / kVec);
      const int col = i % (kRowUnits / kVec);
      uint4 kv = make_uint4(0, 0, 0, 0);
      if (key < n_valid) kv = reinterpret_cast<const uint4*>(unit_at<PK>(k_cache, base + (long long)key * D))[col];
      *reinterpret_cast<uint4*>(&k_s[key][col * kVec]) = kv;
    }
    if (kQuantized && tid < BS) {
      k_scale_s[tid] = tid < n_valid ? a.key_scales[base / D + tid] : 0.f;
      v_scale_s[tid] = tid < n_valid ? a.value_scales[base / D + tid] : 0.f;
    }
    __syncthreads();

    {
      float dot[kMaxGroup];
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) dot[g] = 0.f;
      const int d0 = qk_part * kDimsPerThread;
      const float k_scale = kQuantized ? k_scale_s[qk_key] : 1.f;
#pragma unroll 2
      for (int d = 0; d < kDimsPerThread; d += 8) {
        float kf[8];
        PK::eight(unit_at<PK>(k_s[qk_key], d0 + d), k_scale, kf);
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g < group) {
            const float4 qa = *reinterpret_cast<const float4*>(&q_s[g][d0 + d]);
            const float4 qb = *reinterpret_cast<const float4*>(&q_s[g][d0 + d + 4]);
            dot[g] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4] +
                      qb.y * kf[5] + qb.z * kf[6] + qb.w * kf[7];
          }
        }
      }
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
        for (int off = kThreadsPerKey / 2; off > 0; off >>= 1) {
          dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], off);
        }
      }
      if (qk_part == 0) {
        const bool visible =
            qk_key < n_valid && key_visible(pos, blk * BS + qk_key, swa, window, sink);
#pragma unroll
        for (int g = 0; g < kMaxGroup; ++g) {
          if (g < group) p_s[g][qk_key] = visible ? soft_cap(dot[g], a.softcap) : -INFINITY;
        }
      }
    }
    __syncthreads();

    {  // online softmax, one warp per row
      const int warp = tid / 32;
      const int lane = tid % 32;
      for (int g = warp; g < group; g += kThreads / 32) {
        float mx = -INFINITY;
        for (int k = lane; k < BS; k += 32) mx = fmaxf(mx, p_s[g][k]);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float m_old = row_m[g];
        const float m_new = fmaxf(m_old, mx);
        float sum = 0.f;
        for (int k = lane; k < BS; k += 32) {
          const float s = p_s[g][k];
          const float p = s == -INFINITY ? 0.f : __expf(s - m_new);
          p_s[g][k] = p;
          sum += p;
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        __syncwarp();
        if (lane == 0) {
          const float scale = m_old == -INFINITY ? 0.f : __expf(m_old - m_new);
          row_l[g] = row_l[g] * scale + sum;
          row_m[g] = m_new;
          row_scale[g] = scale;
        }
      }
    }
    __syncthreads();

#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g < group) {
        acc[g][0] *= row_scale[g];
        acc[g][1] *= row_scale[g];
      }
    }
#pragma unroll
    for (int i = 0; i < kKeysPerThread; ++i) {
      const int key = pv_group + i * kKeyGroups;
      const float2 v = PV::pair(v_reg[i], kQuantized ? v_scale_s[key] : 0.f);
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        if (g < group) {
          const float p = p_s[g][key];
          acc[g][0] += p * v.x;
          acc[g][1] += p * v.y;
        }
      }
    }
    __syncthreads();  // the next page overwrites k_s, the scales, p_s, row_scale and page_base_s
  }

#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    red_s[pv_group][g][2 * pv_pair] = acc[g][0];
    red_s[pv_group][g][2 * pv_pair + 1] = acc[g][1];
  }
  __syncthreads();
  const long long slot0 = ((long long)split * a.bsz + req) * a.num_heads + head * group;
  float* acc_out = a.partial + slot0 * D;
  for (int i = tid; i < group * D; i += kThreads) {
    const int g = i / D;
    const int d = i % D;
    float sum = 0.f;
#pragma unroll
    for (int kg = 0; kg < kKeyGroups; ++kg) sum += red_s[kg][g][d];
    acc_out[i] = sum;
  }
  if (tid < group) {
    const long long acc_floats =
        (long long)a.decode_max_splits * a.bsz * a.num_heads * a.head_dim;
    float* ml = a.partial + acc_floats + (slot0 + tid) * 2;
    ml[0] = row_m[tid];
    ml[1] = row_l[tid];
  }
}

// One block per (request, q head), one thread per dim (head_dim <= 256 threads).
template <typename T>
__global__ void __launch_bounds__(256) decode_merge_kernel(Args a, int swa_override, T* __restrict__ out) {
  const int req = blockIdx.x;
  const int qh = blockIdx.y;
  if (a.seq_lens_this_time[req] != 1) return;
  const int D = a.head_dim;
  const int head = qh / (a.num_heads / a.kv_num_heads);
  const int pos = a.seq_lens_decoder[req];
  const HeadWindow hw = head_window(a, head, swa_override);  // the split count follows from it
  const LiveBlocks live = live_blocks(pos, pos, hw.swa, a.visit_all_pages != 0, hw.window, hw.sink,
                                      a.block_size);
  const int n_splits = decode_num_splits(a, live.count);
  const long long acc_floats = (long long)a.decode_max_splits * a.bsz * a.num_heads * D;
  const long long split_stride = (long long)a.bsz * a.num_heads;
  const long long slot0 = (long long)req * a.num_heads + qh;

  float m_max = -INFINITY;
  for (int s = 0; s < n_splits; ++s) {
    m_max = fmaxf(m_max, a.partial[acc_floats + (slot0 + s * split_stride) * 2]);
  }
  float l_sum = 0.f;
  float o = 0.f;
  const int d = threadIdx.x;
  for (int s = 0; s < n_splits; ++s) {
    const long long slot = slot0 + s * split_stride;
    const float m_s = a.partial[acc_floats + slot * 2];
    if (m_s == -INFINITY) continue;  // the split saw no visible key (only on recorded errors)
    const float w = __expf(m_s - m_max);
    l_sum += a.partial[acc_floats + slot * 2 + 1] * w;
    if (d < D) o += a.partial[slot * D + d] * w;
  }
  if (d < D) {
    const long long token = a.cu_seqlens_q[req];
    const float denom = softmax_denominator(a.sinks, qh, l_sum, m_max);
    out[(token * a.num_heads + qh) * D + d] = Num<T>::from_float(l_sum > 0.f ? o / denom : 0.f);
  }
}

template <typename T, typename PK, typename PV, int D, int BS>
cudaError_t launch_kernel(const Args& a, int swa_override, cudaStream_t stream) {
  dim3 grid(a.decode_max_splits, a.bsz, a.kv_num_heads);
  CUDA_LAUNCH(grid, kThreads, 0, stream, decode_attention_kernel<T, PK, PV, D, BS>)(a, swa_override);
  return cudaGetLastError();
}

template <typename T, typename PK, typename PV>
cudaError_t launch_shapes(const Args& a, int swa_override, cudaStream_t stream) {
  if (a.head_dim == 64) {
    return a.block_size == 64 ? launch_kernel<T, PK, PV, 64, 64>(a, swa_override, stream)
                              : launch_kernel<T, PK, PV, 64, 16>(a, swa_override, stream);
  }
  if (a.head_dim == 256) {  // Gemma 3
    return a.block_size == 64 ? launch_kernel<T, PK, PV, 256, 64>(a, swa_override, stream)
                              : launch_kernel<T, PK, PV, 256, 16>(a, swa_override, stream);
  }
  return a.block_size == 64 ? launch_kernel<T, PK, PV, 128, 64>(a, swa_override, stream)
                            : launch_kernel<T, PK, PV, 128, 16>(a, swa_override, stream);
}

template <typename T>
cudaError_t launch_typed(const Args& a, int swa_override, void* out, cudaStream_t stream) {
  cudaError_t err;
  // Quantized pages come with bf16 compute only (the launcher checks it): half the kernels to build.
  if (a.cache_quant == APPEND_ATTN_CACHE_INT8) {
    err = launch_shapes<__nv_bfloat16, Int8Pages, Int8Pages>(a, swa_override, stream);
  } else if (a.cache_quant == APPEND_ATTN_CACHE_FP8_E4M3) {
    err = launch_shapes<__nv_bfloat16, E4M3Pages, E4M3Pages>(a, swa_override, stream);
  } else if (a.cache_quant == APPEND_ATTN_CACHE_INT4) {
    err = launch_shapes<__nv_bfloat16, NibblePages, NibblePages>(a, swa_override, stream);
  } else if (a.cache_quant == APPEND_ATTN_CACHE_K8V4) {
    err = launch_shapes<__nv_bfloat16, Int8Pages, NibblePages>(a, swa_override, stream);
  } else {
    err = launch_shapes<T, FloatPages<T>, FloatPages<T>>(a, swa_override, stream);
  }
  if (err != cudaSuccess) return err;
  dim3 grid(a.bsz, a.num_heads);
  CUDA_LAUNCH(grid, a.head_dim, 0, stream, decode_merge_kernel<T>)(a, swa_override, static_cast<T*>(out));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_decode_attention(const Args& a, int dtype, int swa_override, void* out,
                                    cudaStream_t stream) {
  if (a.token_num == 0) return cudaSuccess;
  return dtype == APPEND_ATTN_BF16 ? launch_typed<__nv_bfloat16>(a, swa_override, out, stream)
                                   : launch_typed<__half>(a, swa_override, out, stream);
}

}  // namespace append_attn
