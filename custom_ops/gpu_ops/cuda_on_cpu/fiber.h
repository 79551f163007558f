// Fibers: a stack and a saved stack pointer, switched to and from by hand (no syscall per switch,
// unlike swapcontext, which saves the signal mask). A block's threads are fibers of the OS thread
// that runs the block; the block runner switches between them at barriers.
#pragma once

#include <stddef.h>

namespace cuda_on_cpu {

class FiberStack {
 public:
  FiberStack();
  ~FiberStack();
  FiberStack(const FiberStack&) = delete;
  FiberStack& operator=(const FiberStack&) = delete;
  // The stack pointer a fiber starts from: its first switch_to enters `entry` (which must never
  // return; it switches away for the last time instead).
  void* initial_sp(void (*entry)());

 private:
  unsigned char* base_;  // guard page, then the usable stack
};

// Saves the current context's stack pointer in *save and resumes the context saved in `to`.
extern "C" void cuda_on_cpu_switch(void** save, void* to);

}  // namespace cuda_on_cpu
