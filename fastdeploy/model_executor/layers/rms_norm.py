"""RMSNorm over the last axis (alone, or fused with the residual add before it), one entry for every device.

CPU float32 -> the row-invariant op (custom_ops/cpu_ops/rms_norm.cc): Paddle's CPU mean over the last
axis gives the tail rows of a batch other bits than the rest, which would make a request's tokens
depend on its batch mates. Elsewhere (GPU, bf16) -> Paddle ops, normalising in float32 and scaling
in the weight's dtype as PaddleFormers does.
"""

from __future__ import annotations

import paddle

from fastdeploy.model_executor.layers.blas_gemm import add_rms_norm_rows, rms_norm_rows


def _cpu_float32(x: paddle.Tensor, *others: paddle.Tensor) -> bool:
    """x on the CPU and every tensor float32; the others share x's device (one model, one device), so
    only x's place is asked: it is the costly check, and this runs twice per layer per step."""
    return x.dtype == paddle.float32 and all(t.dtype == paddle.float32 for t in others) and x.place.is_cpu_place()


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    if _cpu_float32(x, weight):
        return rms_norm_rows()(x, weight, float(eps))
    x32 = x if x.dtype == paddle.float32 else x.astype("float32")
    normed = x32 * paddle.rsqrt((x32 * x32).mean(axis=-1, keepdim=True) + eps)
    return (normed if normed.dtype == weight.dtype else normed.astype(weight.dtype)) * weight


def add_rms_norm(x: paddle.Tensor, delta: paddle.Tensor, weight: paddle.Tensor, eps: float) -> tuple:
    """(x + delta, rms_norm(x + delta)): the residual stream's add and the next norm, one pass on the
    CPU (Paddle's CPU add alone took 4.6 ms for [2048, 576] rows)."""
    if _cpu_float32(x, delta, weight):
        total, normed = add_rms_norm_rows()(x, delta, weight, float(eps))
        return total, normed
    total = x + delta
    return total, rms_norm(total, weight, eps)
