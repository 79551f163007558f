#include "block_runner.h"

#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <memory>
#include <random>
#include <vector>

#include "dynamic_shared.h"
#include "fiber.h"
#include "thread_index.h"

thread_local __attribute__((aligned(16))) unsigned char dynamic_shared_memory[cuda_on_cpu_max_dynamic_smem];

namespace cuda_on_cpu {

CUDA_ON_CPU_TLS uint3 g_thread_idx;
CUDA_ON_CPU_TLS uint3 g_block_idx;
CUDA_ON_CPU_TLS dim3 g_block_dim;
CUDA_ON_CPU_TLS dim3 g_grid_dim;

std::string Order::label() const {
  switch (kind) {
    case kForward: return "forward";
    case kReverse: return "reverse";
    default: return "shuffle:" + std::to_string(seed);
  }
}

void arrange(const Order& order, uint64_t salt, uint32_t* items, size_t n) {
  std::sort(items, items + n);
  if (order.kind == Order::kReverse) {
    std::reverse(items, items + n);
  } else if (order.kind == Order::kShuffle) {
    std::mt19937_64 rng(order.seed * 0x9E3779B97F4A7C15ull + salt);
    std::shuffle(items, items + n, rng);
  }
}

namespace {

constexpr int kWarp = 32;

enum class State { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kDone };
enum class WarpWait { kSyncwarp, kShuffle };

struct Thread {
  void* sp = nullptr;
  uint3 idx{};
  State state = State::kRunnable;
  WarpWait warp_wait = WarpWait::kSyncwarp;
  uint32_t shuffles = 0;  // exchanges so far: picks the slot array, must agree across the warp
};

// The block being run on this OS thread.
struct Block {
  std::vector<std::unique_ptr<FiberStack>> stacks;  // kept across blocks
  std::vector<Thread> threads;
  std::vector<uint64_t> slots[2];  // shuffle values, [warp * 32 + lane], alternating per exchange
  void* scheduler_sp = nullptr;
  Thread* current = nullptr;
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  std::string error;
};

thread_local Block t_block;

void enter_thread() {
  Block& b = t_block;
  b.body(b.ctx);
  b.current->state = State::kDone;
  cuda_on_cpu_switch(&b.current->sp, b.scheduler_sp);
  __builtin_unreachable();
}

// Suspends the calling thread (fiber) until the scheduler resumes it.
void suspend(State why) {
  Block& b = t_block;
  b.current->state = why;
  cuda_on_cpu_switch(&b.current->sp, b.scheduler_sp);
}

// A barrier-level failure: recorded, and the calling fiber is never resumed (the launch fails).
[[noreturn]] void fail(const std::string& what) {
  Block& b = t_block;
  if (b.error.empty()) b.error = what;
  suspend(State::kDone);
  __builtin_unreachable();
}

int linear(const Thread& t) {
  return (int)(t.idx.x + g_block_dim.x * (t.idx.y + g_block_dim.y * t.idx.z));
}

std::string describe_warp(const Block& b, int warp) {
  int at_block = 0, at_warp = 0, done = 0;
  const int n = (int)b.threads.size();
  for (int i = warp * kWarp; i < std::min(n, (warp + 1) * kWarp); ++i) {
    const State s = b.threads[i].state;
    at_block += s == State::kAtBlockBarrier;
    at_warp += s == State::kAtWarpBarrier;
    done += s == State::kDone;
  }
  return "warp " + std::to_string(warp) + ": " + std::to_string(at_warp) + " lanes at a warp barrier, " +
         std::to_string(at_block) + " at __syncthreads, " + std::to_string(done) + " exited";
}

// Which suspended threads may run next: a warp whose 32 lanes all wait at the same warp-level
// barrier, else (nothing else can move) the whole block when every thread waits at __syncthreads.
// Returns false with b.error set when the block can never proceed.
bool release(Block& b, std::vector<uint32_t>& runnable) {
  const int n = (int)b.threads.size();
  int done = 0, at_block = 0;
  for (int w = 0; w * kWarp < n; ++w) {
    const int lo = w * kWarp, hi = std::min(n, lo + kWarp);
    int at_warp = 0;
    for (int i = lo; i < hi; ++i) at_warp += b.threads[i].state == State::kAtWarpBarrier;
    if (at_warp == 0) continue;
    bool same = at_warp == kWarp;
    for (int i = lo; same && i < hi; ++i) {
      same = b.threads[i].warp_wait == b.threads[lo].warp_wait &&
             b.threads[i].shuffles == b.threads[lo].shuffles;
    }
    if (same) {
      for (int i = lo; i < hi; ++i) {
        b.threads[i].state = State::kRunnable;
        runnable.push_back((uint32_t)i);
      }
    }
  }
  if (!runnable.empty()) return true;
  for (const Thread& t : b.threads) {
    done += t.state == State::kDone;
    at_block += t.state == State::kAtBlockBarrier;
  }
  if (done == n) return true;
  if (at_block == n) {
    for (uint32_t i = 0; i < (uint32_t)n; ++i) {
      b.threads[i].state = State::kRunnable;
      runnable.push_back(i);
    }
    return true;
  }
  // Stuck: name the first warp that holds a waiting thread.
  std::string what = at_block > 0 && at_block + done == n
                         ? "__syncthreads reached by " + std::to_string(at_block) + " of " + std::to_string(n) +
                               " threads (the others exited)"
                         : "threads wait at different barriers";
  for (int w = 0; w * kWarp < n; ++w) {
    bool waiting = false;
    for (int i = w * kWarp; i < std::min(n, (w + 1) * kWarp); ++i) {
      waiting |= b.threads[i].state == State::kAtWarpBarrier;
    }
    if (waiting) {
      what += "; " + describe_warp(b, w);
      break;
    }
  }
  b.error = what;
  return false;
}

}  // namespace

void block_barrier() { suspend(State::kAtBlockBarrier); }

void warp_barrier(unsigned mask) {
  if (mask != 0xffffffffu) fail("__syncwarp with a partial mask is not implemented");
  t_block.current->warp_wait = WarpWait::kSyncwarp;
  suspend(State::kAtWarpBarrier);
}

uint64_t warp_exchange_xor(unsigned mask, uint64_t bits, int lane_mask, int width) {
  if (mask != 0xffffffffu) fail("__shfl_xor_sync with a partial mask is not implemented");
  if (width != kWarp) fail("__shfl_xor_sync with width != 32 is not implemented");
  Block& b = t_block;
  Thread& me = *b.current;
  const int lin = linear(me);
  const int warp = lin / kWarp, lane = lin % kWarp;
  std::vector<uint64_t>& slots = b.slots[me.shuffles & 1];
  slots[warp * kWarp + lane] = bits;
  me.warp_wait = WarpWait::kShuffle;
  suspend(State::kAtWarpBarrier);  // every lane has published
  ++me.shuffles;
  // The next exchange writes the other array, so a lane that runs ahead cannot overwrite a value
  // its partner has not read yet; the one after that waits for this one's barrier first.
  return slots[warp * kWarp + ((lane ^ lane_mask) & (kWarp - 1))];
}

std::string run_block(const dim3& grid, const dim3& block, const uint3& block_idx, size_t dynamic_smem,
                      const Order& order, void (*body)(void*), void* ctx) {
  Block& b = t_block;
  g_grid_dim = grid;
  g_block_dim = block;
  g_block_idx = block_idx;
  const int n = (int)(block.x * block.y * block.z);
  while ((int)b.stacks.size() < n) b.stacks.push_back(std::make_unique<FiberStack>());
  b.threads.assign(n, Thread{});
  const int warps = (n + kWarp - 1) / kWarp;
  b.slots[0].assign(warps * kWarp, 0);
  b.slots[1].assign(warps * kWarp, 0);
  b.body = body;
  b.ctx = ctx;
  b.error.clear();
  // Shared memory starts as garbage on a GPU: NaN bytes here, so a read before a write shows.
  memset(dynamic_shared_memory, 0xff, dynamic_smem);

  std::vector<uint32_t> runnable(n);
  for (int i = 0; i < n; ++i) {
    Thread& t = b.threads[i];
    t.idx = make_uint3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
    t.sp = b.stacks[i]->initial_sp(&enter_thread);
    runnable[i] = (uint32_t)i;
  }
  uint64_t phase = 0;
  while (!runnable.empty()) {
    arrange(order, (uint64_t)block_idx.x * 1000003u + block_idx.y * 7919u + block_idx.z * 131u + phase++,
            runnable.data(), runnable.size());
    for (uint32_t i : runnable) {
      b.current = &b.threads[i];
      g_thread_idx = b.current->idx;
      cuda_on_cpu_switch(&b.scheduler_sp, b.current->sp);
      if (!b.error.empty()) return b.error;
    }
    runnable.clear();
    if (!release(b, runnable)) return b.error;
  }
  return "";
}

}  // namespace cuda_on_cpu
