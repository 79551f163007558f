// The CUDA runtime calls the launcher and the harness make, on the host: one "device" (the CPU),
// memory in host RAM, synchronous launches, so streams and synchronization are no-ops and an event
// records the host clock. Calls not defined here stay undefined and fail the link (-z defs).
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>

#include <cuda_runtime_api.h>

#include "device_memory.h"
#include "dynamic_shared.h"
#include "runtime_state.h"

namespace cuda_on_cpu {

namespace {
thread_local cudaError_t t_last_error = cudaSuccess;
thread_local std::string t_last_detail;
std::mutex g_attr_mutex;
std::map<const void*, int> g_max_dynamic_smem;
}  // namespace

void set_launch_error(cudaError_t err, const std::string& detail) {
  t_last_error = err;
  t_last_detail = detail;
}

size_t max_dynamic_smem(const void* kernel) {
  std::lock_guard<std::mutex> lock(g_attr_mutex);
  auto it = g_max_dynamic_smem.find(kernel);
  return it == g_max_dynamic_smem.end() ? 48 * 1024 : (size_t)it->second;  // CUDA's default limit
}

namespace {
std::atomic<int> g_sm_count{132};  // an H100 / H200: the launcher sizes decode splits for it
}  // namespace

int sm_count() { return g_sm_count.load(std::memory_order_relaxed); }

}  // namespace cuda_on_cpu

using namespace cuda_on_cpu;

extern "C" {

// The multiprocessor count cudaDeviceGetAttribute reports (CUDA_ON_CPU_SM_COUNT; <= 0: 132).
__attribute__((visibility("default"))) void cuda_on_cpu_set_sm_count(int count) {
  g_sm_count.store(count > 0 ? count : 132, std::memory_order_relaxed);
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  if (ptr == nullptr) return cudaErrorInvalidValue;
  *ptr = device_alloc(bytes);
  return *ptr != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  return device_free(ptr) ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
  if (bytes > 0) memmove(dst, src, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
  return cudaMemcpy(dst, src, bytes, kind);
}

cudaError_t cudaMemset(void* dst, int value, size_t bytes) {
  if (bytes > 0) memset(dst, value, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t) { return cudaMemset(dst, value, bytes); }

cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *value = sm_count();
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = (int)cuda_on_cpu_max_dynamic_smem;
      return cudaSuccess;
    default:
      fprintf(stderr, "cuda_on_cpu: cudaDeviceGetAttribute(%d) is not implemented\n", (int)attr);
      return cudaErrorNotSupported;
  }
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorNotSupported;
  if (value < 0 || (size_t)value > cuda_on_cpu_max_dynamic_smem) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> lock(g_attr_mutex);
  g_max_dynamic_smem[func] = value;
  return cudaSuccess;
}

cudaError_t cudaGetLastError(void) {
  const cudaError_t err = t_last_error;
  t_last_error = cudaSuccess;
  return err;
}

cudaError_t cudaPeekAtLastError(void) { return t_last_error; }

const char* cudaGetErrorName(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    default: return "cudaErrorUnknown";
  }
}

// The name, and for the launch that failed last on this thread what the executor saw.
const char* cudaGetErrorString(cudaError_t err) {
  thread_local std::string text;
  text = cudaGetErrorName(err);
  if (err != cudaSuccess && !t_last_detail.empty()) text += " (" + t_last_detail + ")";
  return text.c_str();
}

struct CUevent_st {
  double ms;
};

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = new CUevent_st{0.0};
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t) {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  event->ms = ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  *ms = (float)(end->ms - start->ms);
  return cudaSuccess;
}

}  // extern "C"
