// The two products of the CPU attention op — scores q . k and the weighted
// value sum — in ONE fixed order of arithmetic per query, so a query gets the
// same bits whether it runs alone (a decode step), in a tile of a prefill
// chunk, next to any tile mates, or after a preemption recomputes it. This is
// the attention half of the engine's promise that a request's tokens never
// depend on its batch mates (the dense layers keep it in linear_packed.cc).
//
// Score order: lane l (0..15) sums q[i] * k[i] for i = l, l + 16, l + 32, ...
// by fused multiply-adds from +0; the 16 lanes then add as the fixed tree
// (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1), and the sum is multiplied by
// the softmax scale 1 / sqrt(head_dim) (its own rounding). Weighted values: every
// output element is one chain of fused multiply-adds over the keys in order.
// The AVX-512 kernels and the portable ones follow the same order (FMA is
// correctly rounded, additions commute), so they agree too.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "work_pool.h"

namespace fd_cpu {

constexpr int kLanes = 16;

// FD_CPU_ATTN_ISA=generic (cpu_options.h) forces the portable kernels (tests compare the two).
inline bool attention_uses_avx512() {
  static const bool use = !cpu_options().attn_generic && cpu_has_avx512f();
  return use;
}

// The fixed tree over 16 lane partial sums (p is consumed).
inline float sum_lane_tree(float* p) {
  for (int s = kLanes / 2; s >= 1; s /= 2)
    for (int l = 0; l < s; ++l) p[l] += p[l + s];
  return p[0];
}

// Sum of x[0..n) in the score order's lane layout (used for softmax denominators).
inline float ordered_sum(const float* x, int n) {
  float p[kLanes] = {0.f};
  int r = 0;
  for (; r + kLanes <= n; r += kLanes)
    for (int l = 0; l < kLanes; ++l) p[l] += x[r + l];
  for (int l = 0; r + l < n; ++l) p[l] += x[r + l];
  return sum_lane_tree(p);
}

// out[j] = (q . k[j]) * scale: the scale is its own rounding after the sum.
inline void scores_generic(const float* q, const float* k, int n, int d, float scale, float* out) {
  for (int j = 0; j < n; ++j) {
    const float* kj = k + int64_t(j) * d;
    float p[kLanes] = {0.f};
    for (int i = 0; i < d; ++i) p[i % kLanes] = std::fma(q[i], kj[i], p[i % kLanes]);
    out[j] = sum_lane_tree(p) * scale;
  }
}

inline void weighted_values_generic(const float* w, const float* v, int n, int d, float* acc) {
  for (int j = 0; j < n; ++j) {
    const float* vj = v + int64_t(j) * d;
    for (int i = 0; i < d; ++i) acc[i] = std::fma(w[j], vj[i], acc[i]);
  }
}

// exp(x) for x <= 0 (a score minus the running max), relative error ~1e-7;
// exactly 0 below -87 so masked (-inf) scores weigh nothing. exp_avx512 below
// is the same sequence of roundings, 16 at a time. Fused multiply-adds: half
// the instructions and half the dependent latency of multiply-then-add (the
// exp was ~20% of a prefill's attention), and one rounding less per step.
inline float exp_nonpositive(float x) {
  const float kLog2e = 1.44269504088896341f;
  const float kLn2Hi = 0.693359375f;
  const float kLn2Lo = -2.12194440e-4f;
  const float xc = x < -87.f ? -87.f : x;
  const float n = std::floor(std::fma(xc, kLog2e, 0.5f));
  const float r = std::fma(-n, kLn2Lo, std::fma(-n, kLn2Hi, xc));  // |r| <= ln2/2
  float e = 1.f / 5040.f;                                          // Taylor series of e^r to r^7
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) e = std::fma(e, r, c);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.f ? 0.f : e * scale;
}

// Lane j of the result = the tree sum of v[j]'s 16 lanes, for 16 vectors at
// once: four rounds of shuffle + add, each pairing lanes as sum_lane_tree does.
__attribute__((target("avx512f"))) inline __m512 sum_lanes_x16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int m = 0; m < 8; ++m)  // (l, l + 8): 256-bit halves
    t[m] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * m], v[2 * m + 1], 0xEE));
  for (int m = 0; m < 4; ++m)  // (l, l + 4): 128-bit quarters
    u[m] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * m], t[2 * m + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * m], t[2 * m + 1], 0xDD));
  for (int m = 0; m < 2; ++m)  // (l, l + 2): pairs inside a quarter
    w[m] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * m], u[2 * m + 1], 0x44),
                         _mm512_shuffle_ps(u[2 * m], u[2 * m + 1], 0xEE));
  // (l, l + 1); lane 4c + k now holds vector 4k + c: put vector j in lane j.
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, s);
}

