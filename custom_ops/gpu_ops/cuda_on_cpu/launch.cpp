// A launch: checks the configuration as a GPU would, then runs the grid's blocks. With more than
// one order configured (cuda_on_cpu_set_orders: the loader passes CUDA_ON_CPU_ORDERS) the launch runs once per
// order from the same memory: every device allocation is snapshot before, restored between runs and
// compared byte for byte after; a difference is a race, reported with the kernel's name
// (cuda_on_cpu_races). The memory keeps the last order's result.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "block_runner.h"
#include "device_memory.h"
#include "dynamic_shared.h"
#include "launch.h"
#include "runtime_state.h"

namespace cuda_on_cpu {
namespace {

std::mutex g_mutex;  // guards the settings and the race report
std::vector<Order> g_orders;
bool g_configured = false;
int g_threads = 1;
std::string g_races;

// "forward,reverse,shuffle:7" -> orders; false on a bad spec.
bool parse_orders(const char* spec, std::vector<Order>* out) {
  std::vector<Order> orders;
  std::string s(spec);
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = s.find(',', start);
    const std::string item = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    Order o;
    if (item == "forward") {
      o.kind = Order::kForward;
    } else if (item == "reverse") {
      o.kind = Order::kReverse;
    } else if (item.rfind("shuffle:", 0) == 0 && item.size() > 8) {
      o.kind = Order::kShuffle;
      o.seed = strtoull(item.c_str() + 8, nullptr, 10);
    } else {
      return false;
    }
    orders.push_back(o);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (orders.empty()) return false;
  *out = orders;
  return true;
}

// The default until a loader sets its own (cuda_on_cpu_set_orders / _set_threads): nothing here reads
// the environment.
void configure_locked() {
  if (g_configured) return;
  g_configured = true;
  parse_orders("forward,reverse", &g_orders);
}

std::string dims(const dim3& d) {
  return "(" + std::to_string(d.x) + ", " + std::to_string(d.y) + ", " + std::to_string(d.z) + ")";
}

std::string where(const LaunchSite& site) {
  const char* slash = strrchr(site.file, '/');
  return std::string(site.name) + " <<<" + dims(site.grid) + ", " + dims(site.block) + ", " +
         std::to_string(site.dynamic_smem) + ">>> at " + (slash ? slash + 1 : site.file) + ":" +
         std::to_string(site.line) + " in " + site.launcher;
}

std::string check_config(const LaunchSite& s) {
  const unsigned long long threads = (unsigned long long)s.block.x * s.block.y * s.block.z;
  if (threads == 0 || threads > 1024 || s.block.z > 64) return "block of " + dims(s.block) + " threads";
  if (s.grid.x == 0 || s.grid.y == 0 || s.grid.z == 0 || s.grid.x > 0x7fffffffu || s.grid.y > 65535 ||
      s.grid.z > 65535) {
    return "grid of " + dims(s.grid) + " blocks";
  }
  if (s.dynamic_smem > max_dynamic_smem(s.kernel)) {
    return std::to_string(s.dynamic_smem) + " bytes of dynamic shared memory, above the kernel's limit of " +
           std::to_string(max_dynamic_smem(s.kernel)) + " (cudaFuncSetAttribute)";
  }
  return "";
}

// Runs every block in `order`'s sequence, on `threads` OS threads; "" or the first failure.
std::string run_grid(const LaunchSite& s, const Order& order, int threads, void (*body)(void*), void* ctx) {
  const size_t n = (size_t)s.grid.x * s.grid.y * s.grid.z;
  std::vector<uint32_t> blocks(n);
  for (size_t i = 0; i < n; ++i) blocks[i] = (uint32_t)i;
  arrange(order, 0x5eed, blocks.data(), n);
  std::atomic<size_t> next{0};
  std::mutex failure_mutex;
  std::string failure;
  auto worker = [&]() {
    for (size_t k; (k = next.fetch_add(1)) < n;) {
      const uint32_t i = blocks[k];
      const uint3 idx = make_uint3(i % s.grid.x, (i / s.grid.x) % s.grid.y, i / (s.grid.x * s.grid.y));
      const std::string err = run_block(s.grid, s.block, idx, s.dynamic_smem, order, body, ctx);
      if (!err.empty()) {
        std::lock_guard<std::mutex> lock(failure_mutex);
        if (failure.empty()) failure = err + " in block " + dims(dim3(idx.x, idx.y, idx.z));
        next = n;
      }
    }
  };
  if (threads <= 1 || n <= 1) {
    worker();
  } else {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads && (size_t)t < n; ++t) pool.emplace_back(worker);
    for (auto& t : pool) t.join();
  }
  return failure;
}

struct Snapshot {
  std::vector<std::vector<unsigned char>> bytes;
  void take() {
    bytes.clear();
    for_each_allocation([&](unsigned char* p, size_t n) { bytes.emplace_back(p, p + n); });
  }
  void restore() const {
    size_t i = 0;
    for_each_allocation([&](unsigned char* p, size_t n) { memcpy(p, bytes[i++].data(), n); });
  }
  // "" when memory equals the snapshot, else where it first differs.
  std::string differs() const {
    std::string what;
    size_t i = 0;
    for_each_allocation([&](unsigned char* p, size_t n) {
      const std::vector<unsigned char>& b = bytes[i++];
      if (!what.empty() || memcmp(p, b.data(), n) == 0) return;
      size_t off = 0;
      while (p[off] == b[off]) ++off;
      what = "a " + std::to_string(n) + "-byte allocation differs first at byte " + std::to_string(off);
    });
    return what;
  }
};

}  // namespace

