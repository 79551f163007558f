// Framework-free test/benchmark harness over the C ABI launcher, built into a shared library with
// `nvcc -shared` and driven from Python through ctypes: host buffers in, device run, results and
// CUDA-event timings out. Not part of the Paddle op.
#include <stdio.h>
#include <stdint.h>
#include <string.h>

#include <string>
#include <vector>

#include "append_attn_api.cuh"
#include "append_attn_common.cuh"

namespace {

// Owns one device allocation; frees it on scope exit so every early return is leak-free.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  cudaError_t alloc(size_t bytes) {
    bytes_ = bytes;
    return cudaMalloc(&ptr_, bytes > 0 ? bytes : 1);
  }
  cudaError_t upload(const void* host) {
    return host == nullptr || bytes_ == 0 ? cudaSuccess
                                          : cudaMemcpy(ptr_, host, bytes_, cudaMemcpyHostToDevice);
  }
  cudaError_t download(void* host) const {
    return host == nullptr || bytes_ == 0 ? cudaSuccess
                                          : cudaMemcpy(host, ptr_, bytes_, cudaMemcpyDeviceToHost);
  }
  void* get() const { return ptr_; }
  template <typename P>
  P* as() const {
    return static_cast<P*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class Events {
 public:
  Events() {
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
  }
  ~Events() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  cudaEvent_t start = nullptr, stop = nullptr;
};

// A cheap deterministic hash of an element index: the benchmark fills' only source of values.
__device__ __forceinline__ uint32_t mix(size_t i, uint32_t seed) {
  uint32_t h = (uint32_t)i * 2654435761u ^ seed;
  h ^= h >> 15;
  h *= 2246822519u;
  return h;
}

// Deterministic values in [-1, 1) for benchmark inputs: timing does not depend on them, and
// generating gigabytes on the device avoids host transfers.
__global__ void fill_kernel(uint16_t* dst, size_t n, uint32_t seed, int dtype) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = mix(i, seed);
    h ^= h >> 13;
    const float v = ((h & 0xffffu) / 32768.0f) - 1.0f;
    if (dtype == APPEND_ATTN_BF16) {
      const __nv_bfloat16 b = __float2bfloat16_rn(v);
      dst[i] = *reinterpret_cast<const uint16_t*>(&b);
    } else {
      const __half hv = __float2half_rn(v);
      dst[i] = *reinterpret_cast<const uint16_t*>(&hv);
    }
  }
}

// Quantized lanes for benchmarks (`format` a fd_kvq::Format): int8 codes in [-64, 63], e4m3 bytes of
// magnitude < 2 (never the NaN code), or int4 bytes of two codes in [-7, 7]; every row's scale 1/64.
__global__ void fill_bytes_kernel(uint8_t* dst, size_t n, uint32_t seed, int format) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    const uint32_t h = mix(i, seed);
    if (format == fd_kvq::kInt4) {
      dst[i] = fd_kvq::int4_pack((int)((h >> 8) % 15u) - 7, (int)((h >> 16) % 15u) - 7);
    } else {
      dst[i] = format == fd_kvq::kInt8 ? (uint8_t)((h >> 8) & 0x7Fu) - 64
                                       : (uint8_t)(((h >> 8) & 0x3Fu) | ((h >> 16) & 0x80u));
    }
  }
}

// Bytes of a lane of `elems` elements: 2 per element of a float (bf16 / fp16) lane, 1 per 8-bit code,
// half of one per int4 code.
size_t lane_bytes(fd_kvq::Format format, size_t elems) {
  return format == fd_kvq::kFloat ? elems * 2 : format == fd_kvq::kInt4 ? elems / 2 : elems;
}

__global__ void fill_scales_kernel(float* dst, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    dst[i] = 1.f / 64.f;
  }
}

int report(char* msg, int msg_len, int status, const std::string& text) {
  if (msg != nullptr && msg_len > 0) snprintf(msg, (size_t)msg_len, "%s", text.c_str());
  return status;
}

}  // namespace

