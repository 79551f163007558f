"""RMSNorm over the last axis, one entry for every device.

CPU float32 -> the row-invariant op (custom_ops/cpu_ops/rms_norm.cc): Paddle's CPU mean over the last
axis gives the tail rows of a batch other bits than the rest, which would make a request's tokens
depend on its batch mates. Elsewhere (GPU, bf16) -> Paddle ops, normalising in float32 and scaling
in the weight's dtype as PaddleFormers does.
"""

from __future__ import annotations

import paddle

from fastdeploy.model_executor.layers.blas_gemm import rms_norm_rows


def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    if x.place.is_cpu_place() and x.dtype == paddle.float32 and weight.dtype == paddle.float32:
        return rms_norm_rows()(x, weight, float(eps))
    x32 = x if x.dtype == paddle.float32 else x.astype("float32")
    normed = x32 * paddle.rsqrt((x32 * x32).mean(axis=-1, keepdim=True) + eps)
    return (normed if normed.dtype == weight.dtype else normed.astype(weight.dtype)) * weight
