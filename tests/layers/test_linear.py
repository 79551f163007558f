"""The CPU GEMMs behind layers/linear.py (the packed kernel of a `Linear`, the same tiles on a
weight packed per call for `linear()`): float64-accurate, and row-invariant for every row count, which is what lets the
decoder drop its row padding and still give a request the same tokens whichever requests share
its batch."""

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.layers import linear as linear_mod
from fastdeploy.model_executor.layers.linear import Linear, fuse_named, linear

# (in, out): SmolLM2's projections (q, fused q/k/v, fused gate/up, down, lm_head) and the tiny
# preset's (small products, which many BLAS kernels round differently).
SHAPES = [(576, 576), (576, 960), (576, 3072), (1536, 576), (576, 49152), (256, 512), (256, 259), (64, 24)]
ROW_COUNTS = list(range(1, 67)) + [96, 128, 129, 257]


@pytest.mark.parametrize("gemm", ["packed", "unpacked"])
@pytest.mark.parametrize("k,n", SHAPES)
def test_a_row_gets_the_same_bits_whatever_its_batch_mates_and_batch_size(k, n, gemm):
    rng = np.random.default_rng(k * 7 + n)
    weight = paddle.to_tensor((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))
    run = Linear([weight]) if gemm == "packed" else (lambda x: linear(x, weight))
    probe = rng.standard_normal((1, k)).astype(np.float32)
    alone = run(paddle.to_tensor(probe)).numpy()[0]
    for m in ROW_COUNTS if n * k <= 576 * 1536 else ROW_COUNTS[::4]:
        mates = rng.standard_normal((m, k)).astype(np.float32)
        row = int(rng.integers(m))
        mates[row] = probe[0]
        got = run(paddle.to_tensor(mates)).numpy()[row]
        assert np.array_equal(got, alone), f"[{m}, {k}] x [{k}, {n}]: row {row} differs from the same row alone"


@pytest.mark.parametrize("gemm", ["packed", "unpacked"])
@pytest.mark.parametrize("m,k,n", [(1, 576, 1536), (7, 256, 259), (33, 576, 960), (300, 64, 24), (13, 5, 33)])
def test_matches_float64_reference(m, k, n, gemm):
    rng = np.random.default_rng(m + k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w_pd = paddle.to_tensor(w)
    got = (Linear([w_pd]) if gemm == "packed" else lambda t: linear(t, w_pd))(paddle.to_tensor(x)).numpy()
    want = x.astype(np.float64) @ w.astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_a_strided_row_slice_is_read_as_its_values():
    rng = np.random.default_rng(1)
    x = paddle.to_tensor(rng.standard_normal((10, 64)).astype(np.float32))
    w = paddle.to_tensor(rng.standard_normal((32, 128)).astype(np.float32))
    cols = w[:, 32:96]  # not contiguous
    want = x.numpy().astype(np.float64) @ cols.numpy().astype(np.float64).T
    np.testing.assert_allclose(linear(x, cols).numpy(), want, rtol=1e-4, atol=1e-4)


def test_empty_batch_gives_an_empty_result():
    w = paddle.ones([8, 4], dtype="float32")
    assert linear(paddle.zeros([0, 4], dtype="float32"), w).shape == [0, 8]


def test_other_dtypes_take_paddles_matmul_and_agree():
    # (Paddle's CPU matmul has no bf16 kernel; float64 takes the same fallback a GPU or bf16 model does.)
    rng = np.random.default_rng(2)
    x = paddle.to_tensor(rng.standard_normal((5, 32)).astype(np.float32))
    w = paddle.to_tensor(rng.standard_normal((16, 32)).astype(np.float32))
    assert linear_mod.uses_cpu_gemm(x, w)
    assert not linear_mod.uses_cpu_gemm(x.astype("float64"), w.astype("float64"))
    wide = linear(x.astype("float64"), w.astype("float64")).numpy()
    assert wide.shape == (5, 16)  # the fallback's row padding is cut off again
    np.testing.assert_allclose(wide, linear(x, w).numpy(), rtol=1e-5, atol=1e-5)


def test_fused_weights_give_each_parts_output_and_keep_their_names_as_views():
    rng = np.random.default_rng(3)
    names = ["q", "k", "v"]
    weights = {n: paddle.to_tensor(rng.standard_normal((rows, 48)).astype(np.float32))
               for n, rows in zip(names, (64, 16, 17))}
    originals = {n: w.numpy().copy() for n, w in weights.items()}
    fused = fuse_named(weights, names)
    assert fused.packed is not None and fused.dense is None  # one packed copy, the dense ones dropped
    x = paddle.to_tensor(rng.standard_normal((9, 48)).astype(np.float32))
    parts = fused.split(fused(x))
    for name, part in zip(names, parts):
        np.testing.assert_array_equal(weights[name].numpy(), originals[name])
        assert weights[name].shape == list(originals[name].shape)
        np.testing.assert_allclose(part.numpy(), x.numpy() @ originals[name].T, rtol=1e-5, atol=1e-4)


def test_rows_of_a_packed_weight_are_its_embedding_lookup():
    rng = np.random.default_rng(4)
    table = rng.standard_normal((70, 24)).astype(np.float32)
    head = Linear([paddle.to_tensor(table)])
    ids = np.array([0, 31, 32, 69, 5, 5], np.int64)
    np.testing.assert_array_equal(head.rows(paddle.to_tensor(ids)).numpy(), table[ids])
    with pytest.raises(Exception, match="out of range"):
        head.rows(paddle.to_tensor(np.array([70], np.int64)))


def test_fusing_weights_of_different_input_widths_is_a_clear_error():
    with pytest.raises(ValueError, match="in-features"):
        Linear([paddle.ones([4, 8]), paddle.ones([4, 9])])