#define HARNESS_CUDA(expr)                                                                   \
  do {                                                                                       \
    const cudaError_t err_ = (expr);                                                         \
    if (err_ != cudaSuccess) {                                                               \
      return report(msg, msg_len, 3, std::string(#expr) + ": " + cudaGetErrorString(err_)); \
    }                                                                                        \
  } while (0)

extern "C" {

// Number of visible CUDA devices, or -1 when the runtime cannot find a driver / device.
int aa_device_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return n;
}

// Runs one step from host buffers (AppendAttnBuffers holding HOST pointers, sizes implied by the
// params). With fill_on_device, qkv and the caches are generated on the device and host qkv /
// caches / out may be NULL (benchmarks). Otherwise out and the caches are copied back after the
// first run. Then `warmup` untimed and `iters` timed runs (re-running is idempotent: the same K/V
// are rewritten); *avg_ms is the mean time of one launch. Quantized caches (p->cache_quant) hold one
// byte per element (int4: per two elements; k8v4: int8 keys, int4 values) and come with
// key/value_cache_scales (host arrays, copied back like the caches).
// Returns 0 ok, 1 launcher rejected the arguments, 2 device-side error (error_info, msg), 3 CUDA.
int aa_run(const AppendAttnParams* p, const AppendAttnBuffers* host, int fill_on_device,
           int warmup, int iters, float* avg_ms, int* error_info, char* msg, int msg_len) {
  if (p == nullptr || host == nullptr || error_info == nullptr) {
    return report(msg, msg_len, 1, "p, host and error_info are required");
  }
  memset(error_info, 0, 4 * sizeof(int));
  if (avg_ms != nullptr) *avg_ms = 0.f;
  const size_t elt = 2;
  const bool quantized = p->cache_quant != APPEND_ATTN_CACHE_FLOAT;
  const size_t tokens = p->token_num > 0 ? (size_t)p->token_num : 0;
  const size_t qkv_elems = tokens * (size_t)(p->num_heads + 2 * p->kv_num_heads) * p->head_dim;
  const int slots = p->kv_slots > 0 ? p->kv_slots : p->kv_num_heads;
  const size_t cache_elems = (size_t)p->num_blocks * slots * p->block_size * p->head_dim;
  const fd_kvq::LaneFormats lanes = fd_kvq::lane_formats(p->cache_quant);
  const size_t key_bytes = lane_bytes(lanes.key, cache_elems);
  const size_t value_bytes = lane_bytes(lanes.value, cache_elems);
  const size_t out_elems = tokens * (size_t)p->num_heads * p->head_dim;
  const size_t table_elems = (size_t)p->bsz * (p->head_wise_table ? slots : 1) *
                             p->max_blocks_per_seq;
  const size_t rot_elems = (size_t)p->max_position * (p->head_dim / 2);
  const size_t scale_elems = quantized ? cache_elems / p->head_dim : 0;

  DeviceBuffer qkv, kc, vc, ks, vs, enc, dec, this_time, cu, tables, cos_t, sin_t, windows, head_slots, out,
      ws, err, sinks;
  HARNESS_CUDA(qkv.alloc(qkv_elems * elt));
  HARNESS_CUDA(kc.alloc(key_bytes));
  HARNESS_CUDA(vc.alloc(value_bytes));
  HARNESS_CUDA(ks.alloc(scale_elems * sizeof(float)));
  HARNESS_CUDA(vs.alloc(scale_elems * sizeof(float)));
  HARNESS_CUDA(enc.alloc(sizeof(int) * p->bsz));
  HARNESS_CUDA(dec.alloc(sizeof(int) * p->bsz));
  HARNESS_CUDA(this_time.alloc(sizeof(int) * p->bsz));
  HARNESS_CUDA(cu.alloc(sizeof(int) * (p->bsz + 1)));
  HARNESS_CUDA(tables.alloc(sizeof(int) * table_elems));
  HARNESS_CUDA(cos_t.alloc(sizeof(float) * rot_elems));
  HARNESS_CUDA(sin_t.alloc(sizeof(float) * rot_elems));
  HARNESS_CUDA(windows.alloc(sizeof(int) * 2 * p->kv_num_heads));  // [2, kv_num_heads]
  HARNESS_CUDA(head_slots.alloc(sizeof(int) * p->kv_num_heads));
  HARNESS_CUDA(out.alloc(out_elems * elt));
  HARNESS_CUDA(err.alloc(4 * sizeof(int)));
  HARNESS_CUDA(sinks.alloc(host->attention_sinks != nullptr ? sizeof(float) * p->num_heads : 0));
  const size_t ws_bytes = append_attention_workspace_bytes(p);
  if (ws_bytes == 0) return report(msg, msg_len, 1, "invalid parameters (workspace size 0)");
  HARNESS_CUDA(ws.alloc(ws_bytes));

  if (fill_on_device) {
    CUDA_LAUNCH(1024, 256, 0, 0, fill_kernel)(qkv.as<uint16_t>(), qkv_elems, 1u, p->dtype);
    HARNESS_CUDA(cudaGetLastError());
    if (quantized) {
      CUDA_LAUNCH(4096, 256, 0, 0, fill_bytes_kernel)(kc.as<uint8_t>(), key_bytes, 2u, lanes.key);
      HARNESS_CUDA(cudaGetLastError());
      CUDA_LAUNCH(4096, 256, 0, 0, fill_bytes_kernel)(vc.as<uint8_t>(), value_bytes, 3u, lanes.value);
      HARNESS_CUDA(cudaGetLastError());
      CUDA_LAUNCH(1024, 256, 0, 0, fill_scales_kernel)(ks.as<float>(), scale_elems);
      HARNESS_CUDA(cudaGetLastError());
      CUDA_LAUNCH(1024, 256, 0, 0, fill_scales_kernel)(vs.as<float>(), scale_elems);
      HARNESS_CUDA(cudaGetLastError());
    } else {
      CUDA_LAUNCH(4096, 256, 0, 0, fill_kernel)(kc.as<uint16_t>(), cache_elems, 2u, p->dtype);
      HARNESS_CUDA(cudaGetLastError());
      CUDA_LAUNCH(4096, 256, 0, 0, fill_kernel)(vc.as<uint16_t>(), cache_elems, 3u, p->dtype);
      HARNESS_CUDA(cudaGetLastError());
    }
  } else {
    HARNESS_CUDA(qkv.upload(host->qkv));
    HARNESS_CUDA(kc.upload(host->key_cache));
    HARNESS_CUDA(vc.upload(host->value_cache));
    if (quantized) {
      HARNESS_CUDA(ks.upload(host->key_cache_scales));
      HARNESS_CUDA(vs.upload(host->value_cache_scales));
    }
    HARNESS_CUDA(out.upload(host->out));  // keeps the caller's poison visible to the check
  }
  HARNESS_CUDA(enc.upload(host->seq_lens_encoder));
  HARNESS_CUDA(dec.upload(host->seq_lens_decoder));
  HARNESS_CUDA(this_time.upload(host->seq_lens_this_time));
  HARNESS_CUDA(cu.upload(host->cu_seqlens_q));
  HARNESS_CUDA(tables.upload(host->block_tables));
  HARNESS_CUDA(cos_t.upload(host->rotary_cos));
  HARNESS_CUDA(sin_t.upload(host->rotary_sin));
  HARNESS_CUDA(windows.upload(host->head_windows));
  if (host->kv_head_slots != nullptr) HARNESS_CUDA(head_slots.upload(host->kv_head_slots));
  HARNESS_CUDA(sinks.upload(host->attention_sinks));  // none: nothing to copy

  AppendAttnBuffers d;
  d.qkv = qkv.get();
  d.key_cache = kc.get();
  d.value_cache = vc.get();
  d.seq_lens_encoder = host->seq_lens_encoder ? enc.as<const int>() : nullptr;
  d.seq_lens_decoder = dec.as<const int>();
  d.seq_lens_this_time = this_time.as<const int>();
  d.cu_seqlens_q = cu.as<const int>();
  d.block_tables = tables.as<const int>();
  d.rotary_cos = cos_t.as<const float>();
  d.rotary_sin = sin_t.as<const float>();
  d.head_windows = windows.as<const int>();
  d.kv_head_slots = host->kv_head_slots != nullptr ? head_slots.as<const int>() : nullptr;
  d.key_cache_scales = quantized ? ks.as<float>() : nullptr;
  d.value_cache_scales = quantized ? vs.as<float>() : nullptr;
  d.attention_sinks = host->attention_sinks != nullptr ? sinks.as<const float>() : nullptr;
  d.out = out.get();

  const cudaStream_t stream = 0;
  int status = append_attention_launch(p, &d, ws.get(), ws_bytes, err.as<int>(), stream);
  if (status == APPEND_ATTN_INVALID_ARGUMENT) {
    return report(msg, msg_len, 1, append_attention_last_error());
  }
  if (status != APPEND_ATTN_OK) return report(msg, msg_len, 3, append_attention_last_error());
  HARNESS_CUDA(cudaStreamSynchronize(stream));
  HARNESS_CUDA(err.download(error_info));
  if (error_info[0] != APPEND_ATTN_ERR_NONE) {
    char text[512];
    return report(msg, msg_len, 2, append_attention_describe_error(error_info, text, sizeof(text)));
  }
  if (!fill_on_device) {
    HARNESS_CUDA(out.download(host->out));
    HARNESS_CUDA(kc.download(host->key_cache));
    HARNESS_CUDA(vc.download(host->value_cache));
    if (quantized) {
      HARNESS_CUDA(ks.download(host->key_cache_scales));
      HARNESS_CUDA(vs.download(host->value_cache_scales));
    }
  }

  if (iters > 0) {
    for (int i = 0; i < warmup; ++i) {
      if (append_attention_launch(p, &d, ws.get(), ws_bytes, err.as<int>(), stream) != 0) {
        return report(msg, msg_len, 3, append_attention_last_error());
      }
    }
    Events ev;
    HARNESS_CUDA(cudaEventRecord(ev.start, stream));
    for (int i = 0; i < iters; ++i) {
      if (append_attention_launch(p, &d, ws.get(), ws_bytes, err.as<int>(), stream) != 0) {
        return report(msg, msg_len, 3, append_attention_last_error());
      }
    }
    HARNESS_CUDA(cudaEventRecord(ev.stop, stream));
    HARNESS_CUDA(cudaEventSynchronize(ev.stop));
    float ms = 0.f;
    HARNESS_CUDA(cudaEventElapsedTime(&ms, ev.start, ev.stop));
    if (avg_ms != nullptr) *avg_ms = ms / iters;
  }
  return report(msg, msg_len, 0, "");
}

// Device-to-device copy bandwidth in GB/s (bytes read + bytes written per second): the practical
// HBM ceiling the decode kernels are compared with. Returns a negative value on a CUDA error.
double aa_copy_bandwidth_gbps(size_t bytes, int iters) {
  DeviceBuffer src, dst;
  if (src.alloc(bytes) != cudaSuccess || dst.alloc(bytes) != cudaSuccess) return -1.0;
  if (cudaMemset(src.get(), 1, bytes) != cudaSuccess) return -1.0;
  if (cudaMemcpy(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice) != cudaSuccess) return -1.0;
  Events ev;
  cudaEventRecord(ev.start);
  for (int i = 0; i < iters; ++i) cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice);
  cudaEventRecord(ev.stop);
  if (cudaEventSynchronize(ev.stop) != cudaSuccess) return -1.0;
  float ms = 0.f;
  cudaEventElapsedTime(&ms, ev.start, ev.stop);
  return ms > 0.f ? 2.0 * (double)bytes * iters / (ms * 1e-3) / 1e9 : -1.0;
}

}  // extern "C"