// out[q * ldo + j] = (qs[q] . k[j]) * scale for nq queries and n keys (row
// stride d = 16 B): 16 keys at a time, kept in L1 while every query uses them;
// the query's blocks and the 16 keys' lane sums stay in registers.
template <int B>
__attribute__((target("avx512f"))) void scores_rows_fixed(const float* const* qs, int nq, const float* k,
                                                         int n, float scale, float* out, int ldo) {
  constexpr int d = B * kLanes;
  constexpr int G = B < 8 ? B : 8;  // query blocks held at once
  alignas(64) float padded[kLanes * d];
  for (int j0 = 0; j0 < n; j0 += kLanes) {
    const int keys = std::min(kLanes, n - j0);
    const float* kb = k + int64_t(j0) * d;
    if (keys < kLanes) {  // a short last group reads zero rows, not past the page
      std::memcpy(padded, kb, sizeof(float) * size_t(keys) * d);
      std::memset(padded + keys * d, 0, sizeof(float) * size_t(kLanes - keys) * d);
      kb = padded;
    }
    const __mmask16 live = __mmask16((1u << keys) - 1);
    const __m512 scales = _mm512_set1_ps(scale);
    for (int q = 0; q < nq; ++q) {
      __m512 acc[kLanes];
      for (int j = 0; j < kLanes; ++j) acc[j] = _mm512_setzero_ps();
      for (int b0 = 0; b0 < B; b0 += G) {
        __m512 qb[G];
        for (int g = 0; g < G; ++g) qb[g] = _mm512_loadu_ps(qs[q] + (b0 + g) * kLanes);
        for (int j = 0; j < kLanes; ++j)
          for (int g = 0; g < G; ++g)
            acc[j] = _mm512_fmadd_ps(qb[g], _mm512_loadu_ps(kb + j * d + (b0 + g) * kLanes), acc[j]);
      }
      _mm512_mask_storeu_ps(out + int64_t(q) * ldo + j0, live, _mm512_mul_ps(sum_lanes_x16(acc), scales));
    }
  }
}

// acc[0..d) += sum_j w[j] * v[j], B 16-wide blocks of acc held in registers.
template <int B>
__attribute__((target("avx512f"))) inline void weighted_blocks(const float* w, const float* v, int n,
                                                              int d, float* acc, __mmask16 last) {
  __m512 a[B];
  for (int b = 0; b < B; ++b) a[b] = _mm512_maskz_loadu_ps(b + 1 < B ? __mmask16(0xFFFF) : last, acc + b * kLanes);
  for (int j = 0; j < n; ++j) {
    const __m512 wj = _mm512_set1_ps(w[j]);
    const float* vj = v + int64_t(j) * d;
    for (int b = 0; b < B; ++b)
      a[b] = _mm512_fmadd_ps(wj, _mm512_maskz_loadu_ps(b + 1 < B ? __mmask16(0xFFFF) : last, vj + b * kLanes), a[b]);
  }
  for (int b = 0; b < B; ++b) _mm512_mask_storeu_ps(acc + b * kLanes, b + 1 < B ? __mmask16(0xFFFF) : last, a[b]);
}

__attribute__((target("avx512f"))) inline void weighted_values_avx512(const float* w, const float* v, int n,
                                                                     int d, float* acc) {
  constexpr int kMaxBlocks = 8;  // 128 dims per pass keeps a[] in registers
  for (int i0 = 0; i0 < d; i0 += kMaxBlocks * kLanes) {
    const int dims = std::min(kMaxBlocks * kLanes, d - i0);
    const int blocks = (dims + kLanes - 1) / kLanes;
    const __mmask16 last = __mmask16((1u << (dims - (blocks - 1) * kLanes)) - 1);
    const float* vb = v + i0;
    float* ab = acc + i0;
    switch (blocks) {
      case 1: weighted_blocks<1>(w, vb, n, d, ab, last); break;
      case 2: weighted_blocks<2>(w, vb, n, d, ab, last); break;
      case 3: weighted_blocks<3>(w, vb, n, d, ab, last); break;
      case 4: weighted_blocks<4>(w, vb, n, d, ab, last); break;
      case 5: weighted_blocks<5>(w, vb, n, d, ab, last); break;
      case 6: weighted_blocks<6>(w, vb, n, d, ab, last); break;
      case 7: weighted_blocks<7>(w, vb, n, d, ab, last); break;
      default: weighted_blocks<8>(w, vb, n, d, ab, last); break;
    }
  }
}

