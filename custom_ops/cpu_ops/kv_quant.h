// Quantized KV pages (int8, block_wise_fp8, block_wise_int4 and k8v4): the one rule for writing a token's
// K or V head vector as 8-bit (or 4-bit) codes with one float32 scale, and for reading it back. The CPU op and the CUDA
// kernels both include this header (the CUDA build has cpu_ops/ on its include path), so the two
// devices write the same bytes and read the same floats.
//
// Write: scale = absmax / Q (Q = 127 for int8, 448 for e4m3, 7 for int4), computed per token and KV head at
// the moment the row is written (dynamic, nothing calibrated); value = x / scale rounded to the
// nearest representable code, ties to even, saturating at +-Q. A zero vector gets scale 0 and
// codes 0 (no division by zero). Read: code's exact value * scale, one float rounding. Every step
// here is exact or correctly rounded, so any ISA gives the same bits.
//
// int8 keys are stored rotated: k' = H k, H the (unnormalised) Walsh-Hadamard matrix of order
// head_dim (a power of two), and the op rotates each query the same way, q' = H q / head_dim, so
// q' . k' = q . k (H^T H = head_dim I; the 1 / head_dim is a power of two, exact). A key's few
// outlier channels (RoPE'd keys have them; Gemma 3's k_norm weights make them 15x the median) would
// otherwise set the one scale of the row and leave the other channels a handful of int8 steps; the
// rotation spreads every channel over all of them (on SmolLM2 the mean KL to float32 pages drops
// 3.5x, on Gemma 3 10x). e4m3 keeps its own relative precision per value and gains nothing
// (Gemma 3 loses), so e4m3 keys and all values are stored as they are.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define FD_KVQ_FN __host__ __device__ __forceinline__
#else
#define FD_KVQ_FN inline
#endif

namespace fd_kvq {

// The formats of one lane (the K or the V tensor of a layer); its dtype says which one it holds.
enum Format { kFloat = 0, kInt8 = 1, kE4M3 = 2, kInt4 = 3 };

// A layer's page format names the format of each lane. kFloat .. kInt4 store keys and values alike;
// kK8V4 (vLLM TurboQuant's k8v4) stores keys as int8 and values as int4: a key's outlier channels
// need the bits (they set the row's one scale), values average over many rows in p . v and do not.
// A row of K + V then costs (head_dim + 4) + (head_dim / 2 + 4) bytes.
constexpr int kK8V4 = 4;

struct LaneFormats {
  Format key;
  Format value;
};

FD_KVQ_FN LaneFormats lane_formats(int page_format) {
  if (page_format == kK8V4) return {kInt8, kInt4};
  return {static_cast<Format>(page_format), static_cast<Format>(page_format)};
}

// The page format whose lanes are (key, value), or -1 for a pair no format stores.
FD_KVQ_FN int page_format_of(Format key, Format value) {
  if (key == value) return key;
  return key == kInt8 && value == kInt4 ? kK8V4 : -1;
}

constexpr float kInt8Max = 127.f;
constexpr float kE4M3Max = 448.f;  // largest finite e4m3fn (0x7E); 0x7F is NaN, there is no inf
constexpr float kInt4Max = 7.f;

// An e4m3fn byte, a distinct type so the cache's element type picks the conversion.
struct e4m3 {
  uint8_t bits;
};

FD_KVQ_FN float format_max(Format f) { return f == kInt8 ? kInt8Max : f == kInt4 ? kInt4Max : kE4M3Max; }

// absmax / Q; 0 for a zero vector.
FD_KVQ_FN float scale_for(float absmax, Format f) { return absmax / format_max(f); }

FD_KVQ_FN int8_t int8_code(float x, float scale) {
  if (!(scale > 0.f)) return 0;
  const float y = fminf(fmaxf(rintf(x / scale), -kInt8Max), kInt8Max);  // |y| may round past 127
  return static_cast<int8_t>(y);
}

// The int4 code of x: nearest-even of x / scale clamped to +-7 (0 for a zero row's scale).
FD_KVQ_FN int int4_code(float x, float scale) {
  if (!(scale > 0.f)) return 0;
  return static_cast<int>(fminf(fmaxf(rintf(x / scale), -kInt4Max), kInt4Max));
}

// Two int4 codes in one byte (lo = the even element) and back, with sign extension.
FD_KVQ_FN uint8_t int4_pack(int lo, int hi) {
  return static_cast<uint8_t>((lo & 0xF) | ((hi & 0xF) << 4));
}
FD_KVQ_FN int int4_low(uint8_t b) { return static_cast<int>(static_cast<int8_t>(static_cast<uint8_t>(b << 4))) >> 4; }
FD_KVQ_FN int int4_high(uint8_t b) { return static_cast<int>(static_cast<int8_t>(b)) >> 4; }

FD_KVQ_FN uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

// y (already divided by the scale) as e4m3fn: nearest, ties to even, saturating at +-448.
FD_KVQ_FN uint8_t e4m3_from_float(float y) {
  const uint8_t sign = static_cast<uint8_t>((float_bits(y) >> 24) & 0x80u);
  const float a = fabsf(y);
  if (isnan(y)) return static_cast<uint8_t>(sign | 0x7Fu);
  if (a >= kE4M3Max) return static_cast<uint8_t>(sign | 0x7Eu);
  if (a < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9; 8 steps is the smallest normal, code 0x08
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(rintf(a * 512.f)));
  }
  uint32_t u = float_bits(a);
  u += 0x7FFFFu + ((u >> 20) & 1u);  // round the 23-bit mantissa to 3 bits, ties to even
  const uint32_t code = ((((u >> 23) - 127u + 7u) << 3) | ((u >> 20) & 7u));
  return static_cast<uint8_t>(sign | (code > 0x7Eu ? 0x7Eu : code));
}

