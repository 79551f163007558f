// Step (b): prefill / chunked-prefill attention (requests with more than one new token).
//
// One thread block = one tile of up to 64 / G consecutive new tokens of one request times the G q
// heads of one KV head (64 rows), so each K/V page read from memory serves every row of the tile.
// The block walks only the tile's live blocks (see LiveBlocks) in chunks of 64 keys, with an
// online softmax in fp32; K, V and the scores live in shared memory, fp32 CUDA-core math. Each lane
// is read through its codec, PK for keys and PV for values (append_attn_common.cuh; they differ only
// for k8v4 pages): quantized pages stay 8-bit (or 4-bit) in shared memory with their rows' scales
// next to them, dequantized where they are used.
#include "append_attn_common.cuh"

namespace append_attn {
namespace {

constexpr int kThreads = 256;
constexpr int kChunkKeys = 64;

// Exclusive prefix over requests of the number of prefill tiles, so each thread block finds its
// (request, tile) by binary search instead of a host round trip. Its one block, launched every step
// before the attention kernels, also checks the per-head windows (check_head_windows).
__global__ void __launch_bounds__(1024) prefill_tile_prefix_kernel(Args a, int tokens_per_tile) {
  const int* __restrict__ this_time = a.seq_lens_this_time;
  const int bsz = a.bsz;
  int* __restrict__ prefix = a.tile_prefix;
  check_head_windows(a);
  __shared__ int buf[1024];
  int carry = 0;
  for (int base = 0; base < bsz; base += 1024) {
    const int r = base + threadIdx.x;
    const int n = r < bsz ? this_time[r] : 0;
    const int tiles = n > 1 ? (n + tokens_per_tile - 1) / tokens_per_tile : 0;
    buf[threadIdx.x] = tiles;
    __syncthreads();
    for (int off = 1; off < 1024; off <<= 1) {  // Hillis-Steele inclusive scan
      const int add = threadIdx.x >= off ? buf[threadIdx.x - off] : 0;
      __syncthreads();
      buf[threadIdx.x] += add;
      __syncthreads();
    }
    if (r < bsz) prefix[r] = carry + buf[threadIdx.x] - tiles;
    carry += buf[1023];
    __syncthreads();
  }
  if (threadIdx.x == 0) prefix[bsz] = carry;
}

__host__ __device__ constexpr size_t align16(size_t x) { return (x + 15) / 16 * 16; }

// Shared memory layout (bytes). Row strides are padded so the threads of a warp that read
// different rows of the same column hit different banks. K and V rows hold their lane's stored units
// (kPerUnit elements each: 2 for int4 lanes).
template <typename PK, typename PV, int D>
struct PrefillSmem {
  using KElem = typename PK::Elem;
  using VElem = typename PV::Elem;
  static constexpr int kKRowUnits = D / PK::kPerUnit;
  static constexpr int kVRowUnits = D / PV::kPerUnit;
  static constexpr int kQStride = D + 2;  // floats
  static constexpr int kKStride = kKRowUnits + 4 / sizeof(KElem);  // units: an odd number of 32-bit words
  static constexpr int kPStride = kChunkKeys + 1;
  static constexpr size_t kQ = 0;
  static constexpr size_t kP = align16(kQ + sizeof(float) * kPrefillRows * kQStride);
  static constexpr size_t kK = align16(kP + sizeof(float) * kPrefillRows * kPStride);
  static constexpr size_t kV = align16(kK + sizeof(KElem) * kChunkKeys * kKStride);
  static constexpr size_t kKeyPos = align16(kV + sizeof(VElem) * kChunkKeys * kVRowUnits);
  static constexpr size_t kPageBase = align16(kKeyPos + sizeof(int) * kChunkKeys);
  static constexpr size_t kPageBlock = align16(kPageBase + sizeof(long long) * kChunkKeys);
  static constexpr size_t kKScale = align16(kPageBlock + sizeof(int) * kChunkKeys);
  static constexpr size_t kVScale = align16(kKScale + sizeof(float) * kChunkKeys);
  static constexpr size_t kBytes = align16(kVScale + sizeof(float) * kChunkKeys);
};

// The 32-bit words holding 8 consecutive elements of P's pages: 4 (16-bit elements), 2 (bytes) or 1
// (int4 codes).
template <typename P>
__host__ __device__ constexpr int words_of_eight() {
  return int(8 * sizeof(typename P::Elem) / P::kPerUnit / 4);
}

// The 8 elements of a cache of P's pages at element offset `off` (a multiple of 8) as words: one 16-,
// 8- or 4-byte load, or zeros where the key must not be read (not written yet, or a skipped entry).
template <typename P>
__device__ __forceinline__ void load_eight(const typename P::Elem* cache, long long off, bool valid, uint32_t* w) {
  constexpr int n = words_of_eight<P>();
  if constexpr (n == 4) {
    const uint4 x = valid ? *reinterpret_cast<const uint4*>(unit_at<P>(cache, off)) : make_uint4(0, 0, 0, 0);
    w[0] = x.x;
    w[1] = x.y;
    w[2] = x.z;
    w[3] = x.w;
  } else if constexpr (n == 2) {
    const uint2 x = valid ? *reinterpret_cast<const uint2*>(unit_at<P>(cache, off)) : make_uint2(0, 0);
    w[0] = x.x;
    w[1] = x.y;
  } else {
    w[0] = valid ? *reinterpret_cast<const uint32_t*>(unit_at<P>(cache, off)) : 0u;
  }
}

// Stores them as one 16-, 8- or 4-byte store (dst aligned to its size: a V row of the staged copy).
template <typename P>
__device__ __forceinline__ void store_eight(void* dst, const uint32_t* w) {
  constexpr int n = words_of_eight<P>();
  if constexpr (n == 4) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  } else if constexpr (n == 2) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = w[0];
  }
}

