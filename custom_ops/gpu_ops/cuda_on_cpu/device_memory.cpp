#include "device_memory.h"

#include <stdlib.h>

#include <map>
#include <mutex>

namespace cuda_on_cpu {
namespace {
std::mutex g_mutex;
std::map<unsigned char*, size_t>& registry() {
  static std::map<unsigned char*, size_t> allocations;
  return allocations;
}
}  // namespace

void* device_alloc(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, 256, bytes > 0 ? bytes : 1) != 0) return nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  registry()[static_cast<unsigned char*>(p)] = bytes;
  return p;
}

bool device_free(void* p) {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (registry().erase(static_cast<unsigned char*>(p)) == 0) return false;
  }
  free(p);
  return true;
}

void for_each_allocation(const std::function<void(unsigned char*, size_t)>& fn) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto& [ptr, bytes] : registry()) fn(ptr, bytes);
}

}  // namespace cuda_on_cpu
