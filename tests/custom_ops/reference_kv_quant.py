"""Numpy reference of the quantized-page rule (custom_ops/cpu_ops/kv_quant.h), written from the
formats' definitions, not from the op: one float32 scale per row = absmax / Q (Q = 127 for int8,
448 for e4m3fn, 7 for int4), codes = the row / scale rounded to the nearest representable value, ties to even,
saturating at +-Q; a zero row gets scale 0 and codes 0. Float32 arithmetic where the rule is
float32 (scale, division), exact float64 for the rounding itself. int8 and int4 keys are stored
rotated by the unnormalised Walsh-Hadamard matrix H (head_dim a power of two), queries by H / head_dim.
int4 codes (-7..7) are stored two per byte: element 2i in the low nibble, 2i + 1 in the high one,
each a 4-bit two's complement number. k8v4 pages store their keys by the int8 rule (rotated) and their
values by the int4 rule (lane_format); the functions that take `keys` accept it.
Used only by tests.
"""

from __future__ import annotations

import numpy as np

# page format name (the engine's kv_cache_quant_type) -> (cache dtype, Q)
FORMATS = {"int8": ("int8", 127.0), "block_wise_fp8": ("float8_e4m3fn", 448.0),
           "block_wise_int4": ("uint8", 7.0)}
# page formats whose key and value lanes differ -> (the keys' format, the values' format)
MIXED_FORMATS = {"k8v4": ("int8", "block_wise_int4")}
PAGE_FORMATS = list(FORMATS) + list(MIXED_FORMATS)  # every quantized kv_cache_quant_type


def lane_format(fmt: str, keys: bool) -> str:
    """The one-lane format (a key of FORMATS) the keys (or the values) of `fmt` pages are stored in."""
    return MIXED_FORMATS[fmt][0 if keys else 1] if fmt in MIXED_FORMATS else fmt


def rotates_keys(fmt: str, head_dim: int) -> bool:
    fmt = lane_format(fmt, keys=True)
    return fmt in ("int8", "block_wise_int4") and head_dim > 1 and head_dim & (head_dim - 1) == 0


def hadamard(x: np.ndarray) -> np.ndarray:
    """H x along the last axis, in x's dtype, with the op's butterflies (spans 1, 2, 4, ...): in float32
    the op's bits, in float64 the exact rotation (H is symmetric, H H = d I)."""
    x = np.array(x, copy=True)
    d = x.shape[-1]
    span = 1
    while span < d:
        y = x.reshape(*x.shape[:-1], d // (2 * span), 2, span)
        a, b = y[..., 0, :].copy(), y[..., 1, :].copy()
        y[..., 0, :], y[..., 1, :] = a + b, a - b
        span *= 2
    return x


def round_int8(y: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(y.astype(np.float64)), -127, 127)


def round_int4(y: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(y.astype(np.float64)), -7, 7)


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """int4 code values [..., d] (d even) -> their bytes [..., d / 2]: even element low nibble."""
    nibbles = codes.astype(np.int64) & 0xF
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray) -> np.ndarray:
    """Bytes [..., d / 2] -> int4 code values [..., d] (sign-extended nibbles), float64."""
    b = np.asarray(packed).view(np.uint8).astype(np.int64)
    lo, hi = b & 0xF, b >> 4
    out = np.empty(b.shape[:-1] + (2 * b.shape[-1],), dtype=np.float64)
    out[..., 0::2] = np.where(lo > 7, lo - 16, lo)
    out[..., 1::2] = np.where(hi > 7, hi - 16, hi)
    return out


def round_e4m3(y: np.ndarray) -> np.ndarray:
    """Nearest e4m3fn value (ties to even), saturating at +-448; returned as float64."""
    a = np.abs(y.astype(np.float64))
    with np.errstate(divide="ignore"):
        exponent = np.maximum(np.floor(np.log2(np.where(a > 0, a, 1.0))), -6)  # -6: subnormal steps of 2^-9
    step = 2.0 ** (exponent - 3)
    q = np.minimum(np.rint(a / step) * step, 448.0)
    return np.copysign(q, y)


