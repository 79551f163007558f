// Shared device helpers of the AppendAttention kernels: dtype conversion, how a kernel reads cache
// pages (float or quantized), block-table lookup, the SWA visibility rule and the live-block
// arithmetic that decides which pages a query visits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "../../cpu_ops/kv_quant.h"  // the quantized-page rule, shared with the CPU op
#include "append_attn_api.cuh"

// Every launch site is written CUDA_LAUNCH(grid, block, smem, stream, kernel)(args...): under nvcc
// the triple-chevron launch; the CUDA-on-CPU executor (custom_ops/gpu_ops/cuda_on_cpu, docs/gpu.md)
// defines it first to run the kernel on the CPU.
#ifndef CUDA_LAUNCH
#define CUDA_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
#endif

// The block's dynamic shared memory, for every kernel that takes some (one file-scope declaration
// instead of a block-scope `extern __shared__` per kernel: the host compiler of the CUDA-on-CPU
// executor can give this one name a definition, but not a block-scope extern in an unnamed namespace).
extern __shared__ __align__(16) unsigned char dynamic_shared_memory[];

namespace append_attn {

static_assert(int(APPEND_ATTN_CACHE_FLOAT) == int(fd_kvq::kFloat) &&
                  int(APPEND_ATTN_CACHE_INT8) == int(fd_kvq::kInt8) &&
                  int(APPEND_ATTN_CACHE_FP8_E4M3) == int(fd_kvq::kE4M3) &&
                  int(APPEND_ATTN_CACHE_INT4) == int(fd_kvq::kInt4) &&
                  int(APPEND_ATTN_CACHE_K8V4) == fd_kvq::kK8V4,
              "AppendAttnCacheQuant must keep fd_kvq::Format's values");

// Everything a kernel reads, filled once by the launcher (passed by value as a kernel argument).
struct Args {
  const void* qkv;
  void* key_cache;
  void* value_cache;
  const int* seq_lens_decoder;
  const int* seq_lens_this_time;
  const int* cu_seqlens_q;
  const int* block_tables;
  const float* rotary_cos;
  const float* rotary_sin;
  const int* head_windows;   // [2, kv_num_heads]: row 0 each KV head's window (0 = full), row 1 its sink
  const int* kv_head_slots;  // [kv_num_heads] or NULL (identity)
  float* key_scales;         // quantized pages: one scale per token row of every page, else NULL
  float* value_scales;
  float* q_rot;      // workspace [token_num, num_heads, head_dim]: rotated q * 1/sqrt(head_dim)
  int* tile_prefix;  // workspace [bsz + 1]: exclusive prefix of prefill tiles per request
  float* partial;    // workspace: decode split results, see decode_attention.cu
  int* error_info;   // 4 device ints
  int* dual_window;  // dual pass only (else NULL), workspace [2]: the window and sink its all-SWA pass
                     // slides every head with, the sliding heads' one pair (prefill_tile_prefix_kernel)
  int token_num, bsz, num_heads, kv_num_heads, kv_slots, head_dim, block_size, num_blocks;
  int max_blocks_per_seq, head_wise_table, max_position;
  int visit_all_pages;
  int decode_max_splits, decode_pages_per_split;
  int cache_quant;  // AppendAttnCacheQuant
  const float* sinks;  // [num_heads] learned sink logits, or NULL (AppendAttnBuffers::attention_sinks)
  float softcap;       // 0: off (AppendAttnParams::softcap)
};

// Gemma 2's soft-capping of a scaled score (cap 0: unchanged); tanhf, not a fast approximation, so the
// kernels agree with the CPU op's std::tanh to float32 rounding.
__device__ __forceinline__ float soft_cap(float s, float cap) { return cap > 0.f ? cap * tanhf(s / cap) : s; }

// The softmax's denominator of q head `qh` at the end of its keys: the running sum l at max m, plus
// exp(sink - m) where the head has a learned sink (gpt-oss). m is -inf only where no key was visible
// (recorded errors): then there is nothing to normalise.
__device__ __forceinline__ float softmax_denominator(const float* sinks, int qh, float l, float m) {
  return sinks == nullptr || m == -INFINITY ? l : l + __expf(sinks[qh] - m);
}

// swa_override for the attention kernels: kUseMask reads head_windows; the dual-pass baseline
// forces every head to one kind per pass.
constexpr int kUseMask = -1;
constexpr int kForceFull = 0;
constexpr int kForceSwa = 1;

// Rows (token x q head of one KV head group) per prefill thread block; tokens per tile = 64 / G.
constexpr int kPrefillRows = 64;
constexpr int kMaxGroup = 8;

template <typename T>
struct Num;

template <>
struct Num<__nv_bfloat16> {
  using T2 = __nv_bfloat162;
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) {
    return __float2bfloat16_rn(x);
  }
  static __device__ __forceinline__ float2 to_float2(T2 x) { return __bfloat1622float2(x); }
  static __device__ __forceinline__ T2 from_float2(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
};

template <>
struct Num<__half> {
  using T2 = __half2;
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ float2 to_float2(T2 x) { return __half22float2(x); }
  static __device__ __forceinline__ T2 from_float2(float a, float b) {
    return __floats2half2_rn(a, b);
  }
};

// How the attention kernels read cache elements: pages of T, or 8-bit or 4-bit codes times their
// row's scale (page row r of the page at element offset `base` has its scale at index
// base / head_dim + r). A stored unit (Elem) holds kPerUnit elements: kernels count in elements and
// index a cache or a staged copy at element offset e through unit_at (e / kPerUnit). pair_bits
// loads two neighbouring elements (the first at an even offset), pair turns them into floats, eight
// does so for 8 (the first at a multiple of 8). The kernels take one codec for the key lane and one
// for the value lane (PK, PV): the same for every format but K8V4 (Int8Pages keys, NibblePages values).
template <typename T>
struct FloatPages {
  using Elem = T;
  static constexpr bool kQuantized = false;
  static constexpr int kPerUnit = 1;
  static __device__ __forceinline__ uint32_t pair_bits(const Elem* p) {
    return *reinterpret_cast<const uint32_t*>(p);
  }
  static __device__ __forceinline__ float2 pair(uint32_t bits, float /*scale*/) {
    return Num<T>::to_float2(*reinterpret_cast<const typename Num<T>::T2*>(&bits));
  }
  static __device__ __forceinline__ void eight(const Elem* p, float /*scale*/, float* out) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = pair(words[e], 1.f);
      out[2 * e] = f.x;
      out[2 * e + 1] = f.y;
    }
  }
};

