// CPU dense layer on a weight used as it is stored: y[M, N] = x[M, K] . w[N, K]^T
// in float32 (MoE experts and routers, whose weights are not packed at load).
//
// The weight is packed into linear_packed's panel layout on every call (a
// thread's scratch, reused) and multiplied by the same tiles, so a row gets the
// same bits whatever its batch mates and row count, on every instruction set.
// A BLAS gives no such promise: OpenBLAS's Haswell/Zen kernels (measured,
// scipy-openblas32 0.3.34) round a row differently at M = 1 (its GEMV path)
// and at M >= 7 than at M = 2..5. Packing reads and writes the weight once, as
// a BLAS does on every call.

#include <cstring>
#include <vector>

#include "paddle/extension.h"
#include "linear_tiles.h"

namespace {

using namespace fd_cpu::linear;

// w [n, k] -> panels [ceil(n / 32), k, 32], columns past n zero.
void pack_panels(const float* w, int64_t n, int64_t k, float* out) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  for (int64_t p = 0; p < panels; ++p) {
    float* panel = out + p * k * kPanel;
    const int64_t cols = std::min<int64_t>(kPanel, n - p * kPanel);
    if (cols < kPanel) std::memset(panel, 0, sizeof(float) * size_t(k * kPanel));
    for (int64_t c = 0; c < cols; ++c) {
      const float* row = w + (p * kPanel + c) * k;
      for (int64_t i = 0; i < k; ++i) panel[i * kPanel + c] = row[i];
    }
  }
}

std::vector<paddle::Tensor> LinearUnpacked(const paddle::Tensor& x_in,
                                           const paddle::Tensor& w_in) {
  // A strided view (a slice of another tensor) is copied once; a dense one is used as is.
  const paddle::Tensor x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  const paddle::Tensor w = w_in.is_contiguous() ? w_in : w_in.contiguous();
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 &&
               w.dtype() == paddle::DataType::FLOAT32,
           "linear_unpacked: x and w must be float32");
  PD_CHECK(x.is_cpu() && w.is_cpu(), "linear_unpacked: x and w must be on the CPU");
  PD_CHECK(w.shape().size() == 2, "linear_unpacked: w must be [out, in]");
  const auto& xs = x.shape();
  PD_CHECK(!xs.empty(), "linear_unpacked: x must have at least one dimension");
  const int64_t k = xs.back(), n = w.shape()[0];
  PD_CHECK(w.shape()[1] == k, "linear_unpacked: x's last dimension (", k,
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
  const int64_t panels = (n + kPanel - 1) / kPanel;
  thread_local std::vector<float> packed;
  packed.resize(size_t(panels * k * kPanel));
  pack_panels(w.data<float>(), n, k, packed.data());
  packed_product(x.data<float>(), m, k, packed.data(), panels, y.data<float>(), n,
                 float_product_worth_helpers(m, n, k));
  return {y};
}

}  // namespace

PD_BUILD_OP(linear_unpacked)
    .Inputs({"x", "w"})
    .Outputs({"out"})
    .SetKernelFn(PD_KERNEL(LinearUnpacked));
