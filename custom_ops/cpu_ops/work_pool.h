// A tiny persistent thread pool for the CPU ops (attention, dense layers, norms).
//
// Why not an OpenMP parallel-for: its closing barrier waits for every thread,
// so on a busy 2-core machine one helper the OS has not scheduled yet stalls
// the whole step for a scheduler tick (measured: a 0.6 ms step became 6.6 ms).
// Here the caller works through the items itself and waits only for items a
// helper has actually claimed; a helper that wakes late finds nothing left.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cpu_options.h"

namespace fd_cpu {

// CPUs this process may run on (respects taskset/cgroup cpusets).
inline int usable_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return CPU_COUNT(&set);
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? int(n) : 1;
}

class WorkPool {
 public:
  // fn(item, worker): worker is in [0, workers); 0 is the calling thread.
  using ItemFn = std::function<void(int64_t item, int worker)>;

  static WorkPool& instance() {
    // Never destroyed: helpers outlive static teardown. One per process even across the attention and
    // GEMM libraries: g++ makes this static a GNU unique symbol, which the loader binds once.
    static WorkPool* pool = new WorkPool();
    return *pool;
  }

  void run(int64_t items, int workers, const ItemFn& fn) {
    std::unique_lock<std::mutex> busy(run_mutex_, std::try_to_lock);
    if (workers <= 1 || items <= 1 || !busy.owns_lock()) {
      // Serial path, also taken by a concurrent caller instead of queueing.
      for (int64_t i = 0; i < items; ++i) fn(i, 0);
      return;
    }
    ensure_helpers(workers - 1);
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->items = items;
    job->workers = workers;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    work_on(*job, 0);
    spin_until([&] { return job->done.load(std::memory_order_acquire) == job->items; });
    std::unique_lock<std::mutex> lock(job->mutex);
    // Every item is claimed by now; wait for the ones helpers still run.
    job->finished.wait(lock, [&] { return job->done.load() == job->items; });
    std::lock_guard<std::mutex> reset(mutex_);
    job_.reset();
  }

 private:
  struct Job {
    const ItemFn* fn = nullptr;
    int64_t items = 0;
    int workers = 0;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mutex;
    std::condition_variable finished;
  };

  WorkPool() = default;

  static void work_on(Job& job, int worker) {
    for (;;) {
      const int64_t i = job.next.fetch_add(1);
      if (i >= job.items) return;
      (*job.fn)(i, worker);
      if (job.done.fetch_add(1) + 1 == job.items) {  // the last item of the job
        std::lock_guard<std::mutex> lock(job.mutex);
        job.finished.notify_all();
      }
    }
  }

  void ensure_helpers(int count) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (owner_pid_ != getpid()) {  // forked child: the parent's helpers do not exist here
      helpers_ = 0;
      owner_pid_ = getpid();
    }
    for (; helpers_ < count; ++helpers_) {
      std::thread([this, id = helpers_ + 1] { helper_loop(id); }).detach();
    }
  }

  // Polls `ready` for up to spin_us(); the caller then blocks on its condition variable, which
  // re-checks the same condition, so whether the poll saw it does not matter.
  template <typename Ready>
  static void spin_until(Ready ready) {
    const auto limit = std::chrono::microseconds(spin_us());
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      for (int i = 0; i < 32; ++i) {
        if (ready()) return;
        cpu_relax();
      }
      if (std::chrono::steady_clock::now() - start >= limit) return;
    }
  }

  static void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
  }

  // How long a helper keeps polling for the next job, and the caller for the helpers' last items,
  // before sleeping on a condition variable: FD_CPU_POOL_SPIN_US microseconds (cpu_options.h; default
  // 1000; 0 sleeps at once). Why spin: on a KVM guest an idle vCPU halts and the host may hand its core to another
  // guest, so a futex wake-up reaches a sleeping helper late and the caller does the layer alone
  // (SmolLM2 decode steps measured ~9% faster at 8 and 32 requests with the helper polling).
  // A decode step runs ~200 pool jobs with tens of microseconds of Python between them; 1 ms
  // bridges those gaps and the host work between steps, and bounds what an idle engine burns.
  static int spin_us() {
    static const int us = std::max(0, cpu_options().pool_spin_us);
    return us;
  }

  void helper_loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Job> job;
      spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; });
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        job = job_;
      }
      if (job && id < job->workers) work_on(*job, id);
    }
  }

  std::mutex run_mutex_;  // one step at a time uses the helpers
  std::mutex mutex_;      // guards job_, generation_, helpers_
  std::condition_variable wake_;
  std::shared_ptr<Job> job_;
  std::atomic<uint64_t> generation_{0};
  int helpers_ = 0;
  pid_t owner_pid_ = getpid();
};

// row_fn(r) for every row r in [0, rows), `rows_per_item` rows to a work
// item, on every usable CPU when `parallel` (small inputs stay on the caller:
// waking a helper costs more than it saves).
template <typename RowFn>
void for_each_row(int64_t rows, int64_t rows_per_item, bool parallel, RowFn row_fn) {
  const int64_t items = (rows + rows_per_item - 1) / rows_per_item;
  WorkPool::instance().run(items, parallel ? usable_cpus() : 1, [&](int64_t item, int) {
    for (int64_t r = item * rows_per_item; r < std::min(rows, (item + 1) * rows_per_item); ++r) row_fn(r);
  });
}

}  // namespace fd_cpu
