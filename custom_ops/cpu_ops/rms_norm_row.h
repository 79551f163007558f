// One row of RMSNorm, y = (x * rsqrt(mean(x^2) + eps)) * w: the rms_norm ops (rms_norm.cc) and the
// fused decoder blocks (decoder_block_ops.cc) run this one function, so they give the same bits.
#pragma once

#include <cmath>
#include <cstdint>

namespace fd_cpu {

constexpr int kNormLanes = 8;

// kNormLanes partial sums, combined in a fixed order: same bits for every row.
inline void norm_row(const float* x, const float* w, int64_t d, float eps, float* y) {
  float part[kNormLanes] = {0.f};
  int64_t i = 0;
  for (; i + kNormLanes <= d; i += kNormLanes)
    for (int l = 0; l < kNormLanes; ++l) part[l] += x[i + l] * x[i + l];
  for (int l = 0; i < d; ++i, ++l) part[l] += x[i] * x[i];
  float sum = 0.f;
  for (int l = 0; l < kNormLanes; ++l) sum += part[l];
  const float inv = 1.0f / std::sqrt(sum / float(d) + eps);
  for (int64_t j = 0; j < d; ++j) y[j] = (x[j] * inv) * w[j];
}

}  // namespace fd_cpu
