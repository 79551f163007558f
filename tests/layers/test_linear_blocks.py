"""custom_ops/cpu_ops/linear_blocks.cc: a dense layer on GGUF blocks gives, for every row count and
batch, the bits of linear_packed.cc on the dequantized float32 weight (its oracle for the products,
itself checked against float64 in test_linear.py), and clear errors for bad operands."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.layers import gguf_blocks
from fastdeploy.model_executor.layers.blas_gemm import block_rows, linear_blocks, linear_packed, pack

# "u4_f16": u4 blocks with half-precision scales and offsets, as Q4_1 stores them (scale * q exact in float32: the
# decode rebuilds each weight with one FMA); "u4": float32 scales of full precision (two roundings).
FORMS = [("u4", 32), ("u4_f16", 32), ("i8", 32), ("i8_f16", 32), ("i8", 16)]


def random_blocks(kind: str, group: int, n: int, k: int, seed: int = 0) -> gguf_blocks.BlockWeight:
    rng = np.random.default_rng(seed)
    scale = (rng.standard_normal((n, k // group)) * 0.05).astype(np.float32)
    if kind.endswith("_f16"):
        scale = scale.astype(np.float16).astype(np.float32)
    if kind.startswith("u4"):
        offset = (rng.standard_normal((n, k // group)) * 0.1).astype(np.float32)
        if kind.endswith("_f16"):  # Q4_1 stores both as halves
            offset = offset.astype(np.float16).astype(np.float32)
        return gguf_blocks.BlockWeight(rng.integers(0, 16, (n, k), dtype=np.uint8), np.abs(scale), offset, group, "u4")
    return gguf_blocks.BlockWeight(rng.integers(-128, 128, (n, k), dtype=np.int8), scale, None, group, "i8")


def dense_of(weight: gguf_blocks.BlockWeight) -> np.ndarray:
    """The float32 weights by numpy, with the gguf package's two roundings (multiply, then add)."""
    w = np.repeat(weight.scale, weight.group, axis=1) * weight.q.astype(np.float32)
    return w if weight.offset is None else w + np.repeat(weight.offset, weight.group, axis=1)


def bits(t) -> np.ndarray:
    return t.numpy().view(np.int32)


@pytest.mark.parametrize("kind,group", FORMS)
def test_blocks_give_the_packed_float32_kernels_bits_at_every_row_count(kind, group):
    n, k = 200, 320  # a partial last panel
    weight = random_blocks(kind, group, n, k)
    b, packed = gguf_blocks.pack(weight), pack(paddle.to_tensor(dense_of(weight)))
    rng = np.random.default_rng(1)
    for rows in (1, 2, 5, 8, 9, 12, 13, 47, 48, 49, 100):  # fused tiles, a panel buffer, the whole weight
        x = paddle.to_tensor(rng.standard_normal((rows, k)).astype(np.float32))
        got = linear_blocks()(x, b.q, b.scale, b.offset, n, group, b.one_rounding)
        assert got.shape == [rows, n]
        assert np.array_equal(bits(got), bits(linear_packed()(x, packed, n))), rows


@pytest.mark.parametrize("kind,group", FORMS)
def test_a_rows_output_does_not_depend_on_its_batch_mates(kind, group):
    n, k = 96, 256
    b = gguf_blocks.pack(random_blocks(kind, group, n, k, seed=2))
    rng = np.random.default_rng(3)
    row = rng.standard_normal((1, k)).astype(np.float32)
    alone = bits(linear_blocks()(paddle.to_tensor(row), b.q, b.scale, b.offset, n, group, b.one_rounding))
    for mates in (1, 7, 11, 60):
        batch = np.concatenate([rng.standard_normal((mates, k)).astype(np.float32), row])
        out = bits(linear_blocks()(paddle.to_tensor(batch), b.q, b.scale, b.offset, n, group, b.one_rounding))
        assert np.array_equal(out[-1:], alone), mates


def test_one_fma_rebuild_only_where_every_scale_times_q_is_exact():
    assert gguf_blocks.pack(random_blocks("u4_f16", 32, 64, 64)).one_rounding
    assert not gguf_blocks.pack(random_blocks("u4", 32, 64, 64)).one_rounding
    assert not gguf_blocks.pack(random_blocks("i8", 32, 64, 64)).one_rounding


