"""Dense layers: `y = x . W^T` with W in the checkpoint's `[out, in]` layout, one entry for every
device.

- CPU float32 -> OpenBLAS sgemm (blas_gemm.py): near this machine's GEMM peak, and row-invariant:
  a row's output has the same bits whatever the other rows of the batch are and however many
  there are, so no row padding is needed for batch invariance.
- anything else (GPU tensors, bf16/fp16) -> `paddle.matmul(x, W, transpose_y=True)` (cuBLAS on the
  GPU), its rows padded to a multiple of ROW_ALIGN: Paddle's GEMM gives a row the same bits only
  when the row count is such a multiple (remainder rows take another code path).

`FusedLinear` packs several weights that read the same input (q/k/v; gate/up) into one `[sum out,
in]` tensor once at load, so a step runs one GEMM instead of several. The parts stay reachable
under their own names as row views of the fused tensor (no second copy).
"""

from __future__ import annotations

import paddle

from fastdeploy.model_executor.layers.blas_gemm import linear_sgemm


def uses_cpu_gemm(x: paddle.Tensor, weight: paddle.Tensor) -> bool:
    return x.place.is_cpu_place() and x.dtype == paddle.float32 and weight.dtype == paddle.float32


ROW_ALIGN = 8


def linear(x: paddle.Tensor, weight: paddle.Tensor) -> paddle.Tensor:
    """`x [rows, in] . weight[out, in]^T -> [rows, out]`."""
    if uses_cpu_gemm(x, weight):
        return linear_sgemm()(x, weight)
    rows = x.shape[0]
    extra = -rows % ROW_ALIGN
    if extra == 0:
        return paddle.matmul(x, weight, transpose_y=True)
    padded = paddle.concat([x, paddle.zeros([extra] + list(x.shape[1:]), dtype=x.dtype)], axis=0)
    return paddle.matmul(padded, weight, transpose_y=True)[:rows]


class FusedLinear:
    """Weights `[out_i, in]` concatenated along out: `__call__` is one GEMM giving the parts'
    outputs side by side, `split` separates them (views, no copy)."""

    def __init__(self, parts: list):
        if not parts:
            raise ValueError("FusedLinear needs at least one weight")
        ins = {int(p.shape[1]) for p in parts}
        if len(ins) != 1 or len({p.dtype for p in parts}) != 1:
            raise ValueError(f"FusedLinear: the weights must share in-features and dtype, got shapes "
                             f"{[list(p.shape) for p in parts]} and dtypes {[str(p.dtype) for p in parts]}")
        self.sizes = [int(p.shape[0]) for p in parts]
        self.weight = parts[0] if len(parts) == 1 else paddle.concat(parts, axis=0)
        if not self.weight.is_contiguous():
            self.weight = self.weight.contiguous()

    def part_views(self) -> list:
        """Each part as rows of the fused tensor (replace the originals with these to free them)."""
        views, start = [], 0
        for size in self.sizes:
            views.append(self.weight[start:start + size])
            start += size
        return views

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        return linear(x, self.weight)

    def split(self, y: paddle.Tensor) -> list:
        """The parts of a fused output `[.., sum out]`, in the order the weights were given."""
        outs, start = [], 0
        for size in self.sizes:
            outs.append(y[..., start:start + size])
            start += size
        return outs


def fuse_named(weights: dict, names: list) -> FusedLinear:
    """Fuse `weights[name]` for `names`, and point each name at its view of the fused tensor, so
    the model's name -> tensor dict keeps working (and the separate copies are freed)."""
    fused = FusedLinear([weights[n] for n in names])
    if len(names) > 1:
        for name, view in zip(names, fused.part_views()):
            weights[name] = view
    return fused
