"""custom_ops/cpu_ops/decoder_block_ops.cc: a decoder layer's dense work fused into two op calls
gives the bits of the op-by-op path (add_rms_norm_rows, linear_blocks / linear_blocks_int8,
gated_activation) for exact and int8-activation weights at every row count."""

from __future__ import annotations

import os
import sys

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.layers import gguf_blocks
from fastdeploy.model_executor.layers.blas_gemm import add_rms_norm_rows, decoder_block_ops, gated_activation_rows, \
    linear_blocks, linear_blocks_int8, rms_norm_rows

sys.path.insert(0, os.path.dirname(__file__))
from test_linear_blocks import random_blocks  # noqa: E402

H, A, F = 64, 96, 160  # hidden, heads * head_dim, FFN (not multiples of the 32-column panel: partial panels)
EPS = 1e-5


def weight(kind, n, k, seed, int8):
    w = random_blocks(kind, 32, n, k, seed)
    if int8:
        b = gguf_blocks.pack_int8(w)
        return (b.q, b.scale, b.offset, n, 32, 2), lambda x: linear_blocks_int8()(x, b.q, b.scale, b.offset, n)
    b = gguf_blocks.pack(w)
    kind_id = 1 if b.one_rounding else 0
    return (b.q, b.scale, b.offset, n, 32, kind_id), \
        lambda x: linear_blocks()(x, b.q, b.scale, b.offset, n, 32, b.one_rounding)


def bits(t) -> np.ndarray:
    return t.numpy().view(np.int32)


@pytest.mark.parametrize("kind,int8", [("u4", False), ("u4_f16", False), ("i8", False), ("u4_f16", True),
                                       ("i8", True)])
def test_fused_layer_gives_the_op_by_op_bits(kind, int8):
    qkv, qkv_ref = weight(kind, A, H, 1, int8)
    o, o_ref = weight(kind, H, A, 2, int8)
    gu, gu_ref = weight(kind, 2 * F, H, 3, int8)
    down, down_ref = weight(kind, H, F, 4, int8)
    rng = np.random.default_rng(0)
    norm1 = paddle.to_tensor((1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
    norm2 = paddle.to_tensor((1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
    norm_qkv, mlp = decoder_block_ops()
    for rows in (1, 3, 50):
        hidden = paddle.to_tensor(rng.standard_normal((rows, H)).astype(np.float32))
        pending = paddle.to_tensor(rng.standard_normal((rows, H)).astype(np.float32))
        attn = paddle.to_tensor(rng.standard_normal((rows, A)).astype(np.float32))
        for delta in (pending, None):
            got_sum, got_qkv = norm_qkv(hidden, delta, norm1, *qkv[:3], qkv[3], qkv[4], qkv[5], EPS)
            if delta is None:
                want_sum, normed = hidden, rms_norm_rows()(hidden, norm1, EPS)
            else:
                want_sum, normed = add_rms_norm_rows()(hidden, delta, norm1, EPS)
            assert np.array_equal(bits(got_sum), bits(want_sum)) and np.array_equal(bits(got_qkv), bits(qkv_ref(normed)))
        got_sum, got_ffn = mlp(attn, hidden, *o[:3], norm2, *gu[:3], *down[:3], o[4], o[5], gu[3], gu[4], gu[5],
                               down[4], down[5], EPS, 0)
        want_sum, normed = add_rms_norm_rows()(hidden, o_ref(attn), norm2, EPS)
        want_ffn = down_ref(gated_activation_rows()(gu_ref(normed), 0))
        assert np.array_equal(bits(got_sum), bits(want_sum)), rows
        assert np.array_equal(bits(got_ffn), bits(want_ffn)), rows
