"""A GGUF file's quantized weight blocks, kept for the CPU's dense layers (custom_ops/cpu_ops/linear_blocks.cc).

The float32 weights the model computes with are the gguf package's dequantization of these blocks;
linear_blocks rebuilds each weight in registers with the same two roundings, so the layer gives the
bits it gives on the float32 copy, while a decode step reads ~5x fewer bytes (SmolLM2-135M: 540 MB of
float32, ~110 MB of blocks). Nothing here changes a number: `Linear` keeps the blocks only after
checking that they dequantize to exactly the float32 tensor it was given, else it packs the float32.

A block type becomes one of two forms, per `group` consecutive inputs of one output row:
  u4: w = (scale * q) + offset, q in [0, 15]  (Q4_1: scale d, offset m; Q4_K: d*sc, -(dmin*m))
  i8: w = scale * q, q int8                    (Q8_0; Q5_0: q - 16; Q6_K: d*sc per 16, q - 32)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

PANEL = 32  # linear_blocks.cc's output columns per panel (linear_packed's too)


@dataclass
class BlockWeight:
    """An `[N, K]` weight in block form (numpy, row-major like the checkpoint tensor)."""

    q: np.ndarray                 # [N, K] uint8 in [0, 15] (u4) or int8 (i8)
    scale: np.ndarray             # [N, K // group] float32
    offset: Optional[np.ndarray]  # [N, K // group] float32 (u4), None (i8)
    group: int
    source: str                   # the GGUF type it came from, for logs

    @property
    def kind(self) -> str:
        return "u4" if self.offset is not None else "i8"

    @property
    def shape(self) -> tuple:
        return tuple(self.q.shape)

    def take_rows(self, index: np.ndarray) -> "BlockWeight":
        """The weight with rows `index` (a load-time row permutation or a rank's slice)."""
        return BlockWeight(self.q[index], self.scale[index], None if self.offset is None else self.offset[index],
                           self.group, self.source)

    def take_columns(self, index: np.ndarray) -> Optional["BlockWeight"]:
        """The weight with input columns `index`, when they move in whole groups (each run of `group`
        indices is one group of the source, in order): a KV head's o_proj columns (head_dim wide) or a
        rank's slice. None when a group would be cut (the caller keeps a float copy instead)."""
        index = np.asarray(index, dtype=np.int64)
        g = self.group
        if index.size % g:
            return None
        runs = index.reshape(-1, g)
        if np.any(runs[:, 0] % g) or np.any(runs - runs[:, :1] != np.arange(g)):
            return None
        groups = runs[:, 0] // g
        return BlockWeight(np.ascontiguousarray(self.q[:, index]), np.ascontiguousarray(self.scale[:, groups]),
                           None if self.offset is None else np.ascontiguousarray(self.offset[:, groups]),
                           g, self.source)

    def pad_rows(self, rows: int) -> "BlockWeight":
        """The weight with zero rows appended up to `rows` (they dequantize to 0.0: a vocab shard's padding)."""
        extra = rows - self.q.shape[0]

        def pad(a):
            return np.concatenate([a, np.zeros((extra,) + a.shape[1:], a.dtype)]) if extra else a

        return BlockWeight(pad(self.q), pad(self.scale), None if self.offset is None else pad(self.offset),
                           self.group, self.source)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[.., B] bytes -> [.., 2B]: the low nibbles, then the high ones (ggml's order in a block)."""
    return np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1)


def _q8_0(b):
    return _f16(b[..., 0:2]), None, b[..., 2:].view(np.int8), 32


def _q4_1(b):
    return _f16(b[..., 0:2]), _f16(b[..., 2:4]), _nibbles(b[..., 4:]), 32


def _q5_0(b):
    high = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)  # bit i: the 5th bit of element i
    bits = ((high >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)
    q = (_nibbles(b[..., 6:]) | (bits << np.uint8(4))).astype(np.int8) - np.int8(16)
    return _f16(b[..., 0:2]), None, q, 32


def _q4_k(b):
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    s = b[..., 4:16].reshape(b.shape[:-1] + (3, 4))
    lo, hi, mix = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1).astype(np.float32)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1).astype(np.float32)
    qs = b[..., 16:].reshape(b.shape[:-1] + (4, 32))  # 64 elements per 32 bytes: low nibbles, then high
    q = _nibbles(qs).reshape(b.shape[:-1] + (256,))
    return d[..., None] * sc, -(dmin[..., None] * mn), q, 32


