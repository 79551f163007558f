"""Quantized KV pages in the CPU AppendAttention op (int8, block_wise_fp8 = e4m3fn codes,
block_wise_int4 = 4-bit codes -7..7 two per byte, and k8v4 = int8 keys beside int4 values, with a
float32 scale per token row of every page).

The op quantizes once, where it writes a token's K/V, and dequantizes inside its tiles. So:
- the rows it writes are exactly the numpy rule's codes and scales (tests/custom_ops/
  reference_kv_quant.py; int8 and int4 keys Hadamard-rotated; int4 bytes packed bit for bit, codes
  never -8), and their dequantized values lie within the format's stated bound of the float64 values
  (int8, int4: half a step, scale / 2; e4m3: 2^-4 relative, 2^-10 scale near zero);
- its attention output equals float64 attention over the dequantized pages (float32 tolerance)
  and stays within the format's error of float64 attention over the original values;
- a zero K/V vector gets scale 0 and codes 0, never a division by zero.
Scales of rows nothing wrote are NaN here, so a read of a row that must not be read poisons the
output, as the NaN-filled float caches do in test_append_attention_cpu.py.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.layers.attention.ops import append_attention
from fastdeploy.model_executor.layers.attention.ops.cpu_op_loader import set_cpu_options
from reference_attention import reference_append_attention
from reference_kv_quant import FORMATS, PAGE_FORMATS, dequantize_rows, error_bound, hadamard, lane_format, \
    pack_int4, quantize_rows, rotates_keys, unpack_int4
from test_append_attention_cpu import MIXED, Case, build_inputs, rel_err

TIGHT_TOL = 1e-5  # attention over the very values the op read: float32 arithmetic only
# Attention over the original float values: the format's error through softmax and the value sum
# (measured on these cases, standard normal K/V: int8 6.5e-3 to 8.2e-3, e4m3 2.9e-2 to 3.5e-2,
# int4 1.1e-1 to 1.5e-1: 4 bits leave a step of absmax / 7, about 0.4 of a standard normal value;
# k8v4 9.2e-2 to 1.1e-1: its int4 values' error, the int8 keys add little).
FORMAT_TOL = {"int8": 1.5e-2, "block_wise_fp8": 6e-2, "block_wise_int4": 2.5e-1, "k8v4": 2e-1}
LANE = {"key_cache": True, "value_cache": False}  # the cache -> `keys` of lane_format


def stored(codes: np.ndarray, fmt: str) -> paddle.Tensor:
    """Code values [..., d] as a lane of the one-lane format `fmt` holds them (int4: packed two per uint8)."""
    if fmt == "block_wise_int4":
        return paddle.to_tensor(pack_int4(codes))
    return paddle.to_tensor(codes.astype(np.float32)).astype(FORMATS[fmt][0])


def code_values(t: paddle.Tensor) -> np.ndarray:
    """A quantized cache's code values [..., d] as float32 (int4 pairs unpacked)."""
    if t.dtype == paddle.uint8:
        return unpack_int4(t.numpy()).astype(np.float32)
    return t.astype("float32").numpy()


def quantized_tensors(arrays: dict, fmt: str) -> dict:
    """The step's inputs with the prior cache as quantized pages, each lane in its format (NaN rows: scale
    NaN, codes 0)."""
    t = {k: paddle.to_tensor(v) for k, v in arrays.items() if k not in ("key_cache", "value_cache")}
    for name in ("key_cache", "value_cache"):
        rows = arrays[name]
        poisoned = np.isnan(rows).any(axis=-1)
        rows = np.nan_to_num(rows)
        if name == "key_cache" and rotates_keys(fmt, rows.shape[-1]):
            rows = hadamard(rows)
        codes, scales = quantize_rows(rows, lane_format(fmt, LANE[name]))
        t[name] = stored(codes, lane_format(fmt, LANE[name]))
        t[name.replace("cache", "cache_scales")] = paddle.to_tensor(np.where(poisoned, np.nan, scales).astype(np.float32))
    return t


def pages_as_float(t: dict, name: str, fmt: str = None) -> np.ndarray:
    """A quantized cache read back as the op reads it: code value x row scale (float32); with `fmt`, int8
    keys rotated back (exactly, in float64)."""
    codes = code_values(t[name])
    rows = dequantize_rows(codes, t[name.replace("cache", "cache_scales")].numpy())
    if fmt is not None and name == "key_cache" and rotates_keys(fmt, rows.shape[-1]):
        return hadamard(rows.astype(np.float64)) / rows.shape[-1]
    return rows


