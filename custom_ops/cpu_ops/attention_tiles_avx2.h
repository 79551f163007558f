// The CPU attention's AVX2 + FMA kernels: the portable kernels' operations in the same order, 8 lanes at
// a time. A score's 16 partial sums (lane l sums q[i] k[i] for i = l mod 16) are two registers, lanes
// 0-7 and 8-15, whose sum is the fixed tree's first round (l, l + 8); the rounds after it pair lanes
// as sum_lane_tree does. AVX2 has 16 vector registers: scores take 8 keys at a time, weighted values
// 32 dimensions of up to 3 queries.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention_tiles_portable.h"

#define ATTN_AVX2_TARGET __attribute__((target("avx2,fma")))
#define ATTN_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline

namespace fd_cpu {

constexpr int kAvx2Width = 8;

// Lanes [0, n) set (n clamped to [0, 8]), for maskload / maskstore.
ATTN_AVX2_INLINE __m256i live_lanes(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Lane j of the result = the tree sum (l, l + 4), (l, l + 2), (l, l + 1) of v[j]'s 8 lanes (each
// already lane l + lane l + 8 of a 16-lane sum), for 8 vectors at once.
ATTN_AVX2_INLINE __m256 sum_lanes_x8(const __m256* v) {
  __m256 t[4], u[2];
  for (int m = 0; m < 4; ++m)  // (l, l + 4): 128-bit halves; t[m] = [v[2m]'s 4 | v[2m + 1]'s 4]
    t[m] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * m], v[2 * m + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * m], v[2 * m + 1], 0x31));
  for (int m = 0; m < 2; ++m)  // (l, l + 2): pairs inside a half
    u[m] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * m], t[2 * m + 1], 0x44),
                         _mm256_shuffle_ps(t[2 * m], t[2 * m + 1], 0xEE));
  // (l, l + 1); half h now holds vectors h, h + 2, h + 4, h + 6 (in that order): put vector j in lane j.
  const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xDD));
  return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// out[q * ldo + j] = (qs[q] . k[j]) * scale for nq queries and n keys (row stride d = 16 B): 8 keys at a
// time, kept in L1 while every query uses them.
template <int B>
ATTN_AVX2_TARGET void scores_rows_fixed_avx2(const float* const* qs, int nq, const float* k, int n, float scale,
                                         float* out, int ldo) {
  constexpr int d = B * kLanes;
  alignas(32) float padded[kAvx2Width * d];
  const __m256 scales = _mm256_set1_ps(scale);
  for (int j0 = 0; j0 < n; j0 += kAvx2Width) {
    const int keys = std::min(kAvx2Width, n - j0);
    const float* kb = k + int64_t(j0) * d;
    if (keys < kAvx2Width) {  // a short last group reads zero rows, not past the page
      std::memcpy(padded, kb, sizeof(float) * size_t(keys) * d);
      std::memset(padded + keys * d, 0, sizeof(float) * size_t(kAvx2Width - keys) * d);
      kb = padded;
    }
    for (int q = 0; q < nq; ++q) {
      const float* qv = qs[q];
      __m256 s[kAvx2Width];
      for (int j = 0; j < kAvx2Width; ++j) {
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
        for (int b = 0; b < B; ++b) {
          lo = _mm256_fmadd_ps(_mm256_loadu_ps(qv + b * kLanes), _mm256_loadu_ps(kb + j * d + b * kLanes), lo);
          hi = _mm256_fmadd_ps(_mm256_loadu_ps(qv + b * kLanes + 8), _mm256_loadu_ps(kb + j * d + b * kLanes + 8), hi);
        }
        s[j] = _mm256_add_ps(lo, hi);
      }
      _mm256_maskstore_ps(out + int64_t(q) * ldo + j0, live_lanes(keys), _mm256_mul_ps(sum_lanes_x8(s), scales));
    }
  }
}

