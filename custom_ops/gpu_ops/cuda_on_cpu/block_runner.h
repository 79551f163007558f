// Runs one thread block: its blockDim threads as fibers of the calling OS thread, meeting at real
// barriers. Between two barriers each thread runs alone, and the order in which the runnable
// threads take their turns is the Order given: a kernel whose result depends on it has a race.
#pragma once

#include <stdint.h>

#include <string>

#include <vector_functions.h>
#include <vector_types.h>

namespace cuda_on_cpu {

struct Order {
  enum Kind { kForward, kReverse, kShuffle } kind = kForward;
  uint64_t seed = 0;
  std::string label() const;
};

// Permutes `n` indices in the order's sense; `salt` varies a shuffle between uses.
void arrange(const Order& order, uint64_t salt, uint32_t* items, size_t n);

// Runs body(ctx) on every thread of block `block_idx`. Returns "" or what went wrong (a barrier
// not reached by every thread, a shuffle with an unsupported mask, ...).
std::string run_block(const dim3& grid, const dim3& block, const uint3& block_idx, size_t dynamic_smem,
                      const Order& order, void (*body)(void*), void* ctx);

}  // namespace cuda_on_cpu
