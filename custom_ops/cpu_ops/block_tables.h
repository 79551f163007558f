// A GGUF-block weight's scale and offset tables as the CPU kernels read them: float32, or float16
// where every value is one (Q4_1 and Q8_0 store theirs as halves: 2 bytes less per table entry to
// read per block). Widening a half to float32 is exact, so either type gives the same bits.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace fd_cpu {
namespace linear {

// An IEEE half's exact float32 value (normal, subnormal, zero, inf / nan).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: man * 2^-24, exact in float32
    float v = float(man) * 5.9604644775390625e-8f;
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// Entry i of a table, as float32.
inline float table_at(const void* table, bool half, int64_t i) {
  return half ? half_to_float(static_cast<const uint16_t*>(table)[i]) : static_cast<const float*>(table)[i];
}

// 16 entries from i as float32 (float16: vcvtph2ps, exact).
template <bool HALF>
__attribute__((target("avx512f"), always_inline)) inline __m512 load_table16(const void* table, int64_t i) {
  if constexpr (HALF)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(table) + i)));
  return _mm512_loadu_ps(static_cast<const float*>(table) + i);
}

// 8 entries from i as float32 (float16: vcvtph2ps, exact).
template <bool HALF>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 load_table8(const void* table, int64_t i) {
  if constexpr (HALF)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(table) + i)));
  return _mm256_loadu_ps(static_cast<const float*>(table) + i);
}

}  // namespace linear
}  // namespace fd_cpu
