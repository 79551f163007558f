// Scalar/vector building blocks of the CPU append_attention op: bf16 storage
// conversion, interleaved RoPE, and the online-softmax update over one run of
// contiguous key rows of a page. No Paddle types here, so the math stays easy
// to read and to test through the op.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

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

// `rows` cache rows as fp32: fp32 rows are used in place, bf16 rows are
// widened once into `scratch` so every product below runs on plain floats.
inline const float* rows_as_float(const float* rows, float* /*scratch*/, int64_t) {
  return rows;
}

inline const float* rows_as_float(const bf16_bits* rows, float* scratch, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) scratch[i] = to_float(rows[i]);
  return scratch;
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

// The products below work on 8 key rows at a time: eight independent
// accumulators keep the FMA units busy (one running sum would wait on the add
// latency at every step) and each q / acc element is loaded once per 8 rows.

// out[r] = q . k[r] for the 8 rows k[0..7] (row stride n).
inline void dot8(const float* q, const float* k, int n, float* out) {
  const float *k0 = k, *k1 = k + n, *k2 = k + 2 * n, *k3 = k + 3 * n;
  const float *k4 = k + 4 * n, *k5 = k + 5 * n, *k6 = k + 6 * n, *k7 = k + 7 * n;
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f, a4 = 0.f, a5 = 0.f, a6 = 0.f, a7 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3, a4, a5, a6, a7)
  for (int i = 0; i < n; ++i) {
    const float x = q[i];
    a0 += x * k0[i];
    a1 += x * k1[i];
    a2 += x * k2[i];
    a3 += x * k3[i];
    a4 += x * k4[i];
    a5 += x * k5[i];
    a6 += x * k6[i];
    a7 += x * k7[i];
  }
  out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3;
  out[4] = a4, out[5] = a5, out[6] = a6, out[7] = a7;
}

