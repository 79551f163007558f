// threadIdx, blockIdx, blockDim, gridDim and warpSize. The block runner (block_runner.cpp) sets
// them for the fiber it resumes; kernels read them through const references, so an assignment to
// one does not compile (as under nvcc).
#pragma once

#include <vector_types.h>

namespace cuda_on_cpu {

#define CUDA_ON_CPU_TLS __attribute__((visibility("hidden"))) thread_local
extern CUDA_ON_CPU_TLS uint3 g_thread_idx;
extern CUDA_ON_CPU_TLS uint3 g_block_idx;
extern CUDA_ON_CPU_TLS dim3 g_block_dim;
extern CUDA_ON_CPU_TLS dim3 g_grid_dim;

inline const uint3& thread_idx() { return g_thread_idx; }
inline const uint3& block_idx() { return g_block_idx; }
inline const dim3& block_dim() { return g_block_dim; }
inline const dim3& grid_dim() { return g_grid_dim; }

}  // namespace cuda_on_cpu

#define threadIdx (::cuda_on_cpu::thread_idx())
#define blockIdx (::cuda_on_cpu::block_idx())
#define blockDim (::cuda_on_cpu::block_dim())
#define gridDim (::cuda_on_cpu::grid_dim())
constexpr int warpSize = 32;
