// Device atomics on host memory. Blocks may run on several OS threads at once, so these are real
// atomic read-modify-writes, sequentially consistent (at least as strong as the GPU's).
#pragma once

template <typename T>
inline T cuda_on_cpu_atomic_cas(T* address, T compare, T val) {
  __atomic_compare_exchange_n(address, &compare, val, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return compare;  // the old value: unchanged on success, the value found on failure
}

inline int atomicCAS(int* address, int compare, int val) { return cuda_on_cpu_atomic_cas(address, compare, val); }
inline unsigned atomicCAS(unsigned* address, unsigned compare, unsigned val) {
  return cuda_on_cpu_atomic_cas(address, compare, val);
}
inline unsigned long long atomicCAS(unsigned long long* address, unsigned long long compare,
                                    unsigned long long val) {
  return cuda_on_cpu_atomic_cas(address, compare, val);
}
