// cudaFuncSetAttribute on a kernel: the toolkit's C++ overload is for nvcc only, and a function
// pointer does not convert to the C API's const void* in host C++.
#pragma once

#include <cuda_runtime_api.h>

template <typename... Params>
inline cudaError_t cudaFuncSetAttribute(void (*kernel)(Params...), cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}