// At head_dim 256 shared memory allows one block per SM anyway: min 1 block lets ptxas take the
// registers it needs (left to its default it spilled with e4m3 pages on sm_80); 0 = ptxas's default.
template <typename T, typename PK, typename PV, int D, int BS>
__global__ void __launch_bounds__(kThreads, D == 256 ? 1 : 0)
    prefill_attention_kernel(Args a, int swa_override, T* __restrict__ out) {
  using T2 = typename Num<T>::T2;
  using KElem = typename PK::Elem;
  using VElem = typename PV::Elem;
  using L = PrefillSmem<PK, PV, D>;
  constexpr bool kQuantized = LanePair<PK, PV>::kQuantized;
  constexpr int kPagesPerChunk = kChunkKeys / BS;
  constexpr int kDimPairsPerThread = D / 16;  // a thread owns dims 16 * j + 2 * tk + {0, 1}

  const int tile = blockIdx.x;
  const int head = blockIdx.y;
  if (tile >= a.tile_prefix[a.bsz]) return;

  unsigned char* smem = dynamic_shared_memory;
  float* q_s = reinterpret_cast<float*>(smem + L::kQ);
  float* p_s = reinterpret_cast<float*>(smem + L::kP);
  KElem* k_s = reinterpret_cast<KElem*>(smem + L::kK);
  VElem* v_s = reinterpret_cast<VElem*>(smem + L::kV);
  int* key_pos_s = reinterpret_cast<int*>(smem + L::kKeyPos);
  long long* page_base_s = reinterpret_cast<long long*>(smem + L::kPageBase);
  int* page_block_s = reinterpret_cast<int*>(smem + L::kPageBlock);
  float* k_scale_s = reinterpret_cast<float*>(smem + L::kKScale);
  float* v_scale_s = reinterpret_cast<float*>(smem + L::kVScale);

  // Which request and token range this tile covers. Later tiles see more keys, so a request's
  // tiles run last-first to start the longest blocks early.
  int req = 0;
  {
    int hi = a.bsz;  // tile_prefix[req] <= tile < tile_prefix[hi]
    while (hi - req > 1) {
      const int mid = (req + hi) / 2;
      if (a.tile_prefix[mid] <= tile) {
        req = mid;
      } else {
        hi = mid;
      }
    }
  }
  const int group = a.num_heads / a.kv_num_heads;
  const int tokens_per_tile = kPrefillRows / group;
  const int n_new = a.seq_lens_this_time[req];
  const int tiles_of_req = a.tile_prefix[req + 1] - a.tile_prefix[req];
  const int local_tile = tiles_of_req - 1 - (tile - a.tile_prefix[req]);
  const int tok0 = local_tile * tokens_per_tile;
  const int n_tok = min(tokens_per_tile, n_new - tok0);
  const int n_rows = n_tok * group;
  const int pos0 = a.seq_lens_decoder[req] + tok0;
  const int pos_last = pos0 + n_tok - 1;
  const long long row0 = a.cu_seqlens_q[req] + tok0;  // qkv / out row of the tile's first token

  const HeadWindow hw = head_window(a, head, swa_override);  // this KV head's own window and sink
  const bool swa = hw.swa;
  const int window = hw.window;
  const int sink = hw.sink;
  const LiveBlocks live =
      live_blocks(pos0, pos_last, swa, a.visit_all_pages != 0, window, sink, BS);
  const int dead_code =
      a.visit_all_pages ? APPEND_ATTN_ERR_DEAD_ENTRY_MASKED : APPEND_ATTN_ERR_DEAD_ENTRY;

  const int tid = threadIdx.x;
  // The scores are masked with the head's (swa, window, sink) read back from shared memory after each
  // chunk's barriers, as the call's window and sink once were from the kernel's parameters: held in
  // registers across the chunk loop they cost up to 44 more a thread (benchmarks/kernel_resources.py).
  __shared__ int head_window_s[3];
  if (tid == 0) {
    head_window_s[0] = swa;
    head_window_s[1] = window;
    head_window_s[2] = sink;
  }
  for (int i = tid; i < kPrefillRows * (D / 2); i += kThreads) {
    const int row = i / (D / 2);
    const int pair = i % (D / 2);
    float2 v = make_float2(0.f, 0.f);
    if (row < n_rows) {
      const long long q_row = (row0 + row / group) * a.num_heads + head * group + row % group;
      v = reinterpret_cast<const float2*>(a.q_rot + q_row * D)[pair];
    }
    *reinterpret_cast<float2*>(q_s + row * L::kQStride + 2 * pair) = v;
  }

  // Thread (tr, tk) owns rows tr and tr + 32; for scores keys tk + 8 j, for the output the dims
  // above. The 8 threads sharing a row are adjacent lanes, so row reductions are 3 shuffles.
  const int tr = tid / 8;
  const int tk = tid % 8;
  int q_pos[2];
  float m[2], l[2];
  float acc[2][2 * kDimPairsPerThread];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = tr + 32 * i;
    q_pos[i] = row < n_rows ? pos0 + row / group : -1;  // -1: padding row, sees nothing
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int j = 0; j < 2 * kDimPairsPerThread; ++j) acc[i][j] = 0.f;
  }

  const KElem* k_cache = static_cast<const KElem*>(a.key_cache);
  const VElem* v_cache = static_cast<const VElem*>(a.value_cache);
  const int n_chunks = (live.count + kPagesPerChunk - 1) / kPagesPerChunk;
  for (int c = 0; c < n_chunks; ++c) {
    if (tid < kPagesPerChunk) {
      const int idx = c * kPagesPerChunk + tid;
      long long base = -1;
      int blk = -1;
      if (idx < live.count) {
        blk = live.nth(idx);
        base = page_offset(a, req, head, blk, dead_code);
      }
      page_base_s[tid] = base;
      page_block_s[tid] = blk;
    }
    __syncthreads();

    // Keys past the tile's last position are not written yet (and may hold anything, even NaN),
    // as are keys of skipped entries: load zeros and mark them invisible.
    for (int i = tid; i < kChunkKeys * (D / 8); i += kThreads) {
      const int key = i / (D / 8);
      const int col8 = i % (D / 8);
      const int pg = key / BS;
      const long long base = page_base_s[pg];
      const int kpos = page_block_s[pg] * BS + key % BS;
      const bool valid = base >= 0 && kpos <= pos_last;
      const long long off = base + (long long)(key % BS) * D + col8 * 8;  // elements
      // 8 elements of each lane: 16 bytes (16-bit pages), 8 (one-byte codes) or 4 (int4 codes). A K row's
      // stride is an odd number of words, so K is stored word by word; V rows are aligned.
      uint32_t kw[words_of_eight<PK>()];
      uint32_t vw[words_of_eight<PV>()];
      load_eight<PK>(k_cache, off, valid, kw);
      load_eight<PV>(v_cache, off, valid, vw);
      uint32_t* kd = reinterpret_cast<uint32_t*>(k_s + key * L::kKStride + col8 * 8 / PK::kPerUnit);
#pragma unroll
      for (int w = 0; w < words_of_eight<PK>(); ++w) kd[w] = kw[w];
      store_eight<PV>(v_s + key * L::kVRowUnits + col8 * 8 / PV::kPerUnit, vw);
    }
    if (tid < kChunkKeys) {
      const int pg = tid / BS;
      const int kpos = page_block_s[pg] * BS + tid % BS;
      const bool valid = page_base_s[pg] >= 0 && kpos <= pos_last;
      key_pos_s[tid] = valid ? kpos : -1;
      if (kQuantized) {
        const long long row = page_base_s[pg] / D + tid % BS;  // the row's scale index
        k_scale_s[tid] = valid ? a.key_scales[row] : 0.f;
        v_scale_s[tid] = valid ? a.value_scales[row] : 0.f;
      }
    }
    __syncthreads();

    float s[2][8];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) s[i][j] = 0.f;
