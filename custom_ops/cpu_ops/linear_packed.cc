// CPU dense layer on a weight packed once at load: y[M, N] = x[M, K] . W[N, K]^T.
//
// Packed layout: [P, K, 32] float32, P = ceil(N / 32); panel p holds output
// columns [32p, 32p + 32) (zero past N), k-major, so a step streams each panel
// once and 32 outputs of a row take two 16-wide FMAs per k.
//
// Why not a BLAS here (measured in benchmarks/bench_linear_cpu.py): OpenBLAS's
// sgemm packs the weight again on every call and is 3-5x slower than this for
// the 1-8 rows of a decode step, and no BLAS promises a row the same bits
// whatever the row count. This kernel does by construction: every output is
// one chain of fused multiply-adds over k = 0..K-1 from 0.0f, whichever row
// tile, thread or instruction set (AVX-512, AVX2, scalar std::fma — all
// correctly rounded, so all give the same bits) computes it. A request's
// tokens therefore cannot depend on its batch mates, with no row padding.

#include <cmath>
#include <cstring>
#include <vector>

#include "paddle/extension.h"
#include "linear_tiles.h"
#include "work_pool.h"

namespace {

using namespace fd_cpu::linear;

std::vector<paddle::Tensor> LinearPacked(const paddle::Tensor& x_in,
                                         const paddle::Tensor& packed,
                                         int64_t n) {
  const paddle::Tensor x = x_in.is_contiguous() ? x_in : x_in.contiguous();
  PD_CHECK(x.dtype() == paddle::DataType::FLOAT32 &&
               packed.dtype() == paddle::DataType::FLOAT32,
           "linear_packed: x and the packed weight must be float32");
  PD_CHECK(x.is_cpu() && packed.is_cpu(), "linear_packed: CPU tensors only");
  PD_CHECK(packed.is_contiguous() && packed.shape().size() == 3 &&
               packed.shape()[2] == kPanel,
           "linear_packed: the weight must be packed [panels, in, 32]");
  const auto& xs = x.shape();
  PD_CHECK(!xs.empty(), "linear_packed: x must have at least one dimension");
  const int64_t k_dim = xs.back(), panels = packed.shape()[0];
  PD_CHECK(packed.shape()[1] == k_dim, "linear_packed: x's last dimension (",
           k_dim, ") must equal the weight's in-features (", packed.shape()[1], ")");
  PD_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel,
           "linear_packed: out-features ", n, " do not match ", panels, " panels");
  const int64_t m = k_dim == 0 ? 0 : x.numel() / k_dim;
  std::vector<int64_t> out_shape(xs.begin(), xs.end());
  out_shape.back() = n;
  paddle::Tensor y = paddle::empty(out_shape, paddle::DataType::FLOAT32, x.place());
  if (m == 0 || n == 0) return {y};
  float* yp = y.data<float>();
  if (k_dim == 0) {
    std::memset(yp, 0, sizeof(float) * size_t(m * n));
    return {y};
  }
  packed_product(x.data<float>(), m, k_dim, packed.data<float>(), panels, yp, n,
                 float_product_worth_helpers(m, n, k_dim));
  return {y};
}

template <typename Id>
void gather_packed_rows(const float* wp, int64_t k_dim, const Id* id, int64_t t,
                        int64_t n, float* op) {
  for (int64_t i = 0; i < t; ++i) {
    const int64_t v = int64_t(id[i]);
    PD_CHECK(v >= 0 && v < n, "packed_rows: id ", v, " out of range [0, ", n, ")");
    const float* src = wp + (v / kPanel) * k_dim * kPanel + v % kPanel;
    for (int64_t k = 0; k < k_dim; ++k) op[i * k_dim + k] = src[k * kPanel];
  }
}

// Rows `ids` of the unpacked weight (an embedding lookup on a packed tied table).
std::vector<paddle::Tensor> PackedRows(const paddle::Tensor& packed,
                                       const paddle::Tensor& ids_in, int64_t n) {
  const paddle::Tensor ids = ids_in.is_contiguous() ? ids_in : ids_in.contiguous();
  PD_CHECK(ids.dtype() == paddle::DataType::INT64 || ids.dtype() == paddle::DataType::INT32,
           "packed_rows: ids must be int32 or int64");
  PD_CHECK(packed.is_contiguous() && packed.shape().size() == 3 && packed.shape()[2] == kPanel,
           "packed_rows: the weight must be packed [panels, in, 32]");
  const int64_t k_dim = packed.shape()[1], t = ids.numel();
  paddle::Tensor out = paddle::empty({t, k_dim}, paddle::DataType::FLOAT32, packed.place());
  if (ids.dtype() == paddle::DataType::INT64)
    gather_packed_rows(packed.data<float>(), k_dim, ids.data<int64_t>(), t, n, out.data<float>());
  else
    gather_packed_rows(packed.data<float>(), k_dim, ids.data<int32_t>(), t, n, out.data<float>());
  return {out};
}

}  // namespace

PD_BUILD_OP(linear_packed)
    .Inputs({"x", "packed"})
    .Outputs({"out"})
    .Attrs({"n: int64_t"})
    .SetKernelFn(PD_KERNEL(LinearPacked));

PD_BUILD_OP(packed_rows)
    .Inputs({"packed", "ids"})
    .Outputs({"out"})
    .Attrs({"n: int64_t"})
    .SetKernelFn(PD_KERNEL(PackedRows));
