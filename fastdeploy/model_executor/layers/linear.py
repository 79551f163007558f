"""Dense layers: `y = x . W^T` with W in the checkpoint's `[out, in]` layout, one entry for every
device.

- CPU float32 -> the packed kernel (a `Linear`, or `linear()` packing on each call; blas_gemm.py): both
  row-invariant: a row's output has the same bits whatever the other rows of the batch are and
  however many there are, so no row padding is needed for batch invariance.
- anything else (GPU tensors, bf16/fp16) -> `paddle.matmul(x, W, transpose_y=True)` (cuBLAS on the
  GPU), its rows padded to a multiple of ROW_ALIGN: Paddle's GEMM gives a row the same bits only
  when the row count is such a multiple (remainder rows take another code path).

`Linear` holds a model's weight packed once at load for the CPU kernel (custom_ops/cpu_ops/
linear_packed.cc: faster than a BLAS for decode-sized batches, row-invariant by construction), or,
for a GGUF file's quantized weights, the file's blocks (gguf_blocks.py, linear_blocks.cc: the same
bits from ~5x fewer bytes), and fuses several weights that read the same input (q/k/v; gate/up)
into one GEMM. `linear()` serves weights used as they are (MoE experts, the router): on the CPU
the same tiles on a weight packed per call, so the same bits.
"""

from __future__ import annotations

import logging

import numpy as np
import paddle

from fastdeploy import envs
from fastdeploy.model_executor.layers import gguf_blocks
from fastdeploy.model_executor.layers.blas_gemm import block_rows, linear_blocks, linear_blocks_int8, linear_packed, \
    linear_unpacked, pack, packed_rows

logger = logging.getLogger("fastdeploy.model")


def uses_cpu_gemm(x: paddle.Tensor, weight: paddle.Tensor) -> bool:
    return x.place.is_cpu_place() and x.dtype == paddle.float32 and weight.dtype == paddle.float32


ROW_ALIGN = 8


def linear(x: paddle.Tensor, weight: paddle.Tensor) -> paddle.Tensor:
    """`x [rows, in] . weight[out, in]^T -> [rows, out]`."""
    if uses_cpu_gemm(x, weight):
        return linear_unpacked()(x, weight)
    rows = x.shape[0]
    extra = -rows % ROW_ALIGN
    if extra == 0:
        return paddle.matmul(x, weight, transpose_y=True)
    padded = paddle.concat([x, paddle.zeros([extra] + list(x.shape[1:]), dtype=x.dtype)], axis=0)
    return paddle.matmul(padded, weight, transpose_y=True)[:rows]


