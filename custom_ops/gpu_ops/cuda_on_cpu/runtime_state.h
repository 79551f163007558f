// State shared by the runtime calls (runtime.cpp) and the launch (launch.cpp).
#pragma once

#include <stddef.h>

#include <string>

#include <cuda_runtime_api.h>

namespace cuda_on_cpu {

// What cudaGetLastError returns next; the detail is appended by cudaGetErrorString.
void set_launch_error(cudaError_t err, const std::string& detail);
// cudaFuncAttributeMaxDynamicSharedMemorySize of a kernel (48 KiB unless raised).
size_t max_dynamic_smem(const void* kernel);

}  // namespace cuda_on_cpu
