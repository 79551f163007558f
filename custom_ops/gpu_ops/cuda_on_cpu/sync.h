// Barriers and warp exchanges. A block's threads are fibers on one OS thread; each of these calls
// suspends the calling fiber until the threads it waits for have arrived (block_runner.cpp):
// __syncthreads waits for the whole block, __syncwarp and the shuffles for the 32 lanes of the
// caller's warp. A shuffle really exchanges: every lane publishes its value in its warp's slot
// array, waits for the warp, then reads its partner's slot.
#pragma once

#include <stdint.h>
#include <string.h>

#include <type_traits>

namespace cuda_on_cpu {

void block_barrier();
void warp_barrier(unsigned mask);
uint64_t warp_exchange_xor(unsigned mask, uint64_t bits, int lane_mask, int width);

}  // namespace cuda_on_cpu

inline void __syncthreads() { ::cuda_on_cpu::block_barrier(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { ::cuda_on_cpu::warp_barrier(mask); }

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8,
                "cuda_on_cpu: __shfl_xor_sync of this type is not implemented");
  uint64_t bits = 0;
  memcpy(&bits, &var, sizeof(T));
  bits = ::cuda_on_cpu::warp_exchange_xor(mask, bits, lane_mask, width);
  T out;
  memcpy(&out, &bits, sizeof(T));
  return out;
}
