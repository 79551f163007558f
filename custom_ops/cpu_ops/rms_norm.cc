// CPU RMSNorm over the last axis: y[r] = (x[r] * rsqrt(mean(x[r]^2) + eps)) * w, float32.
//
// Why an op and not Paddle's mean/rsqrt/multiply: Paddle's CPU reduction over the last axis
// gives the tail rows of a batch (past the largest multiple of its vector tile) other bits than
// the rest, so a request's hidden state - and its tokens - would depend on how many rows its
// batch mates bring. Here every row runs the same code: a sum of squares in one fixed order.

#include <algorithm>
#include <cmath>
#include <vector>

#include "paddle/extension.h"
#include "rms_norm_row.h"
#include "work_pool.h"

namespace {

constexpr int64_t kRowsPerItem = 64;
constexpr int64_t kParallelElements = 1 << 18;  // below this one thread is faster

using fd_cpu::norm_row;

std::vector<paddle::Tensor> RmsNorm(const paddle::Tensor& x_in, const paddle::Tensor& w_in, float eps) {
  const paddle::Tensor x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  const paddle::Tensor w = w_in.is_contiguous() ? w_in : w_in.contiguous();
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && w.dtype() == paddle::DataType::FLOAT32,
           "rms_norm: x and weight must be float32");
  PD_CHECK(!x.shape().empty(), "rms_norm: x must have at least one axis");
  const int64_t d = x.shape().back();
  PD_CHECK(w.numel() == d, "rms_norm: weight has ", w.numel(), " elements, x's last axis ", d);
  const int64_t rows = d == 0 ? 0 : x.numel() / d;
  paddle::Tensor y = paddle::empty(x.shape(), paddle::DataType::FLOAT32, x.place());
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  float* yp = y.data<float>();
  fd_cpu::for_each_row(rows, kRowsPerItem, rows * d > kParallelElements,
                       [&](int64_t r) { norm_row(xp + r * d, wp, d, eps, yp + r * d); });
  return {y};
}

// The residual stream's add fused with the next norm: sum = x + delta, out = rms_norm(sum). One
// pass where Paddle's CPU add alone took 4.6 ms for [2048, 576]; the norm is norm_row on the sum,
// so `out` has the bits rms_norm_rows would give the sum.
std::vector<paddle::Tensor> AddRmsNorm(const paddle::Tensor& x_in, const paddle::Tensor& delta_in,
                                       const paddle::Tensor& w_in, float eps) {
  const paddle::Tensor x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  const paddle::Tensor delta = delta_in.is_contiguous() ? delta_in : delta_in.contiguous();
  const paddle::Tensor w = w_in.is_contiguous() ? w_in : w_in.contiguous();
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 && delta.dtype() == paddle::DataType::FLOAT32 &&
               w.dtype() == paddle::DataType::FLOAT32,
           "add_rms_norm: x, delta and weight must be float32");
  PD_CHECK(x.shape() == delta.shape(), "add_rms_norm: x and delta must have one shape");
  PD_CHECK(!x.shape().empty(), "add_rms_norm: x must have at least one axis");
  const int64_t d = x.shape().back();
  PD_CHECK(w.numel() == d, "add_rms_norm: weight has ", w.numel(), " elements, x's last axis ", d);
  const int64_t rows = d == 0 ? 0 : x.numel() / d;
  paddle::Tensor sum = paddle::empty(x.shape(), paddle::DataType::FLOAT32, x.place());
  paddle::Tensor y = paddle::empty(x.shape(), paddle::DataType::FLOAT32, x.place());
  const float* xp = x.data<float>();
  const float* dp = delta.data<float>();
  const float* wp = w.data<float>();
  float* sp = sum.data<float>();
  float* yp = y.data<float>();
  fd_cpu::for_each_row(rows, kRowsPerItem, rows * d > kParallelElements, [&](int64_t r) {
    for (int64_t j = 0; j < d; ++j) sp[r * d + j] = xp[r * d + j] + dp[r * d + j];
    norm_row(sp + r * d, wp, d, eps, yp + r * d);
  });
  return {sum, y};
}

}  // namespace

PD_BUILD_OP(add_rms_norm_rows)
    .Inputs({"x", "delta", "weight"})
    .Outputs({"sum", "out"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(AddRmsNorm));

PD_BUILD_OP(rms_norm_rows)
    .Inputs({"x", "weight"})
    .Outputs({"out"})
    .Attrs({"eps: float"})
    .SetKernelFn(PD_KERNEL(RmsNorm));