def _q6_k(b):
    ql, qh = b[..., 0:128], b[..., 128:192]
    scales, d = b[..., 192:208].view(np.int8).astype(np.float32), _f16(b[..., 208:210])
    lead = b.shape[:-1]
    low = ql.reshape(lead + (2, 1, 64)) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    low = (low & np.uint8(15)).reshape(lead + (8, 32))
    top = qh.reshape(lead + (2, 1, 32)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    top = (top & np.uint8(3)).reshape(lead + (8, 32))
    q = ((low | (top << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(lead + (256,))
    return d[..., None] * scales, None, q, 16


# GGUF type name -> (elements per block, bytes per block, reader)
_READERS = {"Q8_0": (32, 34, _q8_0), "Q4_1": (32, 20, _q4_1), "Q5_0": (32, 22, _q5_0),
            "Q4_K": (256, 144, _q4_k), "Q6_K": (256, 210, _q6_k)}


def from_gguf(tensor) -> Optional[BlockWeight]:
    """The block form of a 2-D GGUF tensor, or None for types kept only as float32 (F32, F16, others)."""
    qtype = tensor.tensor_type.name
    if qtype not in _READERS or len(tensor.shape) != 2:
        return None
    per_block, size, read = _READERS[qtype]
    k, n = (int(s) for s in tensor.shape)  # GGUF lists the fastest axis (in-features) first
    blocks = np.asarray(tensor.data, dtype=np.uint8).reshape(n, k // per_block, size)
    scale, offset, q, group = read(blocks)
    return BlockWeight(np.ascontiguousarray(q.reshape(n, k)), np.ascontiguousarray(scale.reshape(n, -1), np.float32),
                       None if offset is None else np.ascontiguousarray(offset.reshape(n, -1), np.float32),
                       group, qtype)


def concat_rows(parts: list) -> Optional[BlockWeight]:
    """The parts stacked along N (a fused q/k/v or gate/up), or None when any part has no blocks or
    the parts' forms differ."""
    if not parts or any(p is None for p in parts):
        return None
    first = parts[0]
    if any(p.kind != first.kind or p.group != first.group or p.shape[1] != first.shape[1] for p in parts):
        return None
    if len(parts) == 1:
        return first
    offsets = None if first.offset is None else np.concatenate([p.offset for p in parts])
    return BlockWeight(np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]), offsets,
                       first.group, "+".join(sorted({p.source for p in parts})))


def _panels(a: np.ndarray) -> np.ndarray:
    """[N, C] -> [ceil(N / 32), C, 32], zero past N."""
    n = a.shape[0]
    padded = np.zeros((-(-n // PANEL) * PANEL,) + a.shape[1:], dtype=a.dtype)
    padded[:n] = a
    return np.ascontiguousarray(padded.reshape(-1, PANEL, a.shape[1]).transpose(0, 2, 1))


@dataclass
class PackedBlocks:
    """linear_blocks.cc's operands: q [P, K / 8, 128] uint8 (u4 words) or [P, K, 32] int8 (i8), scale and
    offset [P, K / group, 32] float32, or float16 where every value is one (paddle tensors)."""

    q: object
    scale: object
    offset: object
    group: int
    nbytes: int
    source: str = ""
    one_rounding: bool = False  # scale_times_q_is_exact: linear_blocks may rebuild w with one FMA


def scale_times_q_is_exact(weight: BlockWeight) -> bool:
    """Every `scale * q` of a u4 weight is exact in float32 (true of Q4_1: an f16 scale times a 4-bit q;
    of Q4_K: f16 d times a 6-bit sc times q), so `(scale * q) + offset` is one rounding and
    linear_blocks may rebuild the weight with one fused multiply-add and get the same bits. Checked
    on the numbers, not assumed from the type: float64 products of every scale with every q are
    compared with their float32 rounding."""
    if weight.kind != "u4":
        return False
    scale = weight.scale.astype(np.float64)
    for q in range(16):
        exact = scale * q
        if not np.array_equal(exact.astype(np.float32).astype(np.float64), exact):
            return False
    return True


def _u4_words(q: np.ndarray) -> np.ndarray:
    """[P, K, 32] nibbles -> [P, K / 8, 128] bytes: per 8 inputs, 32 little-endian uint32 words, word j
    holding column j's q at input 8c + s in bits 4s..4s+3 (linear_blocks.cc's u4 layout)."""
    panels, k, _ = q.shape
    eights = q.reshape(panels, k // 8, 8, PANEL).astype(np.uint32)  # [P, K / 8, s, column]
    words = np.zeros((panels, k // 8, PANEL), dtype="<u4")
    for s in range(8):
        words |= eights[:, :, s, :] << np.uint32(4 * s)
    return words.view(np.uint8).reshape(panels, k // 8, 4 * PANEL)


def _tables(weight: BlockWeight) -> list:
    """Scale (and offset) as float16 where every value is one (Q4_1, Q8_0 store them so: half the
    table bytes to read; the kernels widen them exactly), else float32 (Q4_K's d * sc)."""
    tables = [weight.scale] + ([] if weight.offset is None else [weight.offset])
    if all(np.array_equal(t.astype(np.float16).astype(np.float32), t) for t in tables):
        tables = [t.astype(np.float16) for t in tables]
    return tables


def pack(weight: BlockWeight) -> PackedBlocks:
    import paddle

    if weight.kind == "u4" and weight.group % 8:
        raise ValueError(f"{weight.source}: u4 blocks of {weight.group} inputs are not a multiple of 8")
    q = _panels(weight.q)
    if weight.kind == "u4":
        q = _u4_words(q)
    tensors = [q] + [_panels(t) for t in _tables(weight)]
    nbytes = sum(t.nbytes for t in tensors)
    q_t, scale_t = paddle.to_tensor(tensors[0]), paddle.to_tensor(tensors[1])
    offset_t = paddle.to_tensor(tensors[2]) if weight.offset is not None else None
    return PackedBlocks(q_t, scale_t, offset_t, weight.group, nbytes, weight.source, scale_times_q_is_exact(weight))


def pack_int8(weight: BlockWeight) -> Optional[PackedBlocks]:
    """linear_blocks_int8.cc's operands (the FD_CPU_INT8_ACTIVATIONS path): q [P, K / 4, 64] uint8 (u4: byte
    4j + t holds column j's q at input 4i + t in its low nibble, column j + 16's in its high one) or
    [P, K / 4, 128] uint8 (i8: column j's q + 128), the integers of 4 consecutive inputs of a column
    side by side for vpdpbusd; scale and offset as `pack`'s (float16 where exact). None when the blocks are not 32 wide
    (Q6_K's 16: that layer keeps the exact kernel)."""
    import paddle

    if weight.group != 32 or weight.shape[1] % 32:
        return None
    n, k = weight.shape
    q = _panels(weight.q)  # [P, K, 32], k-major
    panels = q.shape[0]
    quads = q.reshape(panels, k // 4, 4, PANEL).transpose(0, 1, 3, 2)  # [P, K / 4, 32 columns, 4 inputs]
    if weight.kind == "u4":
        packed = quads[:, :, :16, :] | (quads[:, :, 16:, :] << np.uint8(4))
    else:
        packed = (quads.astype(np.int16) + 128).astype(np.uint8)
    packed = np.ascontiguousarray(packed.reshape(panels, k // 4, -1))
    tensors = [packed] + [_panels(t) for t in _tables(weight)]
    nbytes = sum(t.nbytes for t in tensors)
    offset_t = paddle.to_tensor(tensors[2]) if weight.offset is not None else None
    return PackedBlocks(paddle.to_tensor(tensors[0]), paddle.to_tensor(tensors[1]), offset_t, weight.group, nbytes,
                        weight.source)
