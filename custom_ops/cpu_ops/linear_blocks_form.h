// A GGUF-block weight as the dense-layer kernels read it (linear_blocks.cc has the layout), and what
// every instruction set's kernels share: the portable weight rule, the block forms as compile-time
// flags, the prefetch distance of a one-row product.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "block_tables.h"
#include "linear_tiles.h"

namespace fd_cpu {
namespace linear {

constexpr int kU4Inputs = 8;         // inputs per u4 word
constexpr int kU4ChunkBytes = 128;   // one panel's 32 words

struct Blocks {
  const uint8_t* q = nullptr;  // u4 words or i8 bytes
  const void* scale = nullptr;   // float32, or float16 bits (half)
  const void* offset = nullptr;  // u4 only, the same type
  bool u4 = true;
  bool half = false;
  int64_t k_dim = 0;
  int group = 32;

  int64_t q_stride() const { return k_dim * (u4 ? 16 : 32); }  // bytes per panel
  int64_t s_stride() const { return (k_dim / group) * kPanel; }  // scales per panel
};

// The weight of panel column j at k, portable: the same two roundings (multiply, then add) as
// numpy's dequantize and the vector decodes.
inline float weight_at(const Blocks& b, int64_t p, int64_t k, int j) {
  const int64_t s = p * b.s_stride() + (k / b.group) * kPanel + j;
  if (b.u4) {
    uint32_t word;
    std::memcpy(&word, b.q + p * b.q_stride() + (k / kU4Inputs) * kU4ChunkBytes + j * 4, 4);
    const float q = float((word >> (4 * (k % kU4Inputs))) & 15);
    const float scaled = table_at(b.scale, b.half, s) * q;
    return scaled + table_at(b.offset, b.half, s);
  }
  const int8_t q = int8_t(b.q[p * b.q_stride() + k * 32 + j]);
  return table_at(b.scale, b.half, s) * float(q);
}

// A one-row product's u4 words are asked for this far ahead of their use (16 chunks of 8 inputs; past a
// panel's end, the next panel's start, which the next pair reads). The hardware prefetchers alone left
// the two streams of a pair ~5% slower (one request's decode, in-process A/B, medians of paired
// rounds: +2.6 to +9% at 512 to 4096 bytes, 2048 best); an i8 weight's (the LM head's) showed nothing.
constexpr int kPrefetchBytes = 2048;

template <int LINES>
__attribute__((always_inline)) inline void prefetch_lines(const uint8_t* p) {
  for (int i = 0; i < LINES; ++i) _mm_prefetch(reinterpret_cast<const char*>(p + 64 * i), _MM_HINT_T0);
}

// The block form as compile-time flags: fn(U4, HALF, ONE_ROUNDING) with std::bool_constant arguments.
template <typename Fn>
void with_form(const Blocks& b, bool one_rounding, Fn fn) {
  using T = std::true_type;
  using F = std::false_type;
  if (!b.u4) return b.half ? fn(F{}, T{}, F{}) : fn(F{}, F{}, F{});
  if (one_rounding) return b.half ? fn(T{}, T{}, T{}) : fn(T{}, F{}, T{});
  b.half ? fn(T{}, T{}, F{}) : fn(T{}, F{}, F{});
}

}  // namespace linear
}  // namespace fd_cpu
