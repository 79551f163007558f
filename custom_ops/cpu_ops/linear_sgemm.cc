// CPU dense layer: y[M, N] = x[M, K] . w[N, K]^T in float32, through OpenBLAS's
// sgemm (the scipy-openblas32 wheel, whose symbols carry a `scipy_` prefix).
//
// `w` stays in the checkpoint's [out, in] layout: OpenBLAS packs B on every call
// whatever its layout (measured: NT runs as fast as NN here), and the
// transposed call also keeps sgemm off its "direct" path, which OpenBLAS takes
// only for untransposed row-major operands and which blocks differently.
//
// Batch invariance (a row's bits must not depend on the other rows): OpenBLAS's
// regular level-3 path gives every row the same bits for any M (one K-blocking
// chosen from K alone, every element accumulated in the same order whichever
// thread or edge kernel computes it). Small products take a "small matrix"
// kernel instead (SkylakeX and newer: M*N*K <= 100^3), which rounds
// differently. Those calls are padded with zero rows until they leave that
// range, so every M is served by the regular path. tests/layers/test_linear.py
// checks the invariance on the library this machine loads.

#include <cblas.h>

#include <cstring>
#include <vector>

#include "paddle/extension.h"

namespace {

// OpenBLAS's small-matrix kernels serve only products with M*N*K at most this.
constexpr double kSmallKernelMaxMNK = 100.0 * 100.0 * 100.0;

int64_t regular_path_rows(int64_t m, int64_t n, int64_t k) {
  const double nk = double(n) * double(k);
  if (double(m) * nk > kSmallKernelMaxMNK || nk == 0) return m;
  return int64_t(kSmallKernelMaxMNK / nk) + 1;
}

void sgemm_nt(int64_t m, int64_t n, int64_t k, const float* x, const float* w,
              float* y) {
  scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, blasint(m),
                    blasint(n), blasint(k), 1.0f, x, blasint(k), w, blasint(k),
                    0.0f, y, blasint(n));
}

std::vector<paddle::Tensor> LinearSgemm(const paddle::Tensor& x_in,
                                        const paddle::Tensor& w_in) {
  // A strided view (a slice of another tensor) is copied once; a dense one is used as is.
  const paddle::Tensor x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  const paddle::Tensor w = w_in.is_contiguous() ? w_in : w_in.contiguous();
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 &&
               w.dtype() == paddle::DataType::FLOAT32,
           "linear_sgemm: x and w must be float32");
  PD_CHECK(x.is_cpu() && w.is_cpu(), "linear_sgemm: x and w must be on the CPU");
  PD_CHECK(w.shape().size() == 2, "linear_sgemm: w must be [out, in]");
  const auto& xs = x.shape();
  PD_CHECK(!xs.empty(), "linear_sgemm: x must have at least one dimension");
  const int64_t k = xs.back(), n = w.shape()[0];
  PD_CHECK(w.shape()[1] == k, "linear_sgemm: x's last dimension (", k,
           ") must equal w's in-features (", w.shape()[1], ")");
  const int64_t m = k == 0 ? 0 : x.numel() / k;
  std::vector<int64_t> out_shape(xs.begin(), xs.end());
  out_shape.back() = n;
  paddle::Tensor y = paddle::empty(out_shape, paddle::DataType::FLOAT32, x.place());
  if (m == 0 || n == 0) return {y};
  if (k == 0) {
    std::memset(y.data<float>(), 0, sizeof(float) * size_t(m * n));
    return {y};
  }
  const int64_t rows = regular_path_rows(m, n, k);
  if (rows == m) {
    sgemm_nt(m, n, k, x.data<float>(), w.data<float>(), y.data<float>());
    return {y};
  }
  // Small product: run it with zero rows appended (a thread's scratch, reused).
  thread_local std::vector<float> x_pad, y_pad;
  x_pad.assign(size_t(rows * k), 0.0f);
  y_pad.resize(size_t(rows * n));
  std::memcpy(x_pad.data(), x.data<float>(), sizeof(float) * size_t(m * k));
  sgemm_nt(rows, n, k, x_pad.data(), w.data<float>(), y_pad.data());
  std::memcpy(y.data<float>(), y_pad.data(), sizeof(float) * size_t(m * n));
  return {y};
}

std::vector<std::vector<int64_t>> LinearSgemmShape(
    const std::vector<int64_t>& x_shape, const std::vector<int64_t>& w_shape) {
  std::vector<int64_t> out(x_shape);
  out.back() = w_shape[0];
  return {out};
}

std::vector<paddle::DataType> LinearSgemmDtype(const paddle::DataType& x_dtype,
                                               const paddle::DataType&) {
  return {x_dtype};
}

}  // namespace

PD_BUILD_OP(linear_sgemm)
    .Inputs({"x", "w"})
    .Outputs({"out"})
    .SetKernelFn(PD_KERNEL(LinearSgemm))
    .SetInferShapeFn(PD_INFER_SHAPE(LinearSgemmShape))
    .SetInferDtypeFn(PD_INFER_DTYPE(LinearSgemmDtype));