// exp_nonpositive on 16 lanes: the same operations in the same order.
__attribute__((target("avx512f"))) inline __m512 exp_avx512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  const __m512 xc = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc));
  __m512 e = _mm512_set1_ps(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(~underflow, e, _mm512_castsi512_ps(bits));
}

// tanh for Gemma 2's soft-capping of scores, ~2 ulp: below |x| 0.4 the odd Taylor series to x^13 (its
// first dropped term is under 1e-7 of the result there), above it (1 - e) / (1 + e) with e = exp(-2|x|) <= 0.45
// (no cancellation); the sign put back. std::tanh, scalar, cost 3.4x a prefill's attention; soft_caps_avx512
// is the same operations in the same order, 16 at a time, so both paths give the same bits.
inline float tanh_score(float x) {
  const float a = std::fabs(x);
  float t;
  if (a < 0.4f) {
    const float z = a * a;
    float p = 21844.f / 6081075.f;
    for (const float c : {-1382.f / 155925.f, 62.f / 2835.f, -17.f / 315.f, 2.f / 15.f, -1.f / 3.f})
      p = std::fma(p, z, c);
    t = std::fma(a * z, p, a);
  } else {
    const float e = exp_nonpositive(-2.f * a);
    t = (1.f - e) / (1.f + e);
  }
  return std::copysign(t, x);
}

// s[r] = cap * tanh(s[r] / cap) for r in [0, n).
inline void soft_caps(float* s, int n, float cap) {
  for (int r = 0; r < n; ++r) s[r] = cap * tanh_score(s[r] / cap);
}

__attribute__((target("avx512f"))) inline void soft_caps_avx512(float* s, int n, float cap) {
  const __m512 c = _mm512_set1_ps(cap);
  const __m512i sign_bit = _mm512_set1_epi32(int32_t(0x80000000u));
  for (int r = 0; r < n; r += kLanes) {
    const __mmask16 live = n - r >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n - r)) - 1);
    const __m512 x = _mm512_div_ps(_mm512_maskz_loadu_ps(live, s + r), c);
    const __m512 a = _mm512_abs_ps(x);
    const __m512 z = _mm512_mul_ps(a, a);
    __m512 p = _mm512_set1_ps(21844.f / 6081075.f);
    for (const float k : {-1382.f / 155925.f, 62.f / 2835.f, -17.f / 315.f, 2.f / 15.f, -1.f / 3.f})
      p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(k));
    const __m512 series = _mm512_fmadd_ps(_mm512_mul_ps(a, z), p, a);
    const __m512 e = exp_avx512(_mm512_mul_ps(_mm512_set1_ps(-2.f), a));
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 ratio = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512 t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.4f), _CMP_LT_OQ), ratio, series);
    const __m512 signed_t = _mm512_castsi512_ps(  // avx512f has the integer forms of and / or only
        _mm512_or_si512(_mm512_castps_si512(t), _mm512_and_si512(sign_bit, _mm512_castps_si512(x))));
    _mm512_mask_storeu_ps(s + r, live, _mm512_mul_ps(c, signed_t));
  }
}

// The max of s[0..n) (exact: a max does not round).
inline float max_of(const float* s, int n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < n; ++r) m = s[r] > m ? s[r] : m;
  return m;
}

__attribute__((target("avx512f"))) inline float max_of_avx512(const float* s, int n) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < n; r += kLanes) {
    const __mmask16 live = n - r >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n - r)) - 1);
    m = _mm512_mask_max_ps(m, live, m, _mm512_maskz_loadu_ps(live, s + r));
  }
  return _mm512_reduce_max_ps(m);
}

// sum_lane_tree on a register: the same pairs, (l, l + 8) then (l, l + 4), (l, l + 2), (l, l + 1),
// without the trip through memory (a wide store read back narrow stalls store forwarding).
__attribute__((target("avx512f"))) inline float sum_lane_tree_avx512(__m512 p) {
  const __m256 lo = _mm512_castps512_ps256(p);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1));
  const __m256 eighths = _mm256_add_ps(lo, hi);
  const __m128 quarters = _mm_add_ps(_mm256_castps256_ps128(eighths), _mm256_extractf128_ps(eighths, 1));
  const __m128 pairs = _mm_add_ps(quarters, _mm_movehl_ps(quarters, quarters));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

