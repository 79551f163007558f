"""The input checks shared by the CPU op and the CUDA wrapper (custom_ops/cpu_ops/append_attention_checks.h).

Each bad input is fed three ways: to the CPU op (which must raise before writing anything: the
cache is compared byte for byte), and to the validate-only op with the CPU op's rules and with the
CUDA wrapper's rules, so the GPU wrapper's checks are exercised on a machine without a GPU.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.layers.attention.ops import append_attention, validate_append_attention_inputs

KV_HEADS, GROUP, HEAD_DIM, BLOCK, NUM_BLOCKS, MAX_BLOCKS = 2, 2, 16, 16, 8, 4
NUM_HEADS = KV_HEADS * GROUP
ATTRS = dict(num_heads=NUM_HEADS, kv_num_heads=KV_HEADS, head_dim=HEAD_DIM)
ORDER = ("qkv", "key_cache", "value_cache", "seq_lens_encoder", "seq_lens_decoder", "seq_lens_this_time",
         "cu_seqlens_q", "block_tables", "rotary_cos", "rotary_sin", "head_windows")


def valid_inputs() -> dict[str, np.ndarray]:
    """Request 0 decodes its token 40 (blocks 0-2), request 1 prefills 5 tokens (block 0); head 0 slides
    (window 8, sink 0), head 1 is full."""
    rng = np.random.default_rng(0)
    this_time = np.array([1, 5], np.int32)
    decoder = np.array([40, 0], np.int32)
    table = np.full((2, KV_HEADS, MAX_BLOCKS), -1, np.int32)
    table[0, :, :3] = [[-1, -1, 0], [1, 3, 6]]  # head 0 slides (W=8): blocks 0-1 are dead at 40
    table[1, :, :1] = [[4], [5]]
    angle = np.arange(64)[:, None] * 10000.0 ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)[None, :]
    return dict(
        qkv=rng.standard_normal((6, (NUM_HEADS + 2 * KV_HEADS) * HEAD_DIM)).astype(np.float32),
        key_cache=rng.standard_normal((NUM_BLOCKS, KV_HEADS, BLOCK, HEAD_DIM)).astype(np.float32),
        value_cache=rng.standard_normal((NUM_BLOCKS, KV_HEADS, BLOCK, HEAD_DIM)).astype(np.float32),
        seq_lens_encoder=np.array([0, 5], np.int32),
        seq_lens_decoder=decoder,
        seq_lens_this_time=this_time,
        cu_seqlens_q=np.array([0, 1, 6], np.int32),
        block_tables=table,
        rotary_cos=np.cos(angle).astype(np.float32),
        rotary_sin=np.sin(angle).astype(np.float32),
        head_windows=np.array([[8, 0], [0, 0]], np.int32),
    )


def _set(name, value):
    def change(a):
        a[name] = value(a) if callable(value) else value
    return change


def _entry(r, h, i, value):
    def change(a):
        a["block_tables"][r, h, i] = value
    return change


BAD_INPUTS = {
    "qkv narrower than (num_heads + 2 kv_heads) * head_dim": (
        _set("qkv", lambda a: a["qkv"][:, :-HEAD_DIM].copy()), r"qkv must be \[token_num"),
    "qkv of rank 3": (_set("qkv", lambda a: a["qkv"][None]), r"qkv must be \[token_num"),
    "qkv float64": (_set("qkv", lambda a: a["qkv"].astype(np.float64)), "qkv must be"),
    "seq_lens_this_time int64": (_set("seq_lens_this_time", lambda a: a["seq_lens_this_time"].astype(np.int64)),
                                 "seq_lens_this_time must be int32"),
    "cu_seqlens_q too short": (_set("cu_seqlens_q", np.array([0, 1], np.int32)),
                               r"cu_seqlens_q must have shape \[3\]"),
    "cu_seqlens_q not the prefix sum": (_set("cu_seqlens_q", np.array([0, 2, 6], np.int32)), "not the prefix sum"),
    "cu_seqlens_q not starting at 0": (_set("cu_seqlens_q", np.array([1, 2, 7], np.int32)),
                                       r"cu_seqlens_q\[0\] must be 0"),
    "cu_seqlens_q past the rows of qkv": (
        _set("qkv", lambda a: a["qkv"][:5].copy()), r"cu_seqlens_q\[bsz\]=6 exceeds the 5 rows of qkv"),
    "table of rank 1": (_set("block_tables", lambda a: a["block_tables"].reshape(-1)), "block_tables must be"),
    "table of rank 4": (_set("block_tables", lambda a: a["block_tables"][None]), "block_tables must be"),
    "table rows != bsz": (_set("block_tables", lambda a: a["block_tables"][:1].copy()), "block_tables must be"),
    "table heads != kv_heads": (_set("block_tables", lambda a: a["block_tables"][:, :1].copy()),
                                "block_tables must be"),
    "table int64": (_set("block_tables", lambda a: a["block_tables"].astype(np.int64)), "block_tables must be int32"),
    "table too narrow for the step": (
        _set("block_tables", lambda a: a["block_tables"][:, :, :1].copy()), "needs block index 2"),
    "page id past the cache (full head, other heads valid)": (
        _entry(1, 1, 0, NUM_BLOCKS * KV_HEADS), r"page id 16 at request 1, kv head 1, block index 0 is out of range"),
    "-1 where the step writes": (_entry(1, 1, 0, -1), r"entry is -1 at request 1, kv head 1, block index 0"),
    "-1 inside a SWA window": (_entry(0, 0, 2, -1), r"entry is -1 at request 0, kv head 0, block index 2"),
    "rotary table too short": (_set("rotary_cos", lambda a: a["rotary_cos"][:10].copy()), "rotary_cos"),
    "negative seq_lens_decoder": (_set("seq_lens_decoder", np.array([-1, 0], np.int32)), "negative"),
    # head_windows [2, kv_heads]: row 0 each head's window (0 = full), row 1 its sink; no other form.
    "head_windows as [kv_heads] flags (the removed form)": (
        _set("head_windows", np.array([1, 0], np.int32)),
        r"head_windows must be \[2, kv_num_heads=2\] \(row 0 the window of each KV head, 0 = full attention; row 1 "
        r"its sink\), got \[2\] \(the \[kv_num_heads\] form of 0 / 1 flags is no longer accepted"),
    "head_windows of 3 rows": (_set("head_windows", np.zeros((3, KV_HEADS), np.int32)),
                               r"head_windows must be \[2, kv_num_heads=2\] .*, got \[3, 2\]"),
    "head_windows for 3 heads": (_set("head_windows", np.zeros((2, 3), np.int32)),
                                 r"head_windows must be \[2, kv_num_heads=2\] .*, got \[2, 3\]"),
    "head_windows int64": (_set("head_windows", lambda a: a["head_windows"].astype(np.int64)),
                           "head_windows must be int32"),
    "a negative per-head window": (_set("head_windows", np.array([[8, -1], [0, 0]], np.int32)),
                                   r"head_windows\[0\]\[1\] \(the window of KV head 1\) must be >= 0"),
    "a negative per-head sink": (_set("head_windows", np.array([[8, 0], [-2, 0]], np.int32)),
                                 r"head_windows\[1\]\[0\] \(the sink of KV head 0\) must be >= 0"),
    # head 0's blocks 0-1 are recycled (W=8 at 40): a head with a wider window of its own, or a full
    # head, needs them.
    "-1 inside a head's own wider window": (_set("head_windows", np.array([[20, 0], [0, 0]], np.int32)),
                                            r"entry is -1 at request 0, kv head 0, block index 1"),
    "-1 where a head that is full reads": (
        _set("head_windows", np.array([[0, 8], [0, 0]], np.int32)), r"entry is -1 at request 0, kv head 0, block index 0"),
}


def test_per_head_windows_check_pages_with_each_heads_own_window():
    """The same recycled table passes with head 0's own window 8 (or 9: keys 32-40, still past block 1)
    beside a full or sliding head 1, under both rule sets, and runs."""
    for mask in ([[8, 0], [0, 0]], [[9, 0], [0, 0]], [[8, 3], [0, 2]]):
        arrays = {**valid_inputs(), "head_windows": np.array(mask, np.int32)}
        _validate(_tensors(arrays), "cpu", check_place=True)
        _validate(_tensors(arrays, "bfloat16", "bfloat16"), "gpu")
        append_attention(**_tensors(arrays), **ATTRS)


def _tensors(arrays, qkv_dtype=None, cache_dtype=None):
    t = {k: paddle.to_tensor(v) for k, v in arrays.items()}
    if qkv_dtype:
        t["qkv"] = t["qkv"].astype(qkv_dtype)
    if cache_dtype:
        t["key_cache"] = t["key_cache"].astype(cache_dtype)
        t["value_cache"] = t["value_cache"].astype(cache_dtype)
    return t


def _validate(t, rules, check_place=False):
    validate_append_attention_inputs(*(t[k] for k in ORDER), rules=rules, check_place=check_place, **ATTRS)


def test_valid_step_passes_both_rule_sets_and_runs():
    arrays = valid_inputs()
    _validate(_tensors(arrays), "cpu", check_place=True)
    _validate(_tensors(arrays, "bfloat16", "bfloat16"), "gpu")
    _validate(_tensors(arrays, "float16", "float16"), "gpu")
    out = append_attention(**_tensors(arrays), **ATTRS)
    assert out.shape == [6, NUM_HEADS * HEAD_DIM]


@pytest.mark.parametrize("what", list(BAD_INPUTS))
def test_cpu_op_rejects_bad_input_before_writing_the_cache(what):
    change, message = BAD_INPUTS[what]
    arrays = valid_inputs()
    change(arrays)
    t = _tensors(arrays)
    key_before, value_before = t["key_cache"].numpy().copy(), t["value_cache"].numpy().copy()
    with pytest.raises(ValueError, match=message):
        append_attention(**t, **ATTRS)
    assert np.array_equal(t["key_cache"].numpy(), key_before)
    assert np.array_equal(t["value_cache"].numpy(), value_before)


@pytest.mark.parametrize("what", list(BAD_INPUTS))
def test_gpu_wrapper_rules_reject_the_same_bad_input(what):
    change, message = BAD_INPUTS[what]
    arrays = valid_inputs()
    change(arrays)
    if arrays["qkv"].dtype == np.float64:
        t = _tensors(arrays)  # float64 is wrong under both rule sets
    else:
        t = _tensors(arrays, "bfloat16", "bfloat16")
    with pytest.raises(ValueError, match=message) as info:
        _validate(t, "gpu")
    assert "append_attention_gpu: " in str(info.value)  # the wrapper's name, not the CPU op's


@pytest.mark.parametrize(
    "qkv_dtype, cache_dtype, message",
    [
        ("float32", "float32", "qkv must be bfloat16 or float16"),
        ("bfloat16", "float16", "caches must have qkv's dtype"),
        ("float16", "float32", "caches must have qkv's dtype"),
    ],
)
def test_gpu_wrapper_rules_reject_dtypes_its_kernels_do_not_have(qkv_dtype, cache_dtype, message):
    t = _tensors(valid_inputs(), qkv_dtype, cache_dtype)
    with pytest.raises(ValueError, match=message):
        _validate(t, "gpu")


def test_cpu_op_rejects_float16_which_it_has_no_kernel_for():
    t = _tensors(valid_inputs(), "float16", "float16")
    with pytest.raises(ValueError, match="qkv must be float32 or bfloat16"):
        append_attention(**t, **ATTRS)


def test_gpu_wrapper_rules_reject_cpu_tensors_naming_the_input():
    t = _tensors(valid_inputs(), "bfloat16", "bfloat16")
    with pytest.raises(ValueError, match=r"every input must be a GPU tensor, but qkv is on .*(cpu|CPU)"):
        _validate(t, "gpu", check_place=True)


# -- the scale tensors of quantized pages (int8 / float8_e4m3fn / uint8 int4 caches) -----------------
SCALES_SHAPE = (NUM_BLOCKS, KV_HEADS, BLOCK)
# The message naming a key / value pair that is no page format, with both lanes' dtypes and shapes.
NOT_A_PAIR = (r"value_cache must match key_cache in shape and dtype, or hold the uint8 int4 values of k8v4 pages "
              r"\[num_blocks, slots, block_size, head_dim / 2\] beside int8 keys \[num_blocks, slots, block_size, "
              r"head_dim\]; got key_cache ")
BAD_SCALES = {
    "int8 caches without scales (the float placeholder)": (
        "int8", dict(key_cache_scales=np.zeros(1, np.float32)), r"key_cache_scales must be \[num_blocks=8, slots=2, "
                                                                r"block_size=16\] .* for int8 caches"),
    "e4m3 caches, value scales one row short": (
        "float8_e4m3fn", dict(value_cache_scales=np.zeros((NUM_BLOCKS, KV_HEADS, BLOCK - 1), np.float32)),
        r"value_cache_scales must be \[num_blocks=8, slots=2, block_size=16\] .* float8_e4m3fn"),
    "float64 scales": ("int8", dict(key_cache_scales=np.zeros(SCALES_SHAPE)), "key_cache_scales must be float32"),
    "float caches given real scales": (
        "float32", dict(key_cache_scales=np.zeros(SCALES_SHAPE, np.float32)), "1-element placeholder for float caches"),
    "int8 keys, e4m3 values": ("int8", dict(value_cache="float8_e4m3fn"),
                               NOT_A_PAIR + r"int8 \[8, 2, 16, 16\] and value_cache float8_e4m3fn \[8, 2, 16, 16\]"),
    # k8v4 is int8 keys with int4 values; nothing else mixes lanes.
    "int4 keys, int8 values (k8v4 the wrong way round)": (
        "uint8", dict(value_cache="int8"), NOT_A_PAIR + r"uint8 \[8, 2, 16, 8\] and value_cache int8 \[8, 2, 16, 16\]"),
    "int8 keys, int4 values a whole head_dim wide (codes not packed two per byte)": (
        "int8", dict(value_cache="uint8", unpacked=True),
        NOT_A_PAIR + r"int8 \[8, 2, 16, 16\] and value_cache uint8 \[8, 2, 16, 16\]"),
    "int8 keys, float values": (  # float32 for the CPU op, bfloat16 under the CUDA rules
        "int8", dict(value_cache="float32"),
        NOT_A_PAIR + r"int8 \[8, 2, 16, 16\] and value_cache (float32|bfloat16) \[8, 2, 16, 16\]"),
    "k8v4 values without scales": (
        "int8", dict(value_cache="uint8", value_cache_scales=np.zeros(1, np.float32)),
        r"value_cache_scales must be \[num_blocks=8, slots=2, block_size=16\] .* for uint8 \(int4 pairs\) caches"),
    "k8v4 keys without scales": (
        "int8", dict(value_cache="uint8", key_cache_scales=np.zeros(1, np.float32)),
        r"key_cache_scales must be \[num_blocks=8, slots=2, block_size=16\] .* for int8 caches"),
    "int4 caches without scales": (
        "uint8", dict(value_cache_scales=np.zeros(1, np.float32)),
        r"value_cache_scales must be \[num_blocks=8, slots=2, block_size=16\] .* for uint8 \(int4 pairs\) caches"),
    "int4 caches a whole head_dim wide (codes not packed two per byte)": (
        "uint8", dict(unpacked=True), r"key_cache must be \[num_blocks, slots >= kv_num_heads=2, block_size, "
                                      r"head_dim / 2=\d+\]"),
}


def _with_scales(cache_dtype, change):
    t = _tensors(valid_inputs())
    for name in ("key_cache", "value_cache"):
        t[name] = (t[name] * 10).astype(change.get(name, cache_dtype))
        if t[name].dtype == paddle.uint8 and not change.get("unpacked"):  # int4: two codes per byte
            t[name] = t[name][..., : t[name].shape[-1] // 2].contiguous()
    quantized = cache_dtype != "float32"
    for name in ("key_cache_scales", "value_cache_scales"):
        t[name] = paddle.to_tensor(change.get(name, np.ones(SCALES_SHAPE if quantized else 1, np.float32)))
    return t


@pytest.mark.parametrize("what", list(BAD_SCALES))
def test_bad_scale_tensors_are_refused_before_anything_is_written(what):
    cache_dtype, change, message = BAD_SCALES[what]
    t = _with_scales(cache_dtype, change)
    before = {k: t[k].astype("float32").numpy().copy() for k in ("key_cache", "value_cache", "key_cache_scales")}
    with pytest.raises(ValueError, match=message):
        append_attention(**t, **ATTRS)
    for k, v in before.items():
        assert np.array_equal(t[k].astype("float32").numpy(), v)
    with pytest.raises(ValueError, match=message) as info:  # the CUDA wrapper's rules: the same check
        _validate_all({**t, **{k: t[k].astype("bfloat16") for k in ("qkv", "key_cache", "value_cache")
                               if t[k].dtype == paddle.float32}}, "gpu")
    assert "append_attention_gpu: " in str(info.value)


@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn", "uint8"])
def test_quantized_caches_pass_both_rule_sets_and_the_cuda_rules_want_bfloat16(cache_dtype):
    t = _with_scales(cache_dtype, {})
    append_attention(**t, **ATTRS)
    append_attention(**{**t, "qkv": t["qkv"].astype("bfloat16")}, **ATTRS)  # the CPU op: either qkv dtype
    _validate_all(t, "cpu")
    _validate_all({**t, "qkv": t["qkv"].astype("bfloat16")}, "gpu")
    with pytest.raises(ValueError, match="append_attention_gpu: int8 / float8_e4m3fn caches .* need bfloat16 qkv"):
        _validate_all({**t, "qkv": t["qkv"].astype("float16")}, "gpu")


def test_k8v4_int8_keys_beside_int4_values_pass_both_rule_sets_and_run():
    """k8v4 pages: an int8 key lane [..., head_dim] and a uint8 value lane of int4 pairs [..., head_dim / 2],
    each with its scales; the CPU op runs it with either qkv dtype, the CUDA rules want bfloat16 qkv."""
    t = _with_scales("int8", dict(value_cache="uint8"))
    assert t["key_cache"].shape == [NUM_BLOCKS, KV_HEADS, BLOCK, HEAD_DIM]
    assert t["value_cache"].shape == [NUM_BLOCKS, KV_HEADS, BLOCK, HEAD_DIM // 2]
    out = append_attention(**t, **ATTRS)
    assert out.shape == [6, NUM_HEADS * HEAD_DIM] and np.isfinite(out.numpy()).all()
    append_attention(**{**t, "qkv": t["qkv"].astype("bfloat16")}, **ATTRS)
    _validate_all(t, "cpu")
    _validate_all({**t, "qkv": t["qkv"].astype("bfloat16")}, "gpu")
    with pytest.raises(ValueError, match="append_attention_gpu: int8 / float8_e4m3fn caches .* need bfloat16 qkv"):
        _validate_all({**t, "qkv": t["qkv"].astype("float16")}, "gpu")


def test_float_lanes_of_two_dtypes_are_no_page_format():
    t = _tensors(valid_inputs())
    t["value_cache"] = t["value_cache"].astype("bfloat16")
    with pytest.raises(ValueError, match=NOT_A_PAIR + r"float32 \[8, 2, 16, 16\] and value_cache bfloat16 "):
        append_attention(**t, **ATTRS)


def _validate_all(t, rules):
    from fastdeploy.model_executor.layers.attention.ops.append_attention import identity_head_slots

    slots = identity_head_slots(KV_HEADS, t["qkv"].place)
    validate_append_attention_inputs(*(t[k] for k in ORDER), slots, t["key_cache_scales"], t["value_cache_scales"],
                                     rules=rules, check_place=False, **ATTRS)