def quantize_rows(x: np.ndarray, fmt: str):
    """(code values float64 [..., d], scales float32 [...]) of float32 rows x [..., d]."""
    q = np.float32(FORMATS[fmt][1])
    x = x.astype(np.float32)
    scale = (np.abs(x).max(axis=-1) / q).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))
    y = np.where(scale[..., None] > 0, x / safe[..., None], np.float32(0)).astype(np.float32)
    rounding = {"int8": round_int8, "block_wise_int4": round_int4, "block_wise_fp8": round_e4m3}[fmt]
    return rounding(y), scale


def dequantize_rows(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """code value * its row's scale, one float32 rounding (the op's read)."""
    return (codes.astype(np.float32) * scales[..., None].astype(np.float32)).astype(np.float32)


def error_bound(x: np.ndarray, scales: np.ndarray, fmt: str) -> np.ndarray:
    """The largest |dequantized - x| the rule allows per element: half a code step (int8, int4:
    scale / 2; e4m3: 2^-4 |x| for normals, 2^-10 scale below 2^-6 scale), plus the float32 roundings
    of the division and of the multiply (a few ulp of |x| and of the scale)."""
    x = np.abs(x.astype(np.float64))
    s = scales[..., None].astype(np.float64)
    half_step = s / 2 if fmt in ("int8", "block_wise_int4") else np.maximum(x * 2.0 ** -4, s * 2.0 ** -10)
    return half_step + 4e-7 * (x + 127 * s)


def e4m3_bytes(values: np.ndarray) -> np.ndarray:
    """The e4m3fn byte of every (exactly representable) value, e.g. round_e4m3's output."""
    v = np.asarray(values, dtype=np.float64)
    a = np.abs(v)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    normal = a >= 2.0 ** -6
    mantissa = np.where(normal, np.rint((a / 2.0 ** e - 1) * 8), 0)
    code = np.where(normal, ((e + 7) * 8 + mantissa), np.rint(a / 2.0 ** -9)).astype(np.uint8)
    return code | np.where(np.signbit(v), np.uint8(0x80), np.uint8(0))


def e4m3_values(codes: np.ndarray) -> np.ndarray:
    """The exact value of every e4m3fn byte (0x7F / 0xFF: NaN)."""
    b = np.asarray(codes, dtype=np.uint8).astype(np.int64)
    e, m = (b >> 3) & 0xF, b & 7
    v = np.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * 2.0 ** (e - 7))
    v = np.where((e == 15) & (m == 7), np.nan, v)
    return np.where(b & 0x80, -v, v)


def quantized_pages(rows: np.ndarray, fmt: str, keys: bool):
    """(codes as stored — int8, e4m3fn bytes as uint8, or int4 pairs as uint8 [..., d / 2] —, float32
    scales) of cache rows [..., d] of the key (or value) lane of `fmt` pages;
    NaN rows (never written) get scale NaN and codes 0, so reading one poisons the result."""
    rotate = keys and rotates_keys(fmt, rows.shape[-1])
    fmt = lane_format(fmt, keys)
    poisoned = np.isnan(rows).any(axis=-1)
    rows = np.nan_to_num(np.asarray(rows, dtype=np.float32))
    if rotate:
        rows = hadamard(rows)
    codes, scales = quantize_rows(rows, fmt)
    stored = {"int8": lambda c: c.astype(np.int8), "block_wise_int4": pack_int4,
              "block_wise_fp8": e4m3_bytes}[fmt](codes)
    return stored, np.where(poisoned, np.nan, scales).astype(np.float32)


def pages_from_codes(codes: np.ndarray, scales: np.ndarray, fmt: str, keys: bool) -> np.ndarray:
    """float64 values of the stored key (or value) lane of `fmt` pages (int8 keys rotated back exactly)."""
    page_fmt, fmt = fmt, lane_format(fmt, keys)
    # The codes' bytes, whatever array holds them (the harness returns uint8): int8 codes are signed.
    if fmt == "int8":
        values = codes.view(np.int8).astype(np.float64)
    elif fmt == "block_wise_int4":
        values = unpack_int4(codes)
    else:
        values = e4m3_values(codes.view(np.uint8))
    rows = values * scales[..., None].astype(np.float32).astype(np.float64)
    if keys and rotates_keys(page_fmt, rows.shape[-1]):
        rows = hadamard(rows) / rows.shape[-1]
    return rows