class Linear:
    """Weights `[out_i, in]` that read the same input, concatenated along out and held as this
    device's GEMM wants them: packed once (blas_gemm.pack) for the CPU float32 kernel, else one
    dense `[sum out, in]` tensor for Paddle's matmul. `__call__` is one GEMM giving the parts'
    outputs side by side; `split` separates them (views, no copy)."""

    def __init__(self, parts: list):
        if not parts:
            raise ValueError("Linear needs at least one weight")
        if len({int(p.shape[1]) for p in parts}) != 1 or len({p.dtype for p in parts}) != 1:
            raise ValueError(f"Linear: fused weights must share in-features and dtype, got shapes "
                             f"{[list(p.shape) for p in parts]} and dtypes {[str(p.dtype) for p in parts]}")
        self.sizes = [int(p.shape[0]) for p in parts]
        self.out_features, self.in_features = sum(self.sizes), int(parts[0].shape[1])
        self.dtype = parts[0].dtype
        dense = parts[0] if len(parts) == 1 else paddle.concat(parts, axis=0)
        self.packed = self.dense = self.blocks = self.int8_blocks = None
        if not uses_cpu_gemm(dense, dense):
            self.dense = dense if dense.is_contiguous() else dense.contiguous()
        else:
            weight, self.blocks = _exact_blocks(parts, dense) if envs.FD_CPU_GGUF_BLOCKS else (None, None)
            if weight is not None and envs.FD_CPU_INT8_ACTIVATIONS:
                # Opt-in, not exact: the products on int8 activations (linear_blocks_int8.cc). The exact
                # blocks stay for the rows a tied embedding reads and for unpacking.
                self.int8_blocks = gguf_blocks.pack_int8(weight)
            self.packed = pack(dense) if self.blocks is None else None
        self.storage = ("gguf " + self.blocks.source) if self.blocks is not None else \
            "float32 packed" if self.packed is not None else str(self.dtype).replace("paddle.", "")
        if self.int8_blocks is not None:
            self.storage += " x int8 activations"
        # The product bound once: a decode step makes ~120 of these calls, and the attribute and op
        # lookups per call were a measurable part of its host time.
        self.product = self._bind_product()

    def _bind_product(self):
        n = self.out_features
        if self.int8_blocks is not None:
            op, b = linear_blocks_int8(), self.int8_blocks
            q, scale, offset = b.q, b.scale, b.offset
            return lambda x: op(x, q, scale, offset, n)
        if self.blocks is not None:
            op, b = linear_blocks(), self.blocks
            q, scale, offset, group, one_rounding = b.q, b.scale, b.offset, b.group, b.one_rounding
            return lambda x: op(x, q, scale, offset, n, group, one_rounding)
        if self.packed is not None:
            op, packed = linear_packed(), self.packed
            return lambda x: op(x, packed, n)
        dense = self.dense
        return lambda x: linear(x, dense)

    @property
    def nbytes(self) -> int:
        """Bytes the weight occupies in memory (what a decode step reads)."""
        if self.int8_blocks is not None:
            return self.int8_blocks.nbytes  # what a step reads (the exact blocks stay for the embedding rows)
        if self.blocks is not None:
            return self.blocks.nbytes
        held = self.packed if self.packed is not None else self.dense
        return int(np.prod(held.shape)) * held.element_size()

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.product(x)

    @property
    def block_operand(self):
        """(q, scale, offset | None, n, group, kind) of a GGUF-block weight for the fused decoder ops
        (decoder_block_ops.cc; kind 0: exact, 1: exact with one rounding, 2: int8 activations), or
        None for a float32 or dense weight."""
        if self.int8_blocks is not None:
            b = self.int8_blocks
            return b.q, b.scale, b.offset, self.out_features, b.group, 2
        if self.blocks is not None:
            b = self.blocks
            return b.q, b.scale, b.offset, self.out_features, b.group, 1 if b.one_rounding else 0
        return None

    def split(self, y: paddle.Tensor) -> list:
        """The parts of a fused output `[.., sum out]`, in the order the weights were given."""
        outs, start = [], 0
        for size in self.sizes:
            outs.append(y[..., start:start + size])
            start += size
        return outs

    def rows(self, ids: paddle.Tensor) -> paddle.Tensor:
        """Rows `ids` of the fused weight: the embedding lookup of a tied LM head."""
        if self.blocks is not None:
            b = self.blocks
            return block_rows()(b.q, b.scale, b.offset, ids, self.out_features, b.group)
        if self.packed is not None:
            return packed_rows()(self.packed, ids, self.out_features)
        return paddle.nn.functional.embedding(ids, self.dense)

    def unpack(self, start: int = 0, size: int | None = None) -> paddle.Tensor:
        """Rows [start, start + size) of the fused `[out, in]` weight as a dense tensor."""
        size = self.out_features - start if size is None else size
        if self.dense is not None:
            return self.dense[start:start + size]
        return self.rows(paddle.arange(start, start + size, dtype="int64"))


def _exact_blocks(parts: list, dense: paddle.Tensor):
    """(the parts' GGUF blocks, them packed for linear_blocks), when every part has them and they
    dequantize to exactly `dense` (bit for bit); else (None, None): the float32 copy is packed instead."""
    weight = gguf_blocks.concat_rows([getattr(p, "gguf_blocks", None) for p in parts])
    if weight is None or weight.shape != tuple(dense.shape):
        return None, None
    packed = gguf_blocks.pack(weight)
    rebuilt = block_rows()(packed.q, packed.scale, packed.offset,
                           paddle.arange(dense.shape[0], dtype="int64"), int(dense.shape[0]), packed.group)
    if not np.array_equal(rebuilt.numpy().view(np.int32), dense.numpy().view(np.int32)):
        logger.warning("GGUF %s blocks of a %s weight do not dequantize to the checkpoint's float32 values; "
                       "keeping the float32 copy", weight.source, list(dense.shape))
        return None, None
    return weight, packed


class WeightView:
    """One part of a `Linear`, standing in for the checkpoint tensor under its own name (the
    model's name -> tensor dict: saving, byte counts, tests), without a second copy in memory."""

    def __init__(self, owner: Linear, start: int, size: int):
        self.owner, self.start, self.size = owner, start, size
        self.shape = [size, owner.in_features]
        self.dtype = owner.dtype

    def element_size(self) -> int:
        return paddle.zeros([1], dtype=self.dtype).element_size()

    def tensor(self) -> paddle.Tensor:
        return self.owner.unpack(self.start, self.size)

    def numpy(self):
        return self.tensor().numpy()

    def astype(self, dtype) -> paddle.Tensor:
        return self.tensor().astype(dtype)


def fuse_named(weights: dict, names: list) -> Linear:
    """One `Linear` of `weights[name]` for `names`; each name then points at its `WeightView`,
    so the model's name -> tensor dict keeps working and the separate copies are freed."""
    fused = Linear([weights[n] for n in names])
    start = 0
    for name, size in zip(names, fused.sizes):
        weights[name] = WeightView(fused, start, size)
        start += size
    return fused
