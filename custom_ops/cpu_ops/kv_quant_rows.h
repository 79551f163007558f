// The CPU op's quantized pages as the attention step reads and writes them: the element types of a
// lane, the rotation knobs, the portable read of an e4m3 byte. The vector kernels are in
// kv_quant_rows_avx512.h and kv_quant_rows_avx2.h: a page's rows dequantized into the tile scratch
// once per page visit, and a written row rotated (int8 / int4 keys and the queries) and quantized.
// Every operation there is exact or one correctly rounded IEEE operation, the same ones in the same
// order as the scalar rule of kv_quant.h (a max is exact in any order; a butterfly's a + b and a - b
// are the same sums), so they give the bits of the portable code in attention_math.h.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu_options.h"
#include "kv_quant.h"

namespace fd_cpu {

// A byte of an int4 lane (cache dtype uint8): two codes, the even element in the low nibble
// (kv_quant.h). A distinct type so the cache's element type picks the read and the write; a row of
// d values is d / 2 of them.
struct Int4Pair {
  uint8_t bits;
};

// FD_KV_QUANT_ROTATION=0 (cpu_options.h) stores int8 / int4 keys unrotated (and leaves the queries
// alone): a measurement knob of the CPU op only, to show what the rotation buys (docs/swa_quality.md);
// pages written with it are not the page rule's bytes, which the CUDA kernels read. Read per step (an
// option, set between calls), so one process can measure both.
inline bool key_rotation_enabled() { return cpu_options().kv_key_rotation != 0; }

// FD_KV_QUANT_ROTATE_VALUES=1 stores int8 / int4 values rotated as the keys are (v' = H v) and
// rotates each output row back (out = H out' / d): a measurement knob of the CPU op only, to show
// what rotating the values too would buy; off by default, and not the page rule's bytes.
inline bool value_rotation_enabled() { return cpu_options().kv_value_rotation != 0; }

// The rotations a step's pages use: the page rule's (rotated int8 / int4 keys) with the two measurement
// knobs above applied; the write pass and the attention pass both ask here, so they always agree. The
// key lane's format decides (k8v4: int8 keys rotated, int4 values as they are unless the knob asks).
struct PageRotation {
  bool keys;
  bool values;
};

inline PageRotation page_rotation(fd_kvq::Format key_format, int head_dim) {
  const bool keys = fd_kvq::rotates_keys(key_format, head_dim) && key_rotation_enabled();
  return {keys, keys && value_rotation_enabled()};
}

// Cache elements per row of d values.
template <typename CacheT>
constexpr int64_t row_elements(int d) {
  return d;
}
template <>
constexpr int64_t row_elements<Int4Pair>(int d) {
  return d / 2;
}

// The exact value of every e4m3fn byte (the portable read).
struct E4M3Table {
  float value[256];
  E4M3Table() {
    for (int b = 0; b < 256; ++b) value[b] = fd_kvq::e4m3_to_float(uint8_t(b));
  }
};

}  // namespace fd_cpu