// s[r] = exp(s[r] - max) for r in [0, n); returns their ordered_sum.
inline float softmax_weights(float* s, int n, float max) {
  for (int r = 0; r < n; ++r) s[r] = exp_nonpositive(s[r] - max);
  return ordered_sum(s, n);
}

__attribute__((target("avx512f"))) inline float softmax_weights_avx512(float* s, int n, float max) {
  const __m512 m = _mm512_set1_ps(max);
  __m512 sum = _mm512_setzero_ps();  // lane l sums keys l, l + 16, ...: ordered_sum's lanes
  for (int r = 0; r < n; r += kLanes) {
    const __mmask16 live = n - r >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n - r)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + r), m)));
    _mm512_mask_storeu_ps(s + r, live, e);
    sum = _mm512_add_ps(sum, e);
  }
  return sum_lane_tree_avx512(sum);
}

inline float max_score(const float* s, int n) {
  if (attention_uses_avx512()) return max_of_avx512(s, n);
  return max_of(s, n);
}

inline void soft_cap_scores(float* s, int n, float cap) {
  if (attention_uses_avx512()) return soft_caps_avx512(s, n, cap);
  soft_caps(s, n, cap);
}

inline float exp_and_sum(float* s, int n, float max) {
  if (attention_uses_avx512()) return softmax_weights_avx512(s, n, max);
  return softmax_weights(s, n, max);
}

// Scaled scores of nq queries (pointers qs) against the same n keys, one row of out (stride ldo) each.
inline void scores_rows(const float* const* qs, int nq, const float* k, int n, int d, float scale, float* out,
                        int ldo) {
  if (attention_uses_avx512()) {
    switch (d) {
      case 64: return scores_rows_fixed<4>(qs, nq, k, n, scale, out, ldo);
      case 128: return scores_rows_fixed<8>(qs, nq, k, n, scale, out, ldo);
      case 256: return scores_rows_fixed<16>(qs, nq, k, n, scale, out, ldo);
      default:
        break;  // other head sizes: the portable kernel (the same bits, slower)
    }
  }
  for (int q = 0; q < nq; ++q) scores_generic(qs[q], k, n, d, scale, out + int64_t(q) * ldo);
}

inline void weighted_values(const float* w, const float* v, int n, int d, float* acc) {
  if (attention_uses_avx512()) return weighted_values_avx512(w, v, n, d, acc);
  weighted_values_generic(w, v, n, d, acc);
}

// weighted_values for NR queries over the same n value rows (d = 16 B): each
// row is loaded once for all of them, and NR x B independent chains keep the
// FMA units busy (one query's B chains alone would wait on FMA latency).
template <int B, int NR>
__attribute__((target("avx512f"))) void weighted_values_shared(const float* const* ws, float* const* accs,
                                                              const float* v, int n) {
  constexpr int d = B * kLanes;
  __m512 a[NR][B];
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < B; ++b) a[r][b] = _mm512_loadu_ps(accs[r] + b * kLanes);
  for (int j = 0; j < n; ++j) {
    __m512 vb[B];
    for (int b = 0; b < B; ++b) vb[b] = _mm512_loadu_ps(v + int64_t(j) * d + b * kLanes);
    for (int r = 0; r < NR; ++r) {
      const __m512 wj = _mm512_set1_ps(ws[r][j]);
      for (int b = 0; b < B; ++b) a[r][b] = _mm512_fmadd_ps(wj, vb[b], a[r][b]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < B; ++b) _mm512_storeu_ps(accs[r] + b * kLanes, a[r][b]);
}

// How many queries weighted_values_many takes at once for head_dim d (1: no gain).
inline int shared_values_width(int d) {
  if (!attention_uses_avx512()) return 1;
  return d == 64 ? 4 : d == 128 ? 2 : 1;
}

// weighted_values(ws[r], v, n, d, accs[r]) for r < nr (nr <= shared_values_width(d)): same bits.
inline void weighted_values_many(const float* const* ws, float* const* accs, int nr, const float* v, int n,
                                 int d) {
  if (attention_uses_avx512() && d == 64) {
    switch (nr) {
      case 4: return weighted_values_shared<4, 4>(ws, accs, v, n);
      case 3: return weighted_values_shared<4, 3>(ws, accs, v, n);
      case 2: return weighted_values_shared<4, 2>(ws, accs, v, n);
      default: break;
    }
  }
  if (attention_uses_avx512() && d == 128 && nr == 2) return weighted_values_shared<8, 2>(ws, accs, v, n);
  for (int r = 0; r < nr; ++r) weighted_values(ws[r], v, n, d, accs[r]);
}

}  // namespace fd_cpu