#pragma unroll 4
    for (int d = 0; d < D; d += 2) {
      const float2 q0 = *reinterpret_cast<const float2*>(q_s + tr * L::kQStride + d);
      const float2 q1 = *reinterpret_cast<const float2*>(q_s + (tr + 32) * L::kQStride + d);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int key = tk + 8 * j;
        const float2 kf =
            PK::pair(PK::pair_bits(unit_at<PK>(k_s + key * L::kKStride, d)), kQuantized ? k_scale_s[key] : 1.f);
        s[0][j] += q0.x * kf.x + q0.y * kf.y;
        s[1][j] += q1.x * kf.x + q1.y * kf.y;
      }
    }

#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float chunk_max = -INFINITY;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        s[i][j] = soft_cap(s[i][j], a.softcap);
        if (!key_visible(q_pos[i], key_pos_s[tk + 8 * j], head_window_s[0] != 0, head_window_s[1],
                         head_window_s[2])) {
          s[i][j] = -INFINITY;
        }
        chunk_max = fmaxf(chunk_max, s[i][j]);
      }
#pragma unroll
      for (int off = 1; off < 8; off <<= 1) {
        chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, off));
      }
      const float m_new = fmaxf(m[i], chunk_max);
      // With nothing visible so far m is -inf and acc is 0: scale 0 avoids inf - inf.
      const float scale = m[i] == -INFINITY ? 0.f : __expf(m[i] - m_new);
      float p_sum = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float p = s[i][j] == -INFINITY ? 0.f : __expf(s[i][j] - m_new);
        p_s[(tr + 32 * i) * L::kPStride + tk + 8 * j] = p;
        p_sum += p;
      }
