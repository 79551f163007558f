"""Quantized KV pages: which page formats exist, how a type is chosen, and what a page costs.

`kv_cache_quant_type` (upstream FastDeploy's name) picks the bytes of every KV page; it changes
nothing about how many pages a request holds. `none` keeps float pages of `--cache-dtype`; `int8`
and `block_wise_fp8` store each token's K and V head vectors as 8-bit codes (int8, or e4m3fn) plus
one float32 scale per token and KV head (the dynamic absmax at write time, upstream's
block_wise_fp8 layout `[num_blocks, kv_heads, block_size]`), quantized once where the attention op
writes K/V and dequantized inside its tiles (custom_ops/cpu_ops/kv_quant.h; int8 keys are stored
Hadamard-rotated, the queries rotated to match, which spreads a key's outlier channels before its
one scale is chosen). `int8` here is this per-token dynamic format, not upstream's static int8 with
calibrated per-channel scales. `block_wise_int4` is the same rule with 4-bit codes: symmetric
-7..7, two per byte (uint8 lanes `[num_blocks, G, block_size, head_dim / 2]`), keys rotated as int8
keys are, one float32 scale per token and KV head; a row costs head_dim / 2 + 4 bytes, 7.1x fewer
than float32 at head_dim 64. The scales live in the
page's own (block, slot) cell, so recycling, prefix caching, preemption and TP placement move them
with the page and need no bookkeeping of their own; the cache sizing counts their bytes.

`k8v4` (vLLM TurboQuant's idea) gives the two lanes different formats: keys exactly as `int8`
stores them (int8 codes, Hadamard-rotated, a float32 scale per token row: a key's outlier channels
need the bits) and values exactly as `block_wise_int4` does (int4 pairs in uint8, a float32 scale per
token row, not rotated). Its key lane is int8 `[num_blocks, G, block_size, head_dim]` and its value
lane uint8 `[num_blocks, G, block_size, head_dim / 2]`, so a row of K + V costs (head_dim + 4) +
(head_dim / 2 + 4) bytes: 104 at head_dim 64, 4.92x fewer than float32's 512. Whatever sizes or
allocates a lane asks per lane (`page_dtype`, `row_elements`, `row_bytes` with `lane="key"` or
`"value"`); `kv_row_bytes` is the cost of both.
"""

from __future__ import annotations

from typing import Any, Optional

KV_CACHE_QUANT_TYPES = ("none", "int8", "block_wise_fp8", "block_wise_int4", "k8v4")
LANES = ("key", "value")
# Types whose key and value lanes differ: the one-lane format of each (the others store both alike).
LANE_FORMATS = {"k8v4": {"key": "int8", "value": "block_wise_int4"}}
# The paddle dtype of a quantized lane's values (int4: two codes per uint8), by one-lane format.
PAGE_DTYPES = {"int8": "int8", "block_wise_fp8": "float8_e4m3fn", "block_wise_int4": "uint8"}
# Values per stored element of a lane's rows.
CODES_PER_ELEMENT = {"block_wise_int4": 2}
PAGE_BITS = {"int8": 8, "block_wise_fp8": 8, "block_wise_int4": 4}
SCALE_BYTES = 4  # one float32 scale per token row, for K and for V
# Upstream types this engine does not implement: static per-channel scales from a calibrated
# checkpoint (int8, fp8 in upstream's sense with cache_k_scale weights, int4 with zero points).
UPSTREAM_ONLY = ("int8_zp", "int4_zp", "fp8", "int4")
# Forms weighed and not built, with why (docs/swa_quality.md).
NOT_BUILT = {"int4_kivi": "KIVI's per-channel key scales change as a page fills, which breaks pages whose codes are "
                          "final when written (prefix hits, recycling); k8v4 is the 4-bit form that keeps retrieval"}


def resolve_kv_cache_quant_type(flag: Optional[str], model_raw: dict) -> str:
    """The flag (`--kv-cache-quant-type`, `LLM(kv_cache_quant_type=...)`) when given, else the
    checkpoint's `quantization_config.kv_cache_quant_type`, else none; validated."""
    source = "kv_cache_quant_type"
    value: Any = flag
    if value is None:
        section = model_raw.get("quantization_config") if isinstance(model_raw, dict) else None
        value = section.get("kv_cache_quant_type") if isinstance(section, dict) else None
        source = "the checkpoint's quantization_config.kv_cache_quant_type"
    if value is None:
        return "none"
    name = str(value).strip().lower()
    if name in KV_CACHE_QUANT_TYPES:
        return name
    hint = (" (an upstream type with calibrated static scales or zero points, not implemented here; "
            "block_wise_int4 is this engine's 4-bit pages)" if name in UPSTREAM_ONLY else
            f" ({NOT_BUILT[name]})" if name in NOT_BUILT else "")
    override = "; pass --kv-cache-quant-type to override it" if flag is None else ""
    raise ValueError(f"{source}={value!r} is not supported{hint}: choose one of "
                     f"{', '.join(KV_CACHE_QUANT_TYPES)}{override}")