// 8-bit pages: Decode(bits of 2 codes) -> their exact values as a float2.
template <typename Code, typename Decode>
struct BytePages {
  using Elem = Code;
  static constexpr bool kQuantized = true;
  static constexpr int kPerUnit = 1;
  static __device__ __forceinline__ uint32_t pair_bits(const Elem* p) {
    return *reinterpret_cast<const uint16_t*>(p);
  }
  static __device__ __forceinline__ float2 pair(uint32_t bits, float scale) {
    const float2 v = Decode::values(bits & 0xFFFFu);
    return make_float2(v.x * scale, v.y * scale);
  }
  static __device__ __forceinline__ void eight(const Elem* p, float scale, float* out) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const uint32_t halves[4] = {raw.x & 0xFFFFu, raw.x >> 16, raw.y & 0xFFFFu, raw.y >> 16};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = pair(halves[e], scale);
      out[2 * e] = f.x;
      out[2 * e + 1] = f.y;
    }
  }
};

struct Int8Pair {
  static __device__ __forceinline__ float2 values(uint32_t bits) {
    return make_float2(float(static_cast<int8_t>(bits & 0xFFu)), float(static_cast<int8_t>(bits >> 8)));
  }
};

// e4m3fn -> half is exact: the hardware conversion on sm_89+, cuda_fp8.h's emulation before.
struct E4M3Pair {
  static __device__ __forceinline__ float2 values(uint32_t bits) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits), __NV_E4M3);
    return __half22float2(__half2(h));
  }
};

using Int8Pages = BytePages<int8_t, Int8Pair>;
using E4M3Pages = BytePages<uint8_t, E4M3Pair>;

// 4-bit pages (block_wise_int4): byte i of a row holds element 2i in its low nibble and 2i + 1 in
// its high one, each a 4-bit two's complement code in -7..7 (kv_quant.h); a code's value is exact
// in float, times the row's scale is the one rounding, as for the 8-bit formats.
struct NibblePages {
  using Elem = uint8_t;
  static constexpr bool kQuantized = true;
  static constexpr int kPerUnit = 2;
  static __device__ __forceinline__ uint32_t pair_bits(const Elem* p) { return *p; }
  static __device__ __forceinline__ float2 pair(uint32_t bits, float scale) {
    const uint8_t b = static_cast<uint8_t>(bits);
    return make_float2(float(fd_kvq::int4_low(b)) * scale, float(fd_kvq::int4_high(b)) * scale);
  }
  static __device__ __forceinline__ void eight(const Elem* p, float scale, float* out) {
    const uint32_t word = *reinterpret_cast<const uint32_t*>(p);  // 8 codes, element e in bits 4e..4e+3
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      // the nibble moved to the top, then an arithmetic shift back: its sign-extended value
      out[e] = float(static_cast<int32_t>(word << (28 - 4 * e)) >> 28) * scale;
    }
  }
};