#pragma unroll
      for (int off = 1; off < 8; off <<= 1) {
        p_sum += __shfl_xor_sync(0xffffffffu, p_sum, off);
      }
      l[i] = l[i] * scale + p_sum;
      m[i] = m_new;
#pragma unroll
      for (int j = 0; j < 2 * kDimPairsPerThread; ++j) acc[i][j] *= scale;
    }
    __syncthreads();

#pragma unroll 4
    for (int key = 0; key < kChunkKeys; ++key) {
      const float p0 = p_s[tr * L::kPStride + key];
      const float p1 = p_s[(tr + 32) * L::kPStride + key];
      const float v_scale = kQuantized ? v_scale_s[key] : 1.f;
#pragma unroll
      for (int j = 0; j < kDimPairsPerThread; ++j) {
        const float2 v = PV::pair(PV::pair_bits(unit_at<PV>(v_s + key * L::kVRowUnits, 16 * j + 2 * tk)), v_scale);
        acc[0][2 * j] += p0 * v.x;
        acc[0][2 * j + 1] += p0 * v.y;
        acc[1][2 * j] += p1 * v.x;
        acc[1][2 * j + 1] += p1 * v.y;
      }
    }
    __syncthreads();  // the next chunk overwrites k_s, v_s, p_s and the page slots
  }

#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = tr + 32 * i;
    if (row >= n_rows) continue;
    const int qh = head * group + row % group;
    const float inv = l[i] > 0.f ? 1.f / softmax_denominator(a.sinks, qh, l[i], m[i]) : 0.f;
    const long long o_row = (row0 + row / group) * a.num_heads + qh;
    T* o = out + o_row * D;
#pragma unroll
    for (int j = 0; j < kDimPairsPerThread; ++j) {
      *reinterpret_cast<T2*>(o + 16 * j + 2 * tk) =
          Num<T>::from_float2(acc[i][2 * j] * inv, acc[i][2 * j + 1] * inv);
    }
  }
}

template <typename T, typename PK, typename PV, int D, int BS>
cudaError_t launch_kernel(const Args& a, int swa_override, void* out, cudaStream_t stream) {
  constexpr size_t kSmem = PrefillSmem<PK, PV, D>::kBytes;  // = prefill_attention_smem_bytes
  auto kernel = prefill_attention_kernel<T, PK, PV, D, BS>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmem);
  if (err != cudaSuccess) return err;
  const int group = a.num_heads / a.kv_num_heads;
  const int tokens_per_tile = kPrefillRows / group;
  // Upper bound of the tile count (each request wastes less than one tile); the real count is
  // on the device and surplus blocks exit at once.
  const int grid_x = (a.token_num + tokens_per_tile - 1) / tokens_per_tile + a.bsz;
  dim3 grid(grid_x, a.kv_num_heads);
  CUDA_LAUNCH(grid, kThreads, kSmem, stream, prefill_attention_kernel<T, PK, PV, D, BS>)(a, swa_override,
                                                                                      static_cast<T*>(out));
  return cudaGetLastError();
}