void run_kernel(const LaunchSite& site, void (*body)(void*), void* ctx) {
  std::vector<Order> orders;
  int threads;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    configure_locked();
    orders = g_orders;
    threads = g_threads;
  }
  const std::string bad = check_config(site);
  if (!bad.empty()) {
    set_launch_error(cudaErrorInvalidConfiguration, "cuda_on_cpu: invalid launch of " + where(site) + ": " + bad);
    return;
  }
  Snapshot before, first;
  if (orders.size() > 1) before.take();
  std::string failure;
  for (size_t k = 0; k < orders.size(); ++k) {
    if (k > 0) {
      if (k == 1) first.take();
      before.restore();
    }
    const std::string err = run_grid(site, orders[k], threads, body, ctx);
    if (k == 0) failure = err;
    std::string race;
    if (k > 0 && err != failure) {
      race = "order '" + orders[k].label() + "' " + (err.empty() ? "succeeds" : "fails: " + err) + " where '" +
             orders[0].label() + "' " + (failure.empty() ? "succeeds" : "fails: " + failure);
    } else if (k > 0 && failure.empty()) {
      const std::string diff = first.differs();
      if (!diff.empty()) race = "orders '" + orders[0].label() + "' and '" + orders[k].label() + "' leave " + diff;
    }
    if (!race.empty()) {
      std::lock_guard<std::mutex> lock(g_mutex);
      g_races += "race in " + where(site) + ": " + race + "\n";
    }
  }
  if (!failure.empty()) {
    set_launch_error(cudaErrorLaunchFailure, "cuda_on_cpu: " + failure + " of " + where(site));
  }
}

}  // namespace cuda_on_cpu

using namespace cuda_on_cpu;

extern "C" {

// Orders every later launch runs under, e.g. "forward,reverse,shuffle:7"; 0 ok, -1 bad spec.
__attribute__((visibility("default"))) int cuda_on_cpu_set_orders(const char* spec) {
  std::lock_guard<std::mutex> lock(g_mutex);
  configure_locked();
  return parse_orders(spec, &g_orders) ? 0 : -1;
}

// OS threads that run a launch's blocks concurrently (1: one after another).
__attribute__((visibility("default"))) void cuda_on_cpu_set_threads(int threads) {
  std::lock_guard<std::mutex> lock(g_mutex);
  configure_locked();
  g_threads = threads > 0 ? threads : 1;
}

// The races found since the last clear, one line each ("" when none). Valid until the next call.
__attribute__((visibility("default"))) const char* cuda_on_cpu_races(void) {
  thread_local std::string copy;
  std::lock_guard<std::mutex> lock(g_mutex);
  copy = g_races;
  return copy.c_str();
}

__attribute__((visibility("default"))) void cuda_on_cpu_clear_races(void) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_races.clear();
}

}  // extern "C"
