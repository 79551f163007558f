// The CPU attention's portable kernels: the fixed order of arithmetic (attention_tiles.h) written as
// plain loops, the reference every instruction set's kernels match bit for bit.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace fd_cpu {

constexpr int kLanes = 16;

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

// The max of s[0..n) (exact: a max does not round).
inline float max_of(const float* s, int n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < n; ++r) m = s[r] > m ? s[r] : m;
  return m;
}

// s[r] = exp(s[r] - max) for r in [0, n); returns their ordered_sum.
inline float softmax_weights(float* s, int n, float max) {
  for (int r = 0; r < n; ++r) s[r] = exp_nonpositive(s[r] - max);
  return ordered_sum(s, n);
}

}  // namespace fd_cpu