template <typename T, typename PK, typename PV>
cudaError_t launch_shapes(const Args& a, int swa_override, void* out, cudaStream_t stream) {
  if (a.head_dim == 64) {
    return a.block_size == 64 ? launch_kernel<T, PK, PV, 64, 64>(a, swa_override, out, stream)
                              : launch_kernel<T, PK, PV, 64, 16>(a, swa_override, out, stream);
  }
  if (a.head_dim == 256) {  // Gemma 3
    return a.block_size == 64 ? launch_kernel<T, PK, PV, 256, 64>(a, swa_override, out, stream)
                              : launch_kernel<T, PK, PV, 256, 16>(a, swa_override, out, stream);
  }
  return a.block_size == 64 ? launch_kernel<T, PK, PV, 128, 64>(a, swa_override, out, stream)
                            : launch_kernel<T, PK, PV, 128, 16>(a, swa_override, out, stream);
}

template <typename T>
cudaError_t launch_typed(const Args& a, int swa_override, void* out, cudaStream_t stream) {
  // Quantized pages come with bf16 compute only (the launcher checks it).
  if (a.cache_quant == APPEND_ATTN_CACHE_INT8) {
    return launch_shapes<__nv_bfloat16, Int8Pages, Int8Pages>(a, swa_override, out, stream);
  }
  if (a.cache_quant == APPEND_ATTN_CACHE_FP8_E4M3) {
    return launch_shapes<__nv_bfloat16, E4M3Pages, E4M3Pages>(a, swa_override, out, stream);
  }
  if (a.cache_quant == APPEND_ATTN_CACHE_INT4) {
    return launch_shapes<__nv_bfloat16, NibblePages, NibblePages>(a, swa_override, out, stream);
  }
  if (a.cache_quant == APPEND_ATTN_CACHE_K8V4) {
    return launch_shapes<__nv_bfloat16, Int8Pages, NibblePages>(a, swa_override, out, stream);
  }
  return launch_shapes<T, FloatPages<T>, FloatPages<T>>(a, swa_override, out, stream);
}

}  // namespace

namespace {
template <int D>
size_t smem_bytes_of(int cache_quant) {
  if (cache_quant == APPEND_ATTN_CACHE_INT8) return PrefillSmem<Int8Pages, Int8Pages, D>::kBytes;
  if (cache_quant == APPEND_ATTN_CACHE_FP8_E4M3) return PrefillSmem<E4M3Pages, E4M3Pages, D>::kBytes;
  if (cache_quant == APPEND_ATTN_CACHE_INT4) return PrefillSmem<NibblePages, NibblePages, D>::kBytes;
  if (cache_quant == APPEND_ATTN_CACHE_K8V4) return PrefillSmem<Int8Pages, NibblePages, D>::kBytes;
  using Bf16Pages = FloatPages<__nv_bfloat16>;  // fp16 pages: the same bytes
  return PrefillSmem<Bf16Pages, Bf16Pages, D>::kBytes;
}
}  // namespace

size_t prefill_attention_smem_bytes(int cache_quant, int head_dim) {
  switch (head_dim) {
    case 64:
      return smem_bytes_of<64>(cache_quant);
    case 128:
      return smem_bytes_of<128>(cache_quant);
    case 256:
      return smem_bytes_of<256>(cache_quant);
    default:
      return 0;
  }
}

cudaError_t launch_prefill_tiles(const Args& a, cudaStream_t stream) {
  const int group = a.num_heads / a.kv_num_heads;
  CUDA_LAUNCH(1, 1024, 0, stream, prefill_tile_prefix_kernel)(a, kPrefillRows / group);
  return cudaGetLastError();
}

cudaError_t launch_prefill_attention(const Args& a, int dtype, int swa_override, void* out,
                                     cudaStream_t stream) {
  if (a.token_num == 0) return cudaSuccess;
  return dtype == APPEND_ATTN_BF16 ? launch_typed<__nv_bfloat16>(a, swa_override, out, stream)
                                   : launch_typed<__half>(a, swa_override, out, stream);
}

}  // namespace append_attn
