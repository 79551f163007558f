// The CPU attention's AVX-512 kernels: the portable kernels' operations in the same order, 16 lanes at
// a time (a score's 16 partial sums are one register).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "attention_tiles_portable.h"

namespace fd_cpu {

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

}  // namespace fd_cpu
