"""Compressed lower tiers (--swap-space-dtype int8 | int4): pages the pool holds as float32 are kept in the host
and disk tiers as integer codes, one float32 scale per token of one KV head (`group` = head_dim values).

The rule of the quantized pool's pages (layers/quantization/kv_cache.py): symmetric codes, absmax / qmax per
token and head, keys Hadamard-rotated before rounding (and rotated back on the way into the pool, so the
pool's float32 pages hold plain keys), so a page that went through the tier costs what an int8 (or
int4) page costs, and only the pages that went through it: the pool's own pages stay float32. Bytes per
group: head_dim + 4 (int8), head_dim / 2 + 4 (int4), against 4 x head_dim: at head_dim 64, 3.76x and 7.11x
the entries in the same memory.
"""

from __future__ import annotations

import numpy as np

BITS = {"int8": 8, "int4": 4}


class PageCodec:
    """Encode an entry's float32 bytes of every KV tensor into one stored row, and back."""

    def __init__(self, dtype: str, units: list, group: int, num_key_views: int = 0):
        """`units`: bytes per entry of each view; the first `num_key_views` views hold keys."""
        if dtype not in BITS:
            raise ValueError(f"--swap-space-dtype: {dtype!r} is not one of {sorted(BITS)}")
        self.dtype, self.bits, self.group = dtype, BITS[dtype], group
        self.qmax = 127 if self.bits == 8 else 7
        for unit in units:
            if unit % (4 * group):
                raise ValueError(f"--swap-space-dtype: a {unit}-byte page is not float32 rows of {group} values")
        self.groups = [unit // (4 * group) for unit in units]
        self.code_bytes = group if self.bits == 8 else group // 2
        stored = [g * (self.code_bytes + 4) for g in self.groups]
        self.offsets = np.cumsum([0] + stored[:-1]).tolist()
        self.stored_bytes = sum(stored)
        power_of_two = group & (group - 1) == 0
        self.rotated = [i < num_key_views and power_of_two for i in range(len(units))]
        self.hadamard = _hadamard(group) if power_of_two else None

    def encode(self, views: list, page: int, row: np.ndarray) -> None:
        """Write pool page `page` of every view (float32 bytes) into `row` as codes then scales, per view."""
        for view, off, groups, rotated in zip(views, self.offsets, self.groups, self.rotated):
            x = view[page].view(np.float32).reshape(groups, self.group)
            if rotated:
                x = x @ self.hadamard
            scale = np.abs(x).max(axis=1) / self.qmax
            scale[scale == 0] = 1.0
            q = np.clip(np.rint(x / scale[:, None]), -self.qmax, self.qmax).astype(np.int8)
            if self.bits == 4:  # two codes per byte: even value in the low nibble
                q = ((q[:, 0::2] & 0x0F) | (q[:, 1::2] << 4)).astype(np.int8)
            end = off + groups * self.code_bytes
            row[off:end] = q.view(np.uint8).reshape(-1)
            row[end:end + 4 * groups] = scale.astype(np.float32).view(np.uint8)

    def decode(self, rows: np.ndarray, views: list, pages: np.ndarray) -> None:
        """Write stored rows (one per page in `pages`) back into the views as float32."""
        n = rows.shape[0]
        for view, off, groups, rotated in zip(views, self.offsets, self.groups, self.rotated):
            end = off + groups * self.code_bytes
            codes = np.ascontiguousarray(rows[:, off:end]).view(np.int8).reshape(n, groups, self.code_bytes)
            scale = np.ascontiguousarray(rows[:, end:end + 4 * groups]).view(np.float32).reshape(n, groups, 1)
            if self.bits == 4:  # sign-extend each nibble
                lo = (codes << 4) >> 4
                hi = codes >> 4
                codes = np.stack([lo, hi], axis=-1).reshape(n, groups, self.group)
            x = codes.astype(np.float32) * scale
            if rotated:
                x = x @ self.hadamard  # orthonormal and symmetric: its own inverse
            view[pages] = np.ascontiguousarray(x, np.float32).reshape(n, -1).view(np.uint8)


def _hadamard(n: int) -> np.ndarray:
    """The orthonormal n x n Hadamard matrix (Sylvester's construction; n a power of two)."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)