def is_quantized(quant_type: str) -> bool:
    return quant_type != "none"


def lane_format(quant_type: str, lane: str) -> str:
    """The format `lane` ("key" or "value") of `quant_type`'s pages is stored in: the type itself, or
    for k8v4 int8 keys and block_wise_int4 values."""
    if lane not in LANES:
        raise ValueError(f"lane must be one of {', '.join(LANES)}, got {lane!r}")
    return LANE_FORMATS.get(quant_type, {}).get(lane, quant_type)


def page_dtype(quant_type: str, cache_dtype: str, lane: str) -> str:
    """The dtype of a layer's K (lane="key") or V (lane="value") tensor."""
    return PAGE_DTYPES.get(lane_format(quant_type, lane), cache_dtype)


def row_elements(quant_type: str, head_dim: int, lane: str) -> int:
    """Elements of a row of `lane`: head_dim, or head_dim / 2 bytes of int4 pairs."""
    return head_dim // CODES_PER_ELEMENT.get(lane_format(quant_type, lane), 1)


def row_bytes(quant_type: str, cache_dtype_bytes: int, head_dim: int, lane: Optional[str] = None) -> int:
    """Bytes of one token row of one (layer, KV head) in `lane`, its scale included. `lane` may be left
    out for the types whose K and V rows cost the same (all but k8v4); kv_row_bytes is the cost of both."""
    if lane is None:
        if quant_type in LANE_FORMATS:
            raise ValueError(f"kv_cache_quant_type={quant_type}: its key and value rows differ in size; pass "
                             f"lane='key' or 'value', or use kv_row_bytes for both")
        lane = "key"
    if is_quantized(lane_format(quant_type, lane)):
        return row_elements(quant_type, head_dim, lane) + SCALE_BYTES
    return head_dim * cache_dtype_bytes


def kv_row_bytes(quant_type: str, cache_dtype_bytes: int, head_dim: int) -> int:
    """Bytes of one token row of one (layer, KV head) in K and V together, scales included."""
    return sum(row_bytes(quant_type, cache_dtype_bytes, head_dim, lane) for lane in LANES)


def check_kv_cache_quant_type(quant_type: str, cache_dtype: str, default_cache_dtype: str,
                              attention_backend: str, device: str = "cpu", compute_dtype: str = "float32",
                              head_dim: int = 0) -> None:
    """Start-up errors for a quantized type next to settings it cannot go with."""
    if not is_quantized(quant_type):
        return
    if "block_wise_int4" in (lane_format(quant_type, "key"), lane_format(quant_type, "value")) and head_dim % 2:
        raise ValueError(f"kv_cache_quant_type={quant_type} stores two 4-bit codes per byte, but the model's "
                         f"head_dim is {head_dim} (odd): use int8 or none")
    if device == "gpu" and compute_dtype != "bfloat16":
        raise ValueError(f"kv_cache_quant_type={quant_type} on --device gpu: the CUDA op reads quantized pages "
                         f"with bfloat16 compute only, but --dtype resolved to {compute_dtype}; pass --dtype bfloat16")
    if cache_dtype != default_cache_dtype:
        raise ValueError(f"kv_cache_quant_type={quant_type} stores {_bits(quant_type)} pages with float32 scales, but "
                         f"--cache-dtype {cache_dtype} asks for {cache_dtype} pages: pass one of the two")
    if attention_backend not in ("APPEND_ATTN", "CUDA_ON_CPU"):
        raise ValueError(f"kv_cache_quant_type={quant_type} quantizes the paged cache of FD_ATTENTION_BACKEND="
                         f"APPEND_ATTN; the {attention_backend} backend keeps float K/V per request")


def _bits(quant_type: str) -> str:
    """The bits of a page's codes, for messages: 8-bit, 4-bit, or (lanes that differ) 8-bit key / 4-bit value."""
    key, value = (PAGE_BITS[lane_format(quant_type, lane)] for lane in LANES)
    return f"{key}-bit" if key == value else f"{key}-bit key / {value}-bit value"


def _codes(fmt: str, what: str) -> str:
    return f"int4 {what} codes, two per uint8" if fmt == "block_wise_int4" else f"{PAGE_DTYPES[fmt]} {what}"


def describe_pages(quant_type: str, cache_dtype: str) -> str:
    """What a page holds, for the start-up log."""
    if not is_quantized(quant_type):
        return f"{cache_dtype} pages"
    key, value = (lane_format(quant_type, lane) for lane in LANES)
    codes = _codes(key, "K/V") if key == value else f"{_codes(key, 'K')}, {_codes(value, 'V')}"
    return f"{quant_type} pages ({codes} + a float32 scale per token and KV head)"
