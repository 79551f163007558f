"""A GGUF file's quantized blocks kept for the CPU's dense layers (layers/gguf_blocks.py,
custom_ops/cpu_ops/linear_blocks.cc): the oracle is the gguf package's own dequantization, the
float32 numbers the model (and transformers) computes with."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import paddle
import pytest
from gguf import GGMLQuantizationType, quants

from fastdeploy.model_executor.layers import gguf_blocks
from fastdeploy.model_executor.layers.blas_gemm import block_rows
from fastdeploy.model_executor.layers.linear import Linear

# type -> byte ranges of its float16 fields in a block (random bytes elsewhere are all valid)
FP16_FIELDS = {"Q8_0": [(0, 2)], "Q4_1": [(0, 2), (2, 4)], "Q5_0": [(0, 2)], "Q4_K": [(0, 2), (2, 4)],
               "Q6_K": [(208, 210)]}


def random_gguf_tensor(qtype: str, rows: int, cols: int, seed: int = 0):
    """A stand-in for a gguf ReaderTensor of `qtype`: raw blocks with finite float16 scales."""
    per_block, size, _ = gguf_blocks._READERS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // per_block, size), dtype=np.uint8)
    for lo, hi in FP16_FIELDS[qtype]:
        raw[..., lo:hi] = (rng.standard_normal((rows, cols // per_block, 1)) * 0.05).astype(np.float16).view(np.uint8)
    return SimpleNamespace(name="blk.0.ffn_up.weight", tensor_type=GGMLQuantizationType[qtype],
                           shape=np.array([cols, rows]), data=raw.reshape(rows, -1))


def dequantized(tensor) -> np.ndarray:
    return quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)


def rebuilt(weight: gguf_blocks.BlockWeight) -> np.ndarray:
    p = gguf_blocks.pack(weight)
    n = weight.shape[0]
    return block_rows()(p.q, p.scale, p.offset, paddle.arange(n, dtype="int64"), n, p.group).numpy()


@pytest.mark.parametrize("qtype", sorted(FP16_FIELDS))
def test_every_kept_block_type_rebuilds_the_gguf_package_dequantization_bit_for_bit(qtype):
    tensor = random_gguf_tensor(qtype, rows=70, cols=512)  # 70 rows: a partial last panel
    weight = gguf_blocks.from_gguf(tensor)
    assert weight is not None and weight.shape == (70, 512) and weight.source == qtype
    assert np.array_equal(rebuilt(weight).view(np.int32), dequantized(tensor).view(np.int32))


def test_types_without_a_block_form_stay_float32():
    for qtype in ("F32", "F16", "Q2_K"):
        tensor = SimpleNamespace(tensor_type=GGMLQuantizationType[qtype], shape=np.array([64, 8]), data=None)
        assert gguf_blocks.from_gguf(tensor) is None


def test_row_permutation_and_fusing_keep_blocks_in_step_with_the_float32_rows():
    a = gguf_blocks.from_gguf(random_gguf_tensor("Q4_1", 64, 256, seed=1))
    b = gguf_blocks.from_gguf(random_gguf_tensor("Q4_1", 32, 256, seed=2))
    perm = np.random.default_rng(3).permutation(64)
    fused = gguf_blocks.concat_rows([a.take_rows(perm), b])
    assert np.array_equal(rebuilt(fused), np.concatenate([rebuilt(a)[perm], rebuilt(b)]))
    q8 = gguf_blocks.from_gguf(random_gguf_tensor("Q8_0", 32, 256))
    assert gguf_blocks.concat_rows([a, q8]) is None  # u4 next to i8: no common form
    assert gguf_blocks.concat_rows([a, None]) is None


def _linear_parts(qtypes, rows=64, cols=256):
    parts = []
    for i, qtype in enumerate(qtypes):
        tensor = random_gguf_tensor(qtype, rows, cols, seed=10 + i)
        dense = paddle.to_tensor(dequantized(tensor))
        dense.gguf_blocks = gguf_blocks.from_gguf(tensor)
        parts.append(dense)
    return parts


def test_linear_keeps_the_blocks_and_computes_the_bits_of_the_float32_weight(monkeypatch):
    parts = _linear_parts(["Q5_0", "Q8_0"])  # both i8: one fused layer on blocks
    on = Linear(parts)
    monkeypatch.setenv("FD_CPU_GGUF_BLOCKS", "0")
    off = Linear(parts)
    assert on.storage == "gguf Q5_0+Q8_0" and on.blocks is not None and on.packed is None
    assert off.storage == "float32 packed" and off.blocks is None
    assert on.nbytes < off.nbytes / 3
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32))
    assert np.array_equal(on(x).numpy().view(np.int32), off(x).numpy().view(np.int32))
    ids = paddle.to_tensor([3, 100, 0])
    assert np.array_equal(on.rows(ids).numpy(), off.rows(ids).numpy())  # a tied embedding's lookup


def test_blocks_that_do_not_give_the_float32_tensor_are_refused(caplog):
    (part,) = _linear_parts(["Q4_K"])
    changed = part * 1.5  # e.g. a load-time transform that forgot the blocks
    changed.gguf_blocks = part.gguf_blocks
    with caplog.at_level(logging.WARNING, logger="fastdeploy.model"):
        layer = Linear([changed])
    assert layer.blocks is None and layer.storage == "float32 packed"
    assert "do not dequantize" in caplog.text