// The unit holding element `element` of a cache (or a staged copy) of P's pages.
template <typename P, typename E>
__device__ __forceinline__ E* unit_at(E* units, long long element) {
  return units + element / P::kPerUnit;
}

// A page format quantizes both lanes or neither: the kernels stage one set of scales per lane when
// kQuantized, and the launcher passes scales for both or for none.
template <typename PK, typename PV>
struct LanePair {
  static_assert(PK::kQuantized == PV::kQuantized, "a page format quantizes both lanes or neither");
  static constexpr bool kQuantized = PK::kQuantized;
};

// Records the first device-side error of a launch; later ones are dropped so the report names the
// earliest culprit deterministically enough to debug a scheduler.
__device__ __forceinline__ void record_error(int* info, int code, int req, int head, int block) {
  if (info != nullptr && atomicCAS(info, 0, code) == 0) {
    info[1] = req;
    info[2] = head;
    info[3] = block;
  }
}

// Element offset of row 0 of (request, kv head, block index) in the cache viewed as pages
// [num_blocks * kv_slots, block_size, head_dim] (the head's slot = its table row and its place in
// a block), or -1 when the entry must not be dereferenced
// (a -1 entry is recorded with `dead_code`, an id beyond the cache as out of range).
__device__ __forceinline__ long long page_offset(const Args& a, int req, int head, int block,
                                                 int dead_code) {
  if (block < 0 || block >= a.max_blocks_per_seq) {
    record_error(a.error_info, APPEND_ATTN_ERR_OUT_OF_RANGE, req, head, block);
    return -1;
  }
  long long page;
  const int slot = a.kv_head_slots != nullptr ? a.kv_head_slots[head] : head;
  if (slot < 0 || slot >= a.kv_slots) {  // a head mapped outside the lane's slots
    record_error(a.error_info, APPEND_ATTN_ERR_OUT_OF_RANGE, req, head, block);
    return -1;
  }
  if (a.head_wise_table) {
    const int e =
        a.block_tables[((long long)req * a.kv_slots + slot) * a.max_blocks_per_seq + block];
    if (e < 0) {
      record_error(a.error_info, dead_code, req, head, block);
      return -1;
    }
    page = e;
    if (page >= (long long)a.num_blocks * a.kv_slots) {
      record_error(a.error_info, APPEND_ATTN_ERR_OUT_OF_RANGE, req, head, block);
      return -1;
    }
  } else {
    const int e = a.block_tables[(long long)req * a.max_blocks_per_seq + block];
    if (e < 0) {
      record_error(a.error_info, dead_code, req, head, block);
      return -1;
    }
    if (e >= a.num_blocks) {
      record_error(a.error_info, APPEND_ATTN_ERR_OUT_OF_RANGE, req, head, block);
      return -1;
    }
    page = (long long)e * a.kv_slots + slot;
  }
  return page * a.block_size * a.head_dim;
}

// The keys a KV head's queries see: its own window and sink (row 0 / row 1 of head_windows; a window
// of 0 is a full head). The dual-pass baseline forces a pass's kind: its full pass reads every head
// as full, its sliding pass slides every head with the sliding heads' one (window, sink)
// (dual_window; the stitch keeps only the sliding heads' rows of it). A negative window or sink is an
// error the tile prefix kernel records (check_head_windows); here it reads as 0 (a full head, no
// sink), so the attention kernels carry no error path of their own for it.
struct HeadWindow {
  bool swa;
  int window;
  int sink;
};

__device__ __forceinline__ HeadWindow head_window(const Args& a, int head, int swa_override) {
  HeadWindow w;
  if (swa_override == kForceSwa) {
    w.window = a.dual_window[0];
    w.sink = a.dual_window[1];
    w.swa = w.window > 0;
    return w;
  }
  w.window = max(a.head_windows[head], 0);
  w.sink = max(a.head_windows[a.kv_num_heads + head], 0);
  w.swa = w.window > 0 && swa_override != kForceFull;
  return w;
}

