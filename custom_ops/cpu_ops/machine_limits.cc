// What the benchmarks print beside their numbers: which kernels the CPU ops chose on this machine, and
// the machine's memory read bandwidth, the limit a decode step's weight read runs into.
//
// The bandwidth is a streaming read of a buffer several times the last-level cache, every usable CPU
// reading its own contiguous share with the widest loads the machine has (the compiler vectorises the
// plain loop), best of `repeats` passes: what a kernel that only reads could reach. numpy's sum, which
// the benchmarks used before, adds as it reads and measured 9 GB/s where this reads 13-16 (2-core AMD
// EPYC guest).

#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_isa.h"
#include "linear_blocks.h"
#include "paddle/extension.h"
#include "work_pool.h"

namespace {

// [dense and attention kernels' instruction set (cpu_isa.h), int8-activation kernel (linear_blocks.h)].
std::vector<paddle::Tensor> CpuKernelIsas(const paddle::Tensor& any) {
  paddle::Tensor out = paddle::empty({2}, paddle::DataType::INT32, any.place());
  out.data<int32_t>()[0] = int32_t(fd_cpu::kernels_isa());
  out.data<int32_t>()[1] = int32_t(fd_cpu::linear::int8_kernels());
  return {out};
}

// The sum of the 64-bit words [begin, end), in 8 independent lanes the compiler keeps in vector registers.
uint64_t read_words(const uint64_t* begin, const uint64_t* end) {
  uint64_t lanes[8] = {0};
  for (const uint64_t* p = begin; p + 8 <= end; p += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += p[l];
  uint64_t sum = 0;
  for (int l = 0; l < 8; ++l) sum += lanes[l];
  return sum;
}

// GB/s of the best of `repeats` reads of a `bytes` buffer by every usable CPU (`any` only places the result).
std::vector<paddle::Tensor> MemoryReadGbs(const paddle::Tensor& any, int64_t bytes, int64_t repeats) {
  PD_CHECK(bytes >= (int64_t(1) << 20) && repeats >= 1, "memory_read_gbs: at least 1 MiB and one repeat");
  const int workers = fd_cpu::usable_cpus();
  const int64_t words = bytes / 8 / (8 * workers) * (8 * workers);  // whole 8-word runs per worker
  std::vector<uint64_t> buffer(size_t(words), 1);                     // written once: every page is real
  std::vector<uint64_t> sums(size_t(workers), 0);
  double best = 0.0;
  for (int64_t r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fd_cpu::WorkPool::instance().run(workers, workers, [&](int64_t w, int) {
      const uint64_t* share = buffer.data() + w * (words / workers);
      sums[size_t(w)] += read_words(share, share + words / workers);
    });
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(words) * 8.0 / seconds / 1e9);
  }
  uint64_t total = 0;  // used, so the reads are not optimised away
  for (uint64_t s : sums) total += s;
  PD_CHECK(total == uint64_t(words) * uint64_t(repeats), "memory_read_gbs: the buffer read back wrong");
  paddle::Tensor out = paddle::empty({1}, paddle::DataType::FLOAT32, any.place());
  out.data<float>()[0] = float(best);
  return {out};
}

}  // namespace

PD_BUILD_OP(cpu_kernel_isas)
    .Inputs({"any"})
    .Outputs({"isas"})
    .SetKernelFn(PD_KERNEL(CpuKernelIsas));

PD_BUILD_OP(memory_read_gbs)
    .Inputs({"any"})
    .Outputs({"gbs"})
    .Attrs({"bytes: int64_t", "repeats: int64_t"})
    .SetKernelFn(PD_KERNEL(MemoryReadGbs));
