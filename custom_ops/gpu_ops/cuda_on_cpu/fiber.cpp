#include "fiber.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

namespace cuda_on_cpu {

namespace {
// The kernels keep little on the stack (their arrays are registers on a GPU); 256 KiB leaves room
// for libc calls. A PROT_NONE page below each stack turns an overflow into a fault, not corruption.
constexpr size_t kStackBytes = 256 * 1024;
size_t page_bytes() { return (size_t)sysconf(_SC_PAGESIZE); }
}  // namespace

FiberStack::FiberStack() {
  const size_t guard = page_bytes();
  void* p = mmap(nullptr, guard + kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) {
    perror("cuda_on_cpu: fiber stack");
    abort();
  }
  mprotect(p, guard, PROT_NONE);
  base_ = static_cast<unsigned char*>(p);
}

FiberStack::~FiberStack() { munmap(base_, page_bytes() + kStackBytes); }

#if defined(__x86_64__)
// Callee-saved registers (System V) are pushed on the old stack, the stack pointer swapped, and
// the new context's registers popped; `ret` resumes it.
asm(R"(
  .text
  .globl cuda_on_cpu_switch
  .hidden cuda_on_cpu_switch
  .type cuda_on_cpu_switch, @function
cuda_on_cpu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuda_on_cpu_switch, .-cuda_on_cpu_switch
)");

void* FiberStack::initial_sp(void (*entry)()) {
  // Top, 16-byte aligned: [top-8] a null return address for entry, [top-16] entry (popped by the
  // switch's ret, leaving rsp = top-8 as after a call), then six zeroed callee-saved registers.
  uintptr_t top = reinterpret_cast<uintptr_t>(base_ + page_bytes() + kStackBytes) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;
  *--sp = reinterpret_cast<uint64_t>(entry);
  for (int i = 0; i < 6; ++i) *--sp = 0;
  return sp;
}
#else
#error "cuda_on_cpu: fibers are implemented for x86-64 only (fiber.cpp: cuda_on_cpu_switch)"
#endif

}  // namespace cuda_on_cpu
