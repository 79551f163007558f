"""custom_ops/cpu_ops/decoder_stack.cc's binding: a malformed binding is refused with one line naming
what is wrong, and a released binding cannot be run (its layers' bits are tested on SmolLM2 in
tests/real_models/test_decoder_stack.py)."""

from __future__ import annotations

import paddle
import pytest

from fastdeploy.model_executor.layers.blas_gemm import decoder_stack_ops

NO_HEAD = [paddle.zeros([0])] * 4


def test_a_binding_needs_every_operand_of_every_layer_and_of_its_head():
    bind, _, _ = decoder_stack_ops()
    with pytest.raises(Exception, match="22 tensors per layer, got 3"):
        bind([paddle.zeros([1])] * 3, NO_HEAD, [0] * 14, [], 1e-5, 0)
    with pytest.raises(Exception, match="14 integers per layer, got 13 for 1 layers"):
        bind([paddle.zeros([1])] * 22, NO_HEAD, [0] * 13, [], 1e-5, 0)
    with pytest.raises(Exception, match=r"a head is 4 tensors \(norm, q, scale, offset\) and 3 integers"):
        bind([paddle.zeros([1])] * 22, NO_HEAD, [0] * 14, [49152, 32], 1e-5, 0)


def test_a_released_binding_cannot_run():
    bind, forward, release = decoder_stack_ops()
    handle = bind([paddle.zeros([1])] * 22, NO_HEAD, [0] * 14, [], 1e-5, 0)
    release(handle)
    step = [paddle.zeros([1], dtype="int32")] * 5
    with pytest.raises(Exception, match=f"no binding {int(handle.numpy()[0])} \\(released, or never bound\\)"):
        forward(handle, paddle.zeros([1, 4]), *step, paddle.zeros([0], dtype="int64"))