FD_KVQ_FN e4m3 e4m3_code(float x, float scale) {
  return e4m3{scale > 0.f ? e4m3_from_float(x / scale) : uint8_t(0)};
}

// The exact value of an e4m3fn byte.
FD_KVQ_FN float e4m3_to_float(uint8_t b) {
  const int e = (b >> 3) & 0xF;
  const int m = b & 7;
  float v;
  if (e == 15 && m == 7) {
    v = NAN;
  } else if (e == 0) {
    v = float(m) * 0.001953125f;  // m * 2^-9
  } else {
    v = ldexpf(1.f + float(m) * 0.125f, e - 7);
  }
  return (b & 0x80) ? -v : v;
}

// One token's head vector x[0..d) into d codes and its scale.
template <typename Code>
FD_KVQ_FN Code code_of(float x, float scale);

template <>
FD_KVQ_FN int8_t code_of<int8_t>(float x, float scale) { return int8_code(x, scale); }

template <>
FD_KVQ_FN e4m3 code_of<e4m3>(float x, float scale) { return e4m3_code(x, scale); }

template <typename Code>
FD_KVQ_FN Format format_of();

template <>
FD_KVQ_FN Format format_of<int8_t>() { return kInt8; }

template <>
FD_KVQ_FN Format format_of<e4m3>() { return kE4M3; }

template <typename Code>
FD_KVQ_FN void quantize_row(const float* x, int d, Code* codes, float* scale) {
  float absmax = 0.f;
  for (int i = 0; i < d; ++i) absmax = fmaxf(absmax, fabsf(x[i]));
  const float s = scale_for(absmax, format_of<Code>());
  for (int i = 0; i < d; ++i) codes[i] = code_of<Code>(x[i], s);
  *scale = s;
}

// One token's head vector x[0..d) (d even) into d / 2 bytes of int4 codes and its scale.
FD_KVQ_FN void quantize_row_int4(const float* x, int d, uint8_t* packed, float* scale) {
  float absmax = 0.f;
  for (int i = 0; i < d; ++i) absmax = fmaxf(absmax, fabsf(x[i]));
  const float s = scale_for(absmax, kInt4);
  for (int i = 0; i < d; i += 2) packed[i / 2] = int4_pack(int4_code(x[i], s), int4_code(x[i + 1], s));
  *scale = s;
}

// Which pages store their keys rotated (see the top of this file).
FD_KVQ_FN bool rotates_keys(Format f, int head_dim) {
  return (f == kInt8 || f == kInt4) && head_dim > 1 && (head_dim & (head_dim - 1)) == 0;
}

// x <- H x in place, H of order d (a power of two): butterflies of span 1, 2, 4, ... in this order
// (the order is part of the bits; tests reproduce it).
FD_KVQ_FN void hadamard_in_place(float* x, int d) {
  for (int span = 1; span < d; span *= 2) {
    for (int i = 0; i < d; i += 2 * span) {
      for (int j = i; j < i + span; ++j) {
        const float a = x[j], b = x[j + span];
        x[j] = a + b;
        x[j + span] = a - b;
      }
    }
  }
}

FD_KVQ_FN float dequantize(int8_t q, float scale) { return float(q) * scale; }
FD_KVQ_FN float dequantize(e4m3 q, float scale) { return e4m3_to_float(q.bits) * scale; }

}  // namespace fd_kvq
