// Building blocks of the CPU append_attention op: bf16 storage conversion,
// interleaved RoPE, and one query's online-softmax update over a run of
// contiguous keys (the products themselves are in attention_tiles.h). No Paddle types here, so the math stays easy
// to read and to test through the op.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention_tiles.h"
#include "kv_quant.h"
#include "kv_quant_rows.h"
#include "kv_quant_rows_avx2.h"
#include "kv_quant_rows_avx512.h"

namespace fd_cpu {

// bfloat16 is carried as its raw bits; the arithmetic is always fp32.
using bf16_bits = uint16_t;

inline float to_float(float x) { return x; }

inline float to_float(bf16_bits b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round-to-nearest-even, NaN kept quiet (same rule as Paddle's bfloat16).
inline bf16_bits float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if (std::isnan(f)) return static_cast<bf16_bits>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<bf16_bits>(u >> 16);
}

inline void store(float* dst, float x) { *dst = x; }
inline void store(bf16_bits* dst, float x) { *dst = float_to_bf16(x); }

// `rows` cache rows of d values as fp32: fp32 rows are used in place, bf16 rows are widened once
// into `scratch`, quantized rows (kv_quant.h) are dequantized into it with each row's scale, so
// every product below runs on plain floats. `scales` (one per row) is read for quantized rows only.
inline const float* rows_as_float(const float* rows, const float* /*scales*/, float* /*scratch*/, int64_t,
                                  int) {
  return rows;
}

inline const float* rows_as_float(const bf16_bits* rows, const float* /*scales*/, float* scratch, int64_t n,
                                  int d) {
#pragma omp simd
  for (int64_t i = 0; i < n * d; ++i) scratch[i] = to_float(rows[i]);
  return scratch;
}

// Whether the vector kernels of `isa` take rows of d values (d a multiple of their lanes, or of `pair`
// times that); else the portable loops do (the same bits).
inline bool vector_rows(Isa isa, int d, int pair = 1) {
  if (isa == Isa::kAvx512) return d % (pair * kLanes) == 0;
  return isa == Isa::kAvx2 && d % (pair * kAvx2Width) == 0;
}

inline const float* rows_as_float(const int8_t* rows, const float* scales, float* scratch, int64_t n, int d) {
  const Isa isa = attention_isa();
  if (isa == Isa::kAvx512 && vector_rows(isa, d)) return dequantize_rows_avx512(rows, scales, scratch, n, d);
  if (isa == Isa::kAvx2 && vector_rows(isa, d)) return dequantize_rows_avx2(rows, scales, scratch, n, d);
  for (int64_t r = 0; r < n; ++r)
    for (int i = 0; i < d; ++i) scratch[r * d + i] = fd_kvq::dequantize(rows[r * d + i], scales[r]);
  return scratch;
}

inline const float* rows_as_float(const fd_kvq::e4m3* rows, const float* scales, float* scratch, int64_t n,
                                  int d) {
  const Isa isa = attention_isa();
  if (isa == Isa::kAvx512 && vector_rows(isa, d)) return dequantize_rows_avx512(rows, scales, scratch, n, d);
  if (isa == Isa::kAvx2 && vector_rows(isa, d)) return dequantize_rows_avx2(rows, scales, scratch, n, d);
  static const E4M3Table table;
  for (int64_t r = 0; r < n; ++r)
    for (int i = 0; i < d; ++i) scratch[r * d + i] = table.value[rows[r * d + i].bits] * scales[r];
  return scratch;
}

// int4 rows (d / 2 bytes each): every nibble's exact code value times the row's scale.
inline const float* rows_as_float(const Int4Pair* rows, const float* scales, float* scratch, int64_t n, int d) {
  const Isa isa = attention_isa();
  if (isa == Isa::kAvx512 && vector_rows(isa, d, 2)) return dequantize_rows_avx512(rows, scales, scratch, n, d);
  if (isa == Isa::kAvx2 && vector_rows(isa, d)) return dequantize_rows_avx2(rows, scales, scratch, n, d);
  for (int64_t r = 0; r < n; ++r) {
    for (int i = 0; i < d; i += 2) {
      const uint8_t b = rows[r * (d / 2) + i / 2].bits;
      scratch[r * d + i] = float(fd_kvq::int4_low(b)) * scales[r];
      scratch[r * d + i + 1] = float(fd_kvq::int4_high(b)) * scales[r];
    }
  }
  return scratch;
}

// Whether a tile's int4 value rows are read straight from the page (weighted_values_int4_d64) when
// its readers fit one batch; elsewhere (other head sizes, AVX2, the portable path) they are dequantized
// into the scratch. Either way the same bits.
inline bool reads_int4_values_in_place(int d) { return attention_uses_avx512() && d == 64; }

// weighted_values_many over int4 value rows in place (reads_int4_values_in_place(d), nr <= 4).
inline void weighted_values_many(const float* const* ws, float* const* accs, int nr, const Int4Pair* v,
                                 const float* scales, int n) {
  switch (nr) {
    case 4: return weighted_values_int4_d64<4>(ws, accs, v, scales, n);
    case 3: return weighted_values_int4_d64<3>(ws, accs, v, scales, n);
    case 2: return weighted_values_int4_d64<2>(ws, accs, v, scales, n);
    default: return weighted_values_int4_d64<1>(ws, accs, v, scales, n);
  }
}

// One token's rotated K (or its V) x[0..d) written into its cache row (and, for quantized pages,
// the row's scale).
inline void store_row(float* dst, float* /*scale*/, const float* x, int d) { std::memcpy(dst, x, sizeof(float) * d); }

inline void store_row(bf16_bits* dst, float* /*scale*/, const float* x, int d) {
  for (int i = 0; i < d; ++i) dst[i] = float_to_bf16(x[i]);
}

// A quantized row's scale (absmax / the format's largest code) and codes: `codes(isa, scale)` writes them
// with the vector kernel; a zero row gets zero codes.
template <typename Codes>
inline bool store_vector_row(const float* x, int d, fd_kvq::Format f, float* scale, size_t code_bytes, void* dst,
                             Codes codes) {
  const Isa isa = attention_isa();
  if (!vector_rows(isa, d)) return false;
  *scale = fd_kvq::scale_for(isa == Isa::kAvx512 ? absmax_avx512(x, d) : absmax_avx2(x, d), f);
  if (*scale > 0.f) codes(isa, *scale);
  else std::memset(dst, 0, code_bytes);
  return true;
}

inline void store_row(int8_t* dst, float* scale, const float* x, int d) {
  const auto codes = [&](Isa isa, float s) {
    isa == Isa::kAvx512 ? int8_codes_avx512(x, d, s, dst) : int8_codes_avx2(x, d, s, dst);
  };
  if (!store_vector_row(x, d, fd_kvq::kInt8, scale, size_t(d), dst, codes)) fd_kvq::quantize_row(x, d, dst, scale);
}

inline void store_row(fd_kvq::e4m3* dst, float* scale, const float* x, int d) {
  const auto codes = [&](Isa isa, float s) {
    isa == Isa::kAvx512 ? e4m3_codes_avx512(x, d, s, dst) : e4m3_codes_avx2(x, d, s, dst);
  };
  if (!store_vector_row(x, d, fd_kvq::kE4M3, scale, size_t(d), dst, codes)) fd_kvq::quantize_row(x, d, dst, scale);
}

inline void store_row(Int4Pair* dst, float* scale, const float* x, int d) {
  const auto codes = [&](Isa isa, float s) {
    isa == Isa::kAvx512 ? int4_codes_avx512(x, d, s, dst) : int4_codes_avx2(x, d, s, dst);
  };
  if (!store_vector_row(x, d, fd_kvq::kInt4, scale, size_t(d / 2), dst, codes))
    fd_kvq::quantize_row_int4(x, d, &dst->bits, scale);
}

// x <- H x (int8 / int4 keys and the queries beside them, kv_quant.h).
inline void rotate_row(float* x, int d) {
  const Isa isa = attention_isa();
  if (isa == Isa::kAvx512 && vector_rows(isa, d)) return hadamard_avx512(x, d);
  if (isa == Isa::kAvx2 && vector_rows(isa, d)) return hadamard_avx2(x, d);
  fd_kvq::hadamard_in_place(x, d);
}

// ERNIE-style interleaved RoPE of one head: pairs (2i, 2i+1) rotate by the
// angle of pair i at this position. `src` may be bf16 or fp32.
template <typename SrcT>
inline void rope_to_float(const SrcT* src, const float* cos_row,
                          const float* sin_row, int head_dim, float* dst) {
  for (int i = 0; i < head_dim / 2; ++i) {
    const float x0 = to_float(src[2 * i]);
    const float x1 = to_float(src[2 * i + 1]);
    dst[2 * i] = x0 * cos_row[i] - x1 * sin_row[i];
    dst[2 * i + 1] = x1 * cos_row[i] + x0 * sin_row[i];
  }
}

// Which keys of a run of rows are masked out; only used by the
// visit_all_pages baseline, which reads every page and masks the scores
// (the normal path never visits an invisible key).
struct RowMask {
  bool active = false;
  int64_t query_pos = 0;
  int64_t window = 0;
  int64_t sink = 0;
  bool visible(int64_t key_pos) const {
    return !active || key_pos < sink || key_pos > query_pos - window;
  }
};

// Gemma 2's attention soft-capping: each scaled score becomes cap * tanh(score / cap) before the
// softmax (cap 0: scores unchanged). Divided, not multiplied by 1 / cap, as the reference does.
inline void soft_cap(float* s, int n, float cap) {
  if (cap > 0.f) soft_cap_scores(s, n, cap);
}

// The softmax half of folding n consecutive keys into ONE query's running
// state (max, denom, acc[d]): `s` holds the scaled scores (soft-capped here
// when `softcap` > 0) and becomes the weights exp(score - max); acc is rescaled
// to the new max. The caller then
// adds weighted_values(s, v, n, d, acc). Returns false (nothing to add) when
// every key is masked. A query's keys arrive in position order, a page (or a
// sink / window run's part of a page) at a time, whoever shares its tile.
inline bool softmax_step(float* s, int n, int d, int64_t first_pos, const RowMask& mask, float softcap,
                         float& max, float& denom, float* acc) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  soft_cap(s, n, softcap);
  if (mask.active) {  // the visit_all_pages baseline only
    for (int r = 0; r < n; ++r) s[r] = mask.visible(first_pos + r) ? s[r] : kNegInf;
  }
  const float chunk_max = max_score(s, n);
  if (chunk_max == kNegInf) return false;
  const float new_max = std::fmax(max, chunk_max);
  if (new_max != max) {
    const float alpha = std::exp(max - new_max);  // 0 on the first keys
    denom *= alpha;
#pragma omp simd
    for (int i = 0; i < d; ++i) acc[i] *= alpha;
    max = new_max;
  }
  denom += exp_and_sum(s, n, new_max);
  return true;
}

// 1 / the softmax's denominator at the end of a query's keys: its running sum, plus exp(sink - max)
// where the head has a learned sink logit (gpt-oss: a key-less logit that only takes probability
// mass; `sink` is -inf without one). exp may overflow to inf for a sink far above every score: the
// output is then 0, the limit.
inline float softmax_norm(float denom, float max, float sink) {
  return 1.f / (sink == -std::numeric_limits<float>::infinity() ? denom : denom + std::exp(sink - max));
}

}  // namespace fd_cpu
