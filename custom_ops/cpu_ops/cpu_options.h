// The CPU ops' run-time options: what fastdeploy/envs.py read at start-up, handed to each op library
// once by its loader (fd_cpu_set_options, right after the library loads, before any op runs) and again
// only where a measurement varies one between calls. No op reads the environment.
#pragma once

namespace fd_cpu {

struct CpuOptions {
  int attn_threads = 0;            // FD_CPU_ATTN_NUM_THREADS: attention pass 3's threads (0: every usable CPU)
  int pool_spin_us = 1000;         // FD_CPU_POOL_SPIN_US: a helper's polling before it sleeps (read at first use)
  int linear_isa = 0;              // FD_CPU_LINEAR_ISA: 0 the CPU's best tiles, 1 avx2, 2 generic (first use)
  int attn_generic = 0;            // FD_CPU_ATTN_ISA=generic: the portable attention kernels (first use)
  int kv_key_rotation = 1;         // FD_KV_QUANT_ROTATION: int8 / int4 keys stored rotated (the page rule)
  int kv_value_rotation = 0;       // FD_KV_QUANT_ROTATE_VALUES: values rotated too (a measurement knob)
};

inline CpuOptions& cpu_options() {
  static CpuOptions options;
  return options;
}

}  // namespace fd_cpu

// values: the CpuOptions fields in order; count of them given (fewer: the rest keep their values).
extern "C" __attribute__((visibility("default"), used)) inline void fd_cpu_set_options(const int* values,
                                                                                      int count) {
  int* fields[] = {&fd_cpu::cpu_options().attn_threads, &fd_cpu::cpu_options().pool_spin_us,
                   &fd_cpu::cpu_options().linear_isa, &fd_cpu::cpu_options().attn_generic,
                   &fd_cpu::cpu_options().kv_key_rotation, &fd_cpu::cpu_options().kv_value_rotation};
  for (int i = 0; i < count && i < int(sizeof(fields) / sizeof(fields[0])); ++i) *fields[i] = values[i];
}
