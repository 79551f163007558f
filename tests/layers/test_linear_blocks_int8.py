"""custom_ops/cpu_ops/linear_blocks_int8.cc (FD_CPU_INT8_ACTIVATIONS, opt-in): GGUF blocks times int8
activations. Not exact by design, so the oracle is its own arithmetic written in numpy (activations
quantized per block of 32, integer sums, the float epilogue in the op's order) — equal bits — and
float64 on the dequantized weight within the quantization's error; a row's bits never depend on
its batch mates, and the portable twin gives the VNNI tiles' bits."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.layers import gguf_blocks
from fastdeploy.model_executor.layers.blas_gemm import linear_blocks_int8

sys.path.insert(0, os.path.dirname(__file__))
from test_linear_blocks import bits, dense_of, random_blocks  # noqa: E402

KINDS = ["u4_f16", "u4", "i8_f16", "i8"]  # scales (and offsets) that are halves are read as halves


def product(x: np.ndarray, b) -> np.ndarray:
    return linear_blocks_int8()(paddle.to_tensor(x), b.q, b.scale, b.offset, b.n).numpy()


def packed(weight):
    b = gguf_blocks.pack_int8(weight)
    b.n = weight.shape[0]
    return b


def numpy_int8_product(x: np.ndarray, weight) -> np.ndarray:
    """The op's arithmetic in numpy, float32 throughout (each fma: float64 then one rounding, exact)."""
    rows, k = x.shape
    groups = k // 32
    xb = x.reshape(rows, groups, 32)
    dx = np.abs(xb).max(-1) / np.float32(127)
    inv = np.where(dx != 0, np.float32(1) / np.where(dx != 0, dx, 1), 0).astype(np.float32)
    a = np.clip(np.rint(xb * inv[..., None]), -127, 127).astype(np.int64)
    q = weight.q.astype(np.int64).reshape(-1, groups, 32)
    dots = np.einsum("rgi,ngi->rng", a, q).astype(np.float32)  # [rows, n, groups]
    sa = a.sum(-1).astype(np.float32)  # [rows, groups]

    def fma(p, r, c):
        return (p.astype(np.float64) * r.astype(np.float64) + c.astype(np.float64)).astype(np.float32)

    if weight.offset is not None:
        t = fma(weight.scale[None], dots, weight.offset[None] * sa[:, None, :])
    else:
        t = weight.scale[None] * dots
    y = np.zeros((rows, q.shape[0]), np.float32)
    for g in range(groups):
        y = fma(dx[:, None, g], t[:, :, g], y)
    return y


@pytest.mark.parametrize("kind", KINDS)
def test_products_are_the_int8_arithmetic_bit_for_bit_and_near_float64(kind):
    n, k = 200, 320  # a partial last panel
    weight = random_blocks(kind, 32, n, k)
    b = packed(weight)
    rng = np.random.default_rng(1)
    for rows in (1, 3, 4, 5, 49):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        got = product(x, b)
        assert np.array_equal(got.view(np.int32), numpy_int8_product(x, weight).view(np.int32)), rows
        exact = x.astype(np.float64) @ dense_of(weight).astype(np.float64).T
        scale = np.abs(x).max() * np.abs(dense_of(weight)).sum(-1).max()
        assert np.abs(got - exact).max() < 0.01 * scale, rows  # int8 activations: ~1/254 per element


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_output_does_not_depend_on_its_batch_mates(kind):
    n, k = 96, 256
    b = packed(random_blocks(kind, 32, n, k, seed=2))
    rng = np.random.default_rng(3)
    row = rng.standard_normal((1, k)).astype(np.float32)
    alone = product(row, b).view(np.int32)
    for mates in (1, 2, 3, 7, 60):
        batch = np.concatenate([rng.standard_normal((mates, k)).astype(np.float32), row])
        assert np.array_equal(product(batch, b)[-1:].view(np.int32), alone), mates


def test_scales_that_are_halves_are_read_as_halves():
    assert gguf_blocks.pack_int8(random_blocks("u4_f16", 32, 64, 64)).scale.dtype == paddle.float16
    assert gguf_blocks.pack_int8(random_blocks("u4", 32, 64, 64)).scale.dtype == paddle.float32


def test_blocks_narrower_than_32_keep_the_exact_kernel():
    assert gguf_blocks.pack_int8(random_blocks("i8", 16, 64, 64)) is None


_GENERIC_RUN = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_linear_blocks_int8 import products_of_both_kinds
np.save({path!r}, products_of_both_kinds())
"""


def products_of_both_kinds() -> np.ndarray:
    rng = np.random.default_rng(4)
    outs = []
    for kind in KINDS:
        b = packed(random_blocks(kind, 32, 70, 224, seed=5))
        for rows in (1, 2, 4, 9):
            outs.append(product(rng.standard_normal((rows, 224)).astype(np.float32), b).ravel())
    return np.concatenate(outs)


def test_every_instruction_set_gives_the_best_kernels_bits(tmp_path, capped_isa):
    path = str(tmp_path / f"{capped_isa}.npy")
    env = {**os.environ, "FD_CPU_LINEAR_ISA": capped_isa}
    subprocess.run([sys.executable, "-c", _GENERIC_RUN.format(tests=os.path.dirname(__file__), path=path)], env=env,
                   check=True, timeout=600, capture_output=True, text=True)
    assert np.array_equal(np.load(path).view(np.int32), products_of_both_kinds().view(np.int32))
