// Scratch buffers the CPU ops keep between calls (thread_local at the call site; a WorkPool's helpers
// get the caller's buffer by address). Grown, never shrunk: std::vector zero-fills whatever a resize
// adds, so resizing to each call's size re-zeroed megabytes per step where the sizes alternate (a
// prefill chunk's four products, ~5 MB a layer; a decode step's attention scratch, ~80 KB a layer).
// No caller reads an element it did not write in the same call.
#pragma once

#include <cstddef>
#include <vector>

namespace fd_cpu {

template <typename T>
T* grown(std::vector<T>& buffer, size_t n) {
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

}  // namespace fd_cpu
