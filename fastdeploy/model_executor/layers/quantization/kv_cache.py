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
"""

from __future__ import annotations

from typing import Any, Optional

KV_CACHE_QUANT_TYPES = ("none", "int8", "block_wise_fp8", "block_wise_int4")
# The paddle dtype of a quantized lane's K/V values (int4: two codes per uint8).
PAGE_DTYPES = {"int8": "int8", "block_wise_fp8": "float8_e4m3fn", "block_wise_int4": "uint8"}
# Values per stored element of a lane's rows.
CODES_PER_ELEMENT = {"block_wise_int4": 2}
PAGE_BITS = {"int8": 8, "block_wise_fp8": 8, "block_wise_int4": 4}
SCALE_BYTES = 4  # one float32 scale per token row, for K and for V
# Upstream types this engine does not implement: static per-channel scales from a calibrated
# checkpoint (int8, fp8 in upstream's sense with cache_k_scale weights, int4 with zero points).
UPSTREAM_ONLY = ("int8_zp", "int4_zp", "fp8", "int4")


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
            "block_wise_int4 is this engine's 4-bit pages)" if name in UPSTREAM_ONLY else "")
    override = "; pass --kv-cache-quant-type to override it" if flag is None else ""
    raise ValueError(f"{source}={value!r} is not supported{hint}: choose one of "
                     f"{', '.join(KV_CACHE_QUANT_TYPES)}{override}")


def is_quantized(quant_type: str) -> bool:
    return quant_type != "none"


def page_dtype(quant_type: str, cache_dtype: str) -> str:
    """The dtype of a lane's K/V tensors."""
    return PAGE_DTYPES.get(quant_type, cache_dtype)


def row_elements(quant_type: str, head_dim: int) -> int:
    """Elements of a lane's row: head_dim, or head_dim / 2 bytes of int4 pairs."""
    return head_dim // CODES_PER_ELEMENT.get(quant_type, 1)


def row_bytes(quant_type: str, cache_dtype_bytes: int, head_dim: int) -> int:
    """Bytes of one token row of one (layer, KV head) for K (the same for V), scale included."""
    if is_quantized(quant_type):
        return row_elements(quant_type, head_dim) + SCALE_BYTES
    return head_dim * cache_dtype_bytes


def check_kv_cache_quant_type(quant_type: str, cache_dtype: str, default_cache_dtype: str,
                              attention_backend: str, device: str = "cpu", compute_dtype: str = "float32",
                              head_dim: int = 0) -> None:
    """Start-up errors for a quantized type next to settings it cannot go with."""
    if not is_quantized(quant_type):
        return
    if quant_type == "block_wise_int4" and head_dim % 2:
        raise ValueError(f"kv_cache_quant_type=block_wise_int4 stores two 4-bit codes per byte, but the model's "
                         f"head_dim is {head_dim} (odd): use int8 or none")
    if device == "gpu" and compute_dtype != "bfloat16":
        raise ValueError(f"kv_cache_quant_type={quant_type} on --device gpu: the CUDA op reads quantized pages "
                         f"with bfloat16 compute only, but --dtype resolved to {compute_dtype}; pass --dtype bfloat16")
    if cache_dtype != default_cache_dtype:
        raise ValueError(f"kv_cache_quant_type={quant_type} stores {PAGE_BITS[quant_type]}-bit pages with float32 scales, but "
                         f"--cache-dtype {cache_dtype} asks for {cache_dtype} pages: pass one of the two")
    if attention_backend not in ("APPEND_ATTN", "CUDA_ON_CPU"):
        raise ValueError(f"kv_cache_quant_type={quant_type} quantizes the paged cache of FD_ATTENTION_BACKEND="
                         f"APPEND_ATTN; the {attention_backend} backend keeps float K/V per request")


def describe_pages(quant_type: str, cache_dtype: str) -> str:
    """What a page holds, for the start-up log."""
    if not is_quantized(quant_type):
        return f"{cache_dtype} pages"
    codes = "int4 K/V codes, two per uint8" if quant_type == "block_wise_int4" else f"{PAGE_DTYPES[quant_type]} K/V"
    return f"{quant_type} pages ({codes} + a float32 scale per token and KV head)"