// Records a negative per-head window or sink (APPEND_ATTN_ERR_HEAD_WINDOW: row, head, value) and, for
// the dual pass, derives the one (window, sink) of its all-SWA pass into dual_window: the first
// sliding head's, which every other sliding head must share (else APPEND_ATTN_ERR_DUAL_PASS_WINDOWS:
// the two heads); no sliding head: window 0 (that pass then reads every head as full, and the
// stitch keeps none of it). Called by the one block of prefill_tile_prefix_kernel, which every step
// with tokens launches before the attention kernels.
__device__ __forceinline__ void check_head_windows(const Args& a) {
  for (int i = threadIdx.x; i < 2 * a.kv_num_heads; i += blockDim.x) {
    if (a.head_windows[i] < 0) {
      record_error(a.error_info, APPEND_ATTN_ERR_HEAD_WINDOW, i / a.kv_num_heads, i % a.kv_num_heads,
                   a.head_windows[i]);
    }
  }
  if (a.dual_window == nullptr || threadIdx.x != 0) return;
  const int* sinks = a.head_windows + a.kv_num_heads;
  int first = -1;
  for (int h = 0; h < a.kv_num_heads; ++h) {
    if (a.head_windows[h] <= 0) continue;
    if (first < 0) {
      first = h;
    } else if (a.head_windows[h] != a.head_windows[first] || sinks[h] != sinks[first]) {
      record_error(a.error_info, APPEND_ATTN_ERR_DUAL_PASS_WINDOWS, first, h, 0);
      break;
    }
  }
  a.dual_window[0] = first < 0 ? 0 : a.head_windows[first];
  a.dual_window[1] = first < 0 ? 0 : max(sinks[first], 0);
}

// The contract's visibility rule: query position q sees key position k.
__device__ __forceinline__ bool key_visible(int q, int k, bool swa, int window, int sink) {
  return k >= 0 && k <= q && (!swa || k < sink || k > q - window);
}

// The blocks a group of queries at positions [first_pos, last_pos] visits, in order: blocks
// [0, sink_end) then [win_begin, last]. For a SWA head that is the sink blocks plus the blocks
// overlapping the union of the windows, and each holds a key some query sees, so by the
// retention rule none of them is dead. Full heads and the masked baseline visit [0, last].
struct LiveBlocks {
  int sink_end;
  int win_begin;
  int count;
  __device__ __forceinline__ int nth(int n) const {
    return n < sink_end ? n : win_begin + (n - sink_end);
  }
};

__device__ __forceinline__ LiveBlocks live_blocks(int first_pos, int last_pos, bool swa,
                                                  bool visit_all, int window, int sink,
                                                  int block_size) {
  const int last = last_pos / block_size;
  LiveBlocks lb;
  if (!swa || visit_all) {
    lb.sink_end = last + 1;
    lb.win_begin = last + 1;
    lb.count = last + 1;
    return lb;
  }
  const int sink_blocks = sink / block_size + (sink % block_size != 0);
  lb.sink_end = min(sink_blocks, last + 1);
  const int first_visible = max(first_pos - window + 1, 0);
  lb.win_begin = max(first_visible / block_size, lb.sink_end);
  lb.count = lb.sink_end + (last + 1 - lb.win_begin);
  return lb;
}

// Request owning qkv row `token`, or -1 for rows past cu_seqlens_q[bsz]. Idle slots own no rows.
__device__ __forceinline__ int find_request(const int* cu_seqlens_q, int bsz, int token) {
  if (token < 0 || token >= cu_seqlens_q[bsz]) return -1;
  int lo = 0, hi = bsz;  // cu[lo] <= token < cu[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (cu_seqlens_q[mid] <= token) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Decode split count of a query whose live list has `count` blocks; decode and merge kernels must
// agree on it, hence one function.
__device__ __forceinline__ int decode_num_splits(const Args& a, int count) {
  const int n = (count + a.decode_pages_per_split - 1) / a.decode_pages_per_split;
  return min(n, a.decode_max_splits);
}

// Host-side launch entry points of the individual .cu files (defined there, called by launcher.cu).
cudaError_t launch_rope_write_cache(const Args& a, int dtype, void* out, cudaStream_t stream);
// Dynamic shared memory of the quantized cache write (rope_write_cache.cu): the launcher refuses
// shapes that need more than a GPU has.
size_t quantized_rope_write_smem_bytes(int num_heads, int kv_num_heads, int head_dim);
cudaError_t launch_prefill_tiles(const Args& a, cudaStream_t stream);
// Dynamic shared memory of the prefill attention kernel for this page format and head_dim
// (prefill_attention.cu, the bytes its launch passes); 0 for an unsupported head_dim.
size_t prefill_attention_smem_bytes(int cache_quant, int head_dim);
cudaError_t launch_prefill_attention(const Args& a, int dtype, int swa_override, void* out,
                                     cudaStream_t stream);
cudaError_t launch_decode_attention(const Args& a, int dtype, int swa_override, void* out,
                                    cudaStream_t stream);
cudaError_t launch_stitch_heads(const Args& a, int dtype, const void* swa_out, void* out,
                                cudaStream_t stream);

}  // namespace append_attn