def run(case: Case, t: dict) -> np.ndarray:
    return append_attention(**t, num_heads=case.num_heads, kv_num_heads=case.kv_heads,
                            head_dim=case.head_dim).numpy()


def new_rows(case: Case, arrays: dict, fmt: str = "block_wise_fp8"):
    """(rows, k float32, v float32) of the step's tokens: K rotated in float32 in the op's order of
    operations (x0 c - x1 s, x1 c + x0 s, no fused multiply-add; then the Hadamard rotation of int8
    keys), V as given."""
    d, H, nh = case.head_dim, case.kv_heads, case.num_heads
    ks, vs, where = [], [], []
    for r, (n, c) in enumerate(case.requests):
        for j in range(c):
            row, pos = int(arrays["cu_seqlens_q"][r]) + j, n + j
            x = arrays["qkv"][row].astype(np.float32)
            cos, sin = arrays["rotary_cos"][pos], arrays["rotary_sin"][pos]
            for h in range(H):
                k = x[(nh + h) * d:(nh + h + 1) * d]
                rot = np.empty(d, np.float32)
                rot[0::2] = k[0::2] * cos - k[1::2] * sin
                rot[1::2] = k[1::2] * cos + k[0::2] * sin
                table = arrays["block_tables"]
                page = table[r, h, pos // case.block_size] if table.ndim == 3 else \
                    table[r, pos // case.block_size] * H + h
                where.append((page, pos % case.block_size, row, h, pos))
                ks.append(hadamard(rot) if rotates_keys(fmt, d) else rot)
                vs.append(x[(nh + H + h) * d:(nh + H + h + 1) * d])
    return where, np.array(ks), np.array(vs)


# Rows with the magnitudes that exercise every branch: ordinary, one large outlier, values small
# enough to land on e4m3 subnormals, and a zero K/V vector (token 5 of request 0).
def spread_inputs(case: Case) -> dict:
    arrays = build_inputs(case)
    qkv = arrays["qkv"]
    d, nh, H = case.head_dim, case.num_heads, case.kv_heads
    kv = slice(nh * d, (nh + 2 * H) * d)
    qkv[1, kv] *= 1e-3
    qkv[2, nh * d] = 80.0
    qkv[3, kv] *= 1e4
    qkv[5, kv] = 0.0
    return arrays


@pytest.mark.parametrize("fmt", PAGE_FORMATS)
def test_written_rows_are_the_rules_codes_within_the_formats_error(fmt):
    case = Case(31, [(0, 40), (17, 9)], kv_heads=2, group=2, head_dim=64, window=12, sink=4, swa_heads=(0,),
                poison_invisible_rows=False)
    arrays = spread_inputs(case)
    t = quantized_tensors(arrays, fmt)
    out = run(case, t)
    where, k64, v64 = new_rows(case, arrays, fmt)
    pages, slots = [w[0] for w in where], [w[1] for w in where]
    for name, exact in (("key_cache", k64), ("value_cache", v64)):
        lane = lane_format(fmt, LANE[name])  # k8v4: int8 keys, int4 values
        codes = code_values(t[name]).reshape(-1, case.block_size, case.head_dim)[pages, slots]
        scales = t[name.replace("cache", "cache_scales")].numpy().reshape(-1, case.block_size)[pages, slots]
        want_codes, want_scales = quantize_rows(exact, lane)
        np.testing.assert_array_equal(scales, want_scales)
        np.testing.assert_array_equal(codes, want_codes)
        assert t[name].dtype == paddle.to_tensor(np.zeros(1)).astype(FORMATS[lane][0]).dtype
        if lane == "block_wise_int4":  # the bytes themselves: even element in the low nibble
            written = t[name].numpy().reshape(-1, case.block_size, case.head_dim // 2)[pages, slots]
            np.testing.assert_array_equal(written, pack_int4(want_codes))
            assert codes.min() >= -7 and codes.max() <= 7  # never the 16th code, -8
        assert (np.abs(codes).max(axis=-1)[scales > 0] == FORMATS[lane][1]).all()  # absmax -> the largest code
        err = np.abs(dequantize_rows(codes, scales).astype(np.float64) - exact.astype(np.float64))
        assert (err <= error_bound(exact, scales, lane)).all()
        zero = [i for i, w in enumerate(where) if w[2] == 5]
        assert (scales[zero] == 0).all() and (codes[zero] == 0).all()
        rms = np.sqrt((err ** 2).mean() / (exact.astype(np.float64) ** 2).mean())
        used = (err / np.maximum(error_bound(exact, scales, lane), 1e-30)).max()
        print(f"[kv_quant] {fmt} {name}: max |err| / bound = {used:.3f}, relative RMS error {rms:.2e}")
    assert np.isfinite(out).all()


def test_e4m3_codes_are_paddles_own_float8_conversion():
    """The e4m3 rounding (ties to even, subnormals) agrees with Paddle's float32 -> float8_e4m3fn cast."""
    case = Case(32, [(0, 30)], kv_heads=2, group=1, head_dim=64, poison_invisible_rows=False)
    arrays = spread_inputs(case)
    t = quantized_tensors(arrays, "block_wise_fp8")
    run(case, t)
    where, k, _ = new_rows(case, arrays)
    pages, slots = [w[0] for w in where], [w[1] for w in where]
    codes = t["key_cache"].astype("float32").numpy().reshape(-1, case.block_size, case.head_dim)[pages, slots]
    scales = t["key_cache_scales"].numpy().reshape(-1, case.block_size)[pages, slots]
    y = np.where(scales[:, None] > 0, k / np.where(scales > 0, scales, 1)[:, None], 0).astype(np.float32)
    paddles = paddle.to_tensor(y).astype("float8_e4m3fn").astype("float32").numpy()
    np.testing.assert_array_equal(codes, paddles)


CASES = {
    "mixed_decode_and_prefill": Case(33, MIXED + [(200, 1)], kv_heads=4, group=4, window=20, sink=20,
                                     swa_heads=(0, 3)),
    "chunk_over_cached_pages_d64": Case(34, [(64, 32), (100, 17), (150, 1)], group=3, head_dim=64, window=24,
                                        sink=16, swa_heads=(1,)),
}


@pytest.mark.parametrize("table", ["1d", "headwise"])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("fmt", PAGE_FORMATS)
def test_attention_over_quantized_pages_matches_float64(fmt, name, table):
    case = Case(**{**CASES[name].__dict__, "table": table})
    arrays = build_inputs(case)
    t = quantized_tensors(arrays, fmt)
    before = {n: t[n].numpy().copy() for n in ("key_cache_scales", "value_cache_scales")}
    out = run(case, t)
    assert np.isfinite(out).all(), "a row no query may see was read (its scale is NaN)"
    # Tight: float64 attention over exactly the values the op read (the pages it wrote included).
    a = {k: v for k, v in arrays.items() if k != "seq_lens_encoder"}
    kw = dict(num_heads=case.num_heads, kv_num_heads=case.kv_heads, head_dim=case.head_dim)
    deq = dict(a, key_cache=pages_as_float(t, "key_cache", fmt), value_cache=pages_as_float(t, "value_cache"))
    tight, _, _ = reference_append_attention(**deq, **kw, caches_hold_new_rows=True)
    # The format's error: float64 attention over the original float K/V.
    loose, _, _ = reference_append_attention(**a, **kw)
    print(f"[kv_quant] {fmt} {name}/{table}: vs dequantized {rel_err(out, tight):.1e}, "
          f"vs original values {rel_err(out, loose):.1e}")
    assert rel_err(out, tight) < TIGHT_TOL
    assert rel_err(out, loose) < FORMAT_TOL[fmt]
    # Only the step's rows were written: every other scale is what it was (NaN stays NaN).
    where, _, _ = new_rows(case, arrays)
    for n, old in before.items():
        new = t[n].numpy().reshape(-1, case.block_size).copy()
        old = old.reshape(-1, case.block_size).copy()
        for page, slot, *_ in where:
            new[page, slot] = old[page, slot] = 0
        np.testing.assert_array_equal(new, old)


@pytest.fixture
def cpu_options():
    """set_cpu_options (the CPU op's measurement knobs, changed between calls) for one test, restored after."""
    saved = {}

    def change(**options):
        for name, value in set_cpu_options(**options).items():
            saved.setdefault(name, value)

    yield change
    set_cpu_options(**saved)


@pytest.mark.parametrize("fmt", ["int8", "block_wise_int4", "k8v4"])
def test_the_rotation_knob_stores_keys_as_they_are(cpu_options, fmt):
    """FD_KV_QUANT_ROTATION=0 (a measurement knob: what the rotation buys) writes the keys' own codes
    and leaves the queries alone, so attention is still over the values the pages hold."""
    cpu_options(kv_key_rotation=0)  # FD_KV_QUANT_ROTATION=0
    case = CASES["chunk_over_cached_pages_d64"]
    arrays = build_inputs(case)
    t = quantized_tensors(arrays, fmt)  # the prior pages as the rule writes them (rotated keys) ...
    unrotated = {k: arrays[k] for k in ("key_cache", "value_cache")}
    for name in ("key_cache", "value_cache"):  # ... replaced by unrotated ones
        codes, scales = quantize_rows(np.nan_to_num(unrotated[name]), lane_format(fmt, LANE[name]))
        t[name] = stored(codes, lane_format(fmt, LANE[name]))
        t[name.replace("cache", "cache_scales")] = paddle.to_tensor(
            np.where(np.isnan(unrotated[name]).any(axis=-1), np.nan, scales).astype(np.float32))
    out = run(case, t)
    where, k_plain, _ = new_rows(case, arrays, fmt="block_wise_fp8")  # keys as they are (e4m3 keys are not rotated)
    pages, slots = [w[0] for w in where], [w[1] for w in where]
    written = code_values(t["key_cache"]).reshape(-1, case.block_size, case.head_dim)[pages, slots]
    np.testing.assert_array_equal(written, quantize_rows(k_plain, lane_format(fmt, keys=True))[0])
    a = {k: v for k, v in arrays.items() if k != "seq_lens_encoder"}
    kw = dict(num_heads=case.num_heads, kv_num_heads=case.kv_heads, head_dim=case.head_dim)
    deq = dict(a, key_cache=pages_as_float(t, "key_cache"), value_cache=pages_as_float(t, "value_cache"))
    tight, _, _ = reference_append_attention(**deq, **kw, caches_hold_new_rows=True)
    assert rel_err(out, tight) < TIGHT_TOL


@pytest.mark.parametrize("fmt", ["int8", "block_wise_int4", "k8v4"])
def test_the_value_rotation_knob_stores_rotated_values_and_rotates_the_output_back(cpu_options, fmt):
    """FD_KV_QUANT_ROTATE_VALUES=1 (a measurement knob: what rotating the values would buy) writes H v's
    codes and returns H out' / d: attention over the values the pages hold, rotated back."""
    cpu_options(kv_value_rotation=1)  # FD_KV_QUANT_ROTATE_VALUES=1
    case = CASES["chunk_over_cached_pages_d64"]
    arrays = build_inputs(case)
    t = quantized_tensors(arrays, fmt)
    values = arrays["value_cache"]
    value_fmt = lane_format(fmt, keys=False)
    codes, scales = quantize_rows(hadamard(np.nan_to_num(values)), value_fmt)  # the prior pages' values rotated too
    t["value_cache"] = stored(codes, value_fmt)
    t["value_cache_scales"] = paddle.to_tensor(np.where(np.isnan(values).any(axis=-1), np.nan, scales).astype(np.float32))
    out = run(case, t)
    where, _, v = new_rows(case, arrays, fmt)
    pages, slots = [w[0] for w in where], [w[1] for w in where]
    written = code_values(t["value_cache"]).reshape(-1, case.block_size, case.head_dim)[pages, slots]
    np.testing.assert_array_equal(written, quantize_rows(hadamard(v), value_fmt)[0])
    a = {k: v for k, v in arrays.items() if k != "seq_lens_encoder"}
    kw = dict(num_heads=case.num_heads, kv_num_heads=case.kv_heads, head_dim=case.head_dim)
    rotated_values = pages_as_float(t, "value_cache").astype(np.float64)
    deq = dict(a, key_cache=pages_as_float(t, "key_cache", fmt),
               value_cache=hadamard(rotated_values) / case.head_dim)
    tight, _, _ = reference_append_attention(**deq, **kw, caches_hold_new_rows=True)
    assert rel_err(out, tight) < TIGHT_TOL