inline float dot(const float* a, const float* b, int n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// acc += sum_r p[r] * v[r] over the 8 rows v[0..7] (row stride n).
inline void axpy8(const float* p, const float* v, int n, float* acc) {
  const float *v0 = v, *v1 = v + n, *v2 = v + 2 * n, *v3 = v + 3 * n;
  const float *v4 = v + 4 * n, *v5 = v + 5 * n, *v6 = v + 6 * n, *v7 = v + 7 * n;
  const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
  const float p4 = p[4], p5 = p[5], p6 = p[6], p7 = p[7];
#pragma omp simd
  for (int i = 0; i < n; ++i) {
    acc[i] += ((p0 * v0[i] + p1 * v1[i]) + (p2 * v2[i] + p3 * v3[i])) +
              ((p4 * v4[i] + p5 * v5[i]) + (p6 * v6[i] + p7 * v7[i]));
  }
}

inline void axpy(float a, const float* x, float* y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

inline void scale_in_place(float a, float* y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] *= a;
}

// exp(x) for x <= 0 (a score minus the running max), vectorizable, relative
// error ~1e-7; exactly 0 below -87 so masked (-inf) scores weigh nothing.
inline float exp_nonpositive(float x) {
  const float kLog2e = 1.44269504088896341f;
  const float kLn2Hi = 0.693359375f;
  const float kLn2Lo = -2.12194440e-4f;
  const float xc = x < -87.f ? -87.f : x;
  const float n = std::floor(xc * kLog2e + 0.5f);
  const float r = xc - n * kLn2Hi - n * kLn2Lo;  // |r| <= ln2/2
  float e = 1.f / 5040.f;                        // Taylor series of e^r to r^7
  e = e * r + 1.f / 720.f;
  e = e * r + 1.f / 120.f;
  e = e * r + 1.f / 24.f;
  e = e * r + 1.f / 6.f;
  e = e * r + 0.5f;
  e = e * r + 1.f;
  e = e * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.f ? 0.f : e * scale;
}

// Running softmax state of the `group` query heads that share one KV head.
struct SoftmaxState {
  float* max;    // [group] running max of the scaled scores
  float* denom;  // [group] running sum of exp(score - max)
  float* acc;    // [group, head_dim] running sum of exp(score - max) * v
};

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

// Folds `rows` consecutive cache rows (keys `k`, values `v`, absolute
// position of the first row `first_pos`) into the softmax state of `group`
// query heads `q` ([group, head_dim], fp32, already rotated).
// `scores` needs group * rows floats; `ktile`/`vtile` rows * head_dim floats
// each (used only to widen bf16 rows).
template <typename CacheT>
void attend_rows(const float* q, int group, int head_dim, float scale,
                 const CacheT* k, const CacheT* v, int rows, int64_t first_pos,
                 const RowMask& mask, float* scores, float* ktile, float* vtile,
                 SoftmaxState st) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int d = head_dim;
  const float* kf = rows_as_float(k, ktile, int64_t(rows) * d);
  const float* vf = rows_as_float(v, vtile, int64_t(rows) * d);
  const int rows8 = rows - rows % 8;
  // Hint the rows two blocks ahead: a decode step streams the whole cache
  // once, and this measured ~1.2x on cold (DRAM) pages.
  const auto prefetch_ahead = [&](const float* base, int r) {
    const int64_t end = int64_t(std::min(rows, r + 24)) * d;
    for (int64_t off = int64_t(r + 16) * d; off < end; off += 16) __builtin_prefetch(base + off);
  };

  // Scores, 8 rows at a time for every head of the group, so the 8 key rows
  // stay in L1 while all heads use them.
  for (int r = 0; r < rows; r += 8) {
    prefetch_ahead(kf, r);
    for (int g = 0; g < group; ++g) {
      const float* qg = q + int64_t(g) * d;
      float* sg = scores + int64_t(g) * rows;
      if (r < rows8) {
        dot8(qg, kf + int64_t(r) * d, d, sg + r);
      } else {
        for (int rr = r; rr < rows; ++rr) sg[rr] = dot(qg, kf + int64_t(rr) * d, d);
      }
    }
  }

  // Online-softmax update per head; scores become the weights exp(s - max).
  for (int g = 0; g < group; ++g) {
    float* sg = scores + int64_t(g) * rows;
    for (int r = 0; r < rows; ++r) {
      sg[r] = mask.visible(first_pos + r) ? sg[r] * scale : kNegInf;
    }
    float chunk_max = kNegInf;
    for (int r = 0; r < rows; ++r) chunk_max = sg[r] > chunk_max ? sg[r] : chunk_max;
    if (chunk_max == kNegInf) {  // every key of this run is masked for this head
      std::fill(sg, sg + rows, 0.f);
      continue;
    }
    const float new_max = std::fmax(st.max[g], chunk_max);
    if (new_max != st.max[g]) {
      const float alpha = std::exp(st.max[g] - new_max);  // 0 on the first run
      st.denom[g] *= alpha;
      scale_in_place(alpha, st.acc + int64_t(g) * d, d);
      st.max[g] = new_max;
    }
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int r = 0; r < rows; ++r) {
      sg[r] = exp_nonpositive(sg[r] - new_max);
      sum += sg[r];
    }
    st.denom[g] += sum;
  }

  // Weighted values, again 8 rows at a time for every head.
  for (int r = 0; r < rows; r += 8) {
    prefetch_ahead(vf, r);
    for (int g = 0; g < group; ++g) {
      const float* pg = scores + int64_t(g) * rows;
      float* acc = st.acc + int64_t(g) * d;
      if (r < rows8) {
        axpy8(pg + r, vf + int64_t(r) * d, d, acc);
      } else {
        for (int rr = r; rr < rows; ++rr) axpy(pg[rr], vf + int64_t(rr) * d, acc, d);
      }
    }
  }
}

}  // namespace fd_cpu
