"""The CPU RMSNorm gives a row the same bits whatever its batch mates and their number (Paddle's own
reduction does not on every CPU), and equals a float64 reference."""

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.layers.rms_norm import add_rms_norm, rms_norm

WIDTH = 576  # SmolLM2's hidden size


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 15, 16, 17, 33, 34, 64, 65, 129])
def test_a_row_keeps_its_bits_whatever_its_batch_mates(rows):
    rng = np.random.default_rng(rows)
    probe = rng.standard_normal(WIDTH).astype(np.float32)
    weight = paddle.to_tensor(rng.standard_normal(WIDTH).astype(np.float32))
    alone = rms_norm(paddle.to_tensor(probe[None]), weight, 1e-5).numpy()[0]
    for position in {0, rows // 2, rows - 1}:
        batch = rng.standard_normal((rows, WIDTH)).astype(np.float32)
        batch[position] = probe
        assert np.array_equal(rms_norm(paddle.to_tensor(batch), weight, 1e-5).numpy()[position], alone)


def test_rms_norm_equals_a_float64_reference_on_2d_and_per_head_3d_input():
    rng = np.random.default_rng(0)
    for shape in [(5, WIDTH), (3, 4, 64)]:
        x = rng.standard_normal(shape).astype(np.float32) * 3
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        x64 = x.astype(np.float64)
        ref = x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + 1e-6) * w
        got = rms_norm(paddle.to_tensor(x), paddle.to_tensor(w), 1e-6).numpy()
        np.testing.assert_allclose(got, ref, rtol=2e-6, atol=2e-6)


def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit():
    rng = np.random.default_rng(3)
    for rows in (1, 9, 70):
        x, delta = (rng.standard_normal((rows, WIDTH)).astype(np.float32) for _ in range(2))
        w = paddle.to_tensor(rng.standard_normal(WIDTH).astype(np.float32))
        total, normed = add_rms_norm(paddle.to_tensor(x), paddle.to_tensor(delta), w, 1e-5)
        assert np.array_equal(total.numpy(), x + delta)
        assert np.array_equal(normed.numpy(), rms_norm(paddle.to_tensor(x + delta), w, 1e-5).numpy())