def test_tables_are_float16_where_every_value_is_one():
    # Q4_1 / Q8_0 store halves: half the table bytes to read; a float32-only value keeps float32
    assert gguf_blocks.pack(random_blocks("u4_f16", 32, 64, 64)).scale.dtype == paddle.float16
    assert gguf_blocks.pack(random_blocks("i8_f16", 32, 64, 64)).scale.dtype == paddle.float16
    assert gguf_blocks.pack(random_blocks("u4", 32, 64, 64)).offset.dtype == paddle.float32
    assert gguf_blocks.pack(random_blocks("i8", 32, 64, 64)).scale.dtype == paddle.float32


def test_u4_blocks_must_come_in_whole_words_of_8_inputs():
    with pytest.raises(ValueError, match="multiple of 8"):
        gguf_blocks.pack(random_blocks("u4", 4, 64, 64))
    b = gguf_blocks.pack(random_blocks("u4", 32, 64, 64))
    bytes_per_input = paddle.to_tensor(b.q.numpy().reshape(b.q.shape[0], -1, 16))  # a [P, K, 16] byte layout
    with pytest.raises(Exception, match="128 \\(u4\\)"):
        linear_blocks()(paddle.ones([1, 64]), bytes_per_input, b.scale, b.offset, 64, 32, b.one_rounding)


def test_block_rows_are_the_dequantized_weight_rows():
    weight = random_blocks("u4", 32, 70, 64)
    b = gguf_blocks.pack(weight)
    ids = paddle.to_tensor([69, 0, 33], dtype="int32")
    assert np.array_equal(block_rows()(b.q, b.scale, b.offset, ids, 70, 32).numpy(), dense_of(weight)[[69, 0, 33]])
    with pytest.raises(Exception, match="out of range"):
        block_rows()(b.q, b.scale, b.offset, paddle.to_tensor([70]), 70, 32)


def test_bad_operands_are_refused_by_name():
    weight = random_blocks("u4", 32, 64, 64)
    b = gguf_blocks.pack(weight)
    x = paddle.ones([2, 64])
    with pytest.raises(Exception, match="in-features"):
        linear_blocks()(paddle.ones([2, 32]), b.q, b.scale, b.offset, 64, 32, False)
    with pytest.raises(Exception, match="offset"):
        linear_blocks()(x, b.q, b.scale, None, 64, 32, False)
    with pytest.raises(Exception, match="out-features"):
        linear_blocks()(x, b.q, b.scale, b.offset, 100, 32, False)
    with pytest.raises(Exception, match="multiple of group"):
        linear_blocks()(x, b.q, b.scale, b.offset, 64, 24, False)


_CAPPED_RUN = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from fastdeploy.model_executor.layers.cpu_kernels import kernel_isas
from test_linear_blocks import products_at_every_row_count
np.save({path!r}, products_at_every_row_count())
print(kernel_isas()["dense"])
"""


def products_at_every_row_count() -> np.ndarray:
    """linear_packed and linear_blocks (u4 and i8) on one set of operands through every tile shape
    and path of both: the bits, stacked, for comparing one instruction set with another."""
    n, k = 70, 224
    rng = np.random.default_rng(4)
    outs = []
    for kind in ("u4", "u4_f16", "i8"):
        weight = random_blocks(kind, 32, n, k, seed=5)
        b, packed = gguf_blocks.pack(weight), pack(paddle.to_tensor(dense_of(weight)))
        for rows in (1, 3, 8, 9, 12, 14, 49, 100):
            x = paddle.to_tensor(rng.standard_normal((rows, k)).astype(np.float32))
            outs += [bits(linear_blocks()(x, b.q, b.scale, b.offset, n, 32, b.one_rounding)), bits(linear_packed()(x, packed, n))]
    return np.concatenate(outs)


def test_every_instruction_set_gives_the_best_tiles_bits(tmp_path, capped_isa):
    # FD_CPU_LINEAR_ISA holds a process's kernels at AVX2 or portable C++: the CPUs without AVX-512 (or
    # AVX2) run those, and this one can check them against its own best.
    isa = capped_isa
    path = str(tmp_path / f"{isa}.npy")
    script = _CAPPED_RUN.format(tests=os.path.dirname(__file__), path=path)
    env = {**os.environ, "FD_CPU_LINEAR_ISA": isa}
    run = subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=600, capture_output=True,
                         text=True)
    assert run.stdout.split()[-1] == isa  # the capped tiles ran, not this process's AVX-512 ones
    assert np.array_equal(np.load(path), products_at_every_row_count())
