// "Device" memory: host allocations, 256-byte aligned like cudaMalloc's, registered so a launch can
// snapshot and compare everything a kernel may write (the race check in launch.cpp).
#pragma once

#include <stddef.h>

#include <functional>

namespace cuda_on_cpu {

void* device_alloc(size_t bytes);
bool device_free(void* p);  // false: not an allocation of device_alloc
// Calls fn(ptr, bytes) for every live allocation, in address order, under the registry's lock.
void for_each_allocation(const std::function<void(unsigned char*, size_t)>& fn);

}  // namespace cuda_on_cpu
