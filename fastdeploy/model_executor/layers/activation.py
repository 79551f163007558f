"""The gated MLP activation `act(gate) * up` on a fused gate/up GEMM output `[.., 2F]` (gate first),
one entry for every device.

CPU float32 -> one op (custom_ops/cpu_ops/gated_activation.cc): a single pass where Paddle takes two
slices, the activation and a multiply (its CPU SiLU alone cost 55 ms per layer at 2048 rows of
SmolLM2); elementwise, so a row's bits never depend on its batch mates. Elsewhere -> Paddle ops.
"""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

from fastdeploy.model_executor.layers.blas_gemm import gated_activation_rows

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def gated_activation(gate_up: paddle.Tensor, activation: str) -> paddle.Tensor:
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    if gate_up.place.is_cpu_place() and gate_up.dtype == paddle.float32:
        return gated_activation_rows()(gate_up, ACTIVATIONS[activation])
    gate, up = paddle.split(gate_up, 2, axis=-1)
    act = F.gelu(gate, approximate=True) if activation == "gelu_tanh" else F.silu(gate)
    return act * up