// accs[r][0..8V) += sum_j ws[r][j] * v[j][0..8V) for r < NR (v's row stride d): each value row loaded once
// for all NR queries; every element one chain of fused multiply-adds over j.
template <int NR, int V>
ATTN_AVX2_TARGET void weighted_values_block_avx2(const float* const* ws, float* const* accs, const float* v, int n,
                                             int d) {
  __m256 a[NR][V];
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < V; ++b) a[r][b] = _mm256_loadu_ps(accs[r] + b * kAvx2Width);
  for (int j = 0; j < n; ++j) {
    __m256 vb[V];
    for (int b = 0; b < V; ++b) vb[b] = _mm256_loadu_ps(v + int64_t(j) * d + b * kAvx2Width);
    for (int r = 0; r < NR; ++r) {
      const __m256 wj = _mm256_broadcast_ss(ws[r] + j);
      for (int b = 0; b < V; ++b) a[r][b] = _mm256_fmadd_ps(wj, vb[b], a[r][b]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < V; ++b) _mm256_storeu_ps(accs[r] + b * kAvx2Width, a[r][b]);
}

// The widest value block NR queries keep in registers: 4 vectors of 8 for up to 3 queries.
constexpr int kAvx2ValueQueries = 3;

// weighted_values for NR queries over the same n value rows, d a multiple of 8, 32 dimensions at a time.
template <int NR>
ATTN_AVX2_TARGET void weighted_values_shared_avx2(const float* const* ws, float* const* accs, const float* v, int n,
                                              int d) {
  for (int i0 = 0; i0 < d; i0 += 4 * kAvx2Width) {
    float* shifted[NR];
    for (int r = 0; r < NR; ++r) shifted[r] = accs[r] + i0;
    switch (std::min(4, (d - i0) / kAvx2Width)) {
      case 1: weighted_values_block_avx2<NR, 1>(ws, shifted, v + i0, n, d); break;
      case 2: weighted_values_block_avx2<NR, 2>(ws, shifted, v + i0, n, d); break;
      case 3: weighted_values_block_avx2<NR, 3>(ws, shifted, v + i0, n, d); break;
      default: weighted_values_block_avx2<NR, 4>(ws, shifted, v + i0, n, d); break;
    }
  }
}

// exp_nonpositive on 8 lanes: the same operations in the same order.
ATTN_AVX2_INLINE __m256 exp_avx2(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.f);
  const __m256 kept = _mm256_cmp_ps(x, lo, _CMP_NLT_UQ);  // not (x < -87): exp_nonpositive's test
  const __m256 xc = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc));
  __m256 e = _mm256_set1_ps(1.f / 5040.f);
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    e = _mm256_fmadd_ps(e, r, _mm256_set1_ps(c));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(kept, _mm256_mul_ps(e, _mm256_castsi256_ps(bits)));
}

// soft_caps (tanh_score) on 8 lanes at a time: the same operations in the same order.
ATTN_AVX2_TARGET inline void soft_caps_avx2(float* s, int n, float cap) {
  const __m256 c = _mm256_set1_ps(cap);
  const __m256 sign_bit = _mm256_castsi256_ps(_mm256_set1_epi32(int32_t(0x80000000u)));
  const __m256 one = _mm256_set1_ps(1.f);
  for (int r = 0; r < n; r += kAvx2Width) {
    const __m256i live = live_lanes(n - r);
    const __m256 x = _mm256_div_ps(_mm256_maskload_ps(s + r, live), c);
    const __m256 a = _mm256_andnot_ps(sign_bit, x);
    const __m256 z = _mm256_mul_ps(a, a);
    __m256 p = _mm256_set1_ps(21844.f / 6081075.f);
    for (const float k : {-1382.f / 155925.f, 62.f / 2835.f, -17.f / 315.f, 2.f / 15.f, -1.f / 3.f})
      p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(k));
    const __m256 series = _mm256_fmadd_ps(_mm256_mul_ps(a, z), p, a);
    const __m256 e = exp_avx2(_mm256_mul_ps(_mm256_set1_ps(-2.f), a));
    const __m256 ratio = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    const __m256 t = _mm256_blendv_ps(ratio, series, _mm256_cmp_ps(a, _mm256_set1_ps(0.4f), _CMP_LT_OQ));
    const __m256 signed_t = _mm256_or_ps(t, _mm256_and_ps(sign_bit, x));
    _mm256_maskstore_ps(s + r, live, _mm256_mul_ps(c, signed_t));
  }
}

// The max of s[0..n) (a max is exact in any order; vmaxps's NaN rule, as the AVX-512 kernel's).
ATTN_AVX2_TARGET inline float max_of_avx2(const float* s, int n) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m = neg_inf;
  for (int r = 0; r < n; r += kAvx2Width) {
    const __m256i live = live_lanes(n - r);
    m = _mm256_max_ps(m, _mm256_blendv_ps(neg_inf, _mm256_maskload_ps(s + r, live), _mm256_castsi256_ps(live)));
  }
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  const __m128 q = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
}

// sum_lane_tree of the 16 lanes (lo = 0-7, hi = 8-15) in registers: (l, l + 8), (l, l + 4), (l, l + 2),
// (l, l + 1).
ATTN_AVX2_INLINE float sum_lane_tree_avx2(__m256 lo, __m256 hi) {
  const __m256 eighths = _mm256_add_ps(lo, hi);
  const __m128 quarters = _mm_add_ps(_mm256_castps256_ps128(eighths), _mm256_extractf128_ps(eighths, 1));
  const __m128 pairs = _mm_add_ps(quarters, _mm_movehl_ps(quarters, quarters));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

// s[r] = exp(s[r] - max) for r in [0, n); returns their ordered_sum (lane l sums keys l, l + 16, ...).
ATTN_AVX2_TARGET inline float softmax_weights_avx2(float* s, int n, float max) {
  const __m256 m = _mm256_set1_ps(max);
  __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int r = 0; r < n; r += kLanes) {
    for (int h = 0; h < 2 && r + h * kAvx2Width < n; ++h) {
      float* at = s + r + h * kAvx2Width;
      const __m256i live = live_lanes(n - r - h * kAvx2Width);
      const __m256 e = _mm256_and_ps(_mm256_castsi256_ps(live), exp_avx2(_mm256_sub_ps(_mm256_maskload_ps(at, live), m)));
      _mm256_maskstore_ps(at, live, e);
      sum[h] = _mm256_add_ps(sum[h], e);
    }
  }
  return sum_lane_tree_avx2(sum[0], sum[1]);
}

}  // namespace fd_cpu
