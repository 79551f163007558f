// Which instruction set every CPU op's kernels run: the CPU's best of AVX-512, AVX2 + FMA and portable
// C++, chosen once per process, capped by FD_CPU_LINEAR_ISA (avx2 or generic: cpu_options.h) so that a
// machine with AVX-512 can run and measure the AVX2 kernels, and the tests can compare all three. Every
// kernel gives the same bits on each of them (its arithmetic is a fixed order of IEEE operations), so the
// tokens of a greedy request do not depend on the machine.
#pragma once

#include "cpu_options.h"

namespace fd_cpu {

// The numbering is the cpu_kernel_isas op's answer (cpu_kernels.kernel_isas names it).
enum class Isa { kAvx512 = 0, kAvx2 = 1, kScalar = 2 };

inline const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "generic";
}

// AVX-512F on this CPU (whatever the cap).
inline bool cpu_has_avx512f() {
  static const bool has = [] {
    __builtin_cpu_init();
    return bool(__builtin_cpu_supports("avx512f"));
  }();
  return has;
}

// AVX2 with FMA and F16C (every CPU with AVX2 has the other two; the kernels use all three).
inline bool cpu_has_avx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return bool(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"));
  }();
  return has;
}

inline Isa detect_isa() {
  const int cap = cpu_options().linear_isa;  // 0: none, 1: avx2, 2: generic
  if (cap == 0 && cpu_has_avx512f()) return Isa::kAvx512;
  if (cap <= 1 && cpu_has_avx2()) return Isa::kAvx2;
  return Isa::kScalar;
}

// The instruction set of this process's kernels, read once at the first op call: FD_CPU_LINEAR_ISA
// cannot change under a running model.
inline Isa kernels_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

}  // namespace fd_cpu
