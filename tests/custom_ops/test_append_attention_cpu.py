"""CPU AppendAttention op vs the float64 reference (tests/custom_ops/reference_attention.py).

Every case draws fresh random inputs from its own seed. The cache starts as
NaN everywhere except the prior K/V the step may legitimately read, so a
wrong page, an out-of-window row, a dead page or a row past the causal edge
turns the output into NaN; output buffers are poisoned with NaN before the
call, so an unwritten element cannot pass either.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.layers.attention.ops import append_attention
from fastdeploy.model_executor.layers.attention.ops.cpu_op_loader import set_cpu_options
from reference_attention import head_window_array, reference_append_attention, round_to_bf16

FP32_TOL = 1e-5
BF16_TOL = 1e-2


@dataclass
class Case:
    seed: int
    requests: list  # (tokens already cached, new tokens this step)
    block_size: int = 16
    kv_heads: int = 2
    group: int = 1
    head_dim: int = 32
    window: int = 8
    sink: int = 0
    swa_heads: tuple = (0,)
    table: str = "headwise"  # "1d" | "headwise" (pages scattered over heads) | "headwise_same" (page = b*H + h)
    # Head-wise only, SWA blocks the retention rule declares dead: "minus1" (recycled),
    # "nan_page" (entry kept, page NaN-filled: proves it is never read) or "none" (recycle off).
    dead: str = "minus1"
    cache_dtype: str = "float32"
    qkv_dtype: str = "float32"
    poison_invisible_rows: bool = True  # NaN in rows no query of the step may see
    # One (window, sink) per KV head (window 0 = full), instead of window / sink for the heads swa_heads.
    head_windows: tuple = None
    sinks: bool = False  # a learned sink logit per query head (gpt-oss), drawn per case
    softcap: float = 0.0  # attention soft-capping (Gemma 2), 0 = off

    @property
    def num_heads(self):
        return self.kv_heads * self.group

    def head_pair(self, h):
        """(window, sink) KV head h masks with; window 0 = a full head."""
        if self.head_windows is not None:
            return self.head_windows[h]
        return (self.window, self.sink) if h in self.swa_heads else (0, 0)

    def head_window_array(self):
        """The op's head_windows [2, kv_heads]: row 0 the heads' windows, row 1 their sinks."""
        if self.head_windows is not None:
            return np.array(self.head_windows, np.int32).T.copy()
        return head_window_array(self.kv_heads, self.window, self.sink, self.swa_heads)


def dead_blocks(n, window, sink, bs):
    """Blocks of a SWA head that the retention rule (docs/retention_rule.md) has recycled after n tokens."""
    return {i for i in range(math.ceil(n / bs)) if i >= math.ceil(sink / bs) and (i + 1) * bs <= n - window + 1}


def build_inputs(case: Case):
    rng = np.random.default_rng(case.seed)
    H, bs, D = case.kv_heads, case.block_size, case.head_dim
    needs = [math.ceil((n + c) / bs) for n, c in case.requests]
    max_blocks = max(needs) + 1  # one spare column that is never needed
    num_blocks = sum(needs) + 3  # a few unallocated (NaN) blocks
    windows = case.head_window_array()
    bsz = len(case.requests)

    blocks = rng.permutation(num_blocks)
    table_1d = np.full((bsz, max_blocks), -1, np.int32)
    start = 0
    for r, k in enumerate(needs):
        table_1d[r, :k] = blocks[start:start + k]
        start += k
    if case.table == "1d":
        table = table_1d
    elif case.table == "headwise_same":
        table = np.full((bsz, H, max_blocks), -1, np.int32)
        for h in range(H):
            table[:, h, :] = np.where(table_1d >= 0, table_1d * H + h, -1)
    else:  # pages drawn from the whole page space: head h's page often lives in another head's slot
        pages = iter(rng.permutation(num_blocks * H))
        table = np.full((bsz, H, max_blocks), -1, np.int32)
        for r, k in enumerate(needs):
            for h in range(H):
                for i in range(k):
                    table[r, h, i] = next(pages)

    kc = np.full((num_blocks * H, bs, D), np.nan, np.float32)
    vc = np.full_like(kc, np.nan)
    for r, (n, c) in enumerate(case.requests):
        for h in range(H):
            window, sink = case.head_pair(h)  # the head's own: it recycles and is poisoned with them
            dead = dead_blocks(n, window, sink, bs) if window else set()
            for t in range(n):
                i = t // bs
                if table.ndim == 3 and case.dead != "none" and i in dead:
                    if case.dead == "minus1":
                        table[r, h, i] = -1
                    continue  # "nan_page": the entry stays, its page stays NaN
                if case.poison_invisible_rows and window and sink <= t <= n - window:
                    continue
                p = table[r, h, i] if table.ndim == 3 else table[r, i] * H + h
                kc[p, t % bs] = rng.standard_normal(D)
                vc[p, t % bs] = rng.standard_normal(D)
    if case.cache_dtype == "bfloat16":
        kc, vc = round_to_bf16(kc), round_to_bf16(vc)
    kc = kc.reshape(num_blocks, H, bs, D)
    vc = vc.reshape(num_blocks, H, bs, D)

    this_time = np.array([c for _, c in case.requests], np.int32)
    decoder = np.array([n for n, _ in case.requests], np.int32)
    encoder = np.array([c if (c > 0 and (n == 0 or c > 1)) else 0 for n, c in case.requests], np.int32)
    cu = np.concatenate([[0], np.cumsum(this_time)]).astype(np.int32)
    T = int(cu[-1])
    qkv = rng.standard_normal((T, (case.num_heads + 2 * H) * D)).astype(np.float32)
    if case.qkv_dtype == "bfloat16":
        qkv = round_to_bf16(qkv)
    max_pos = int((decoder + this_time).max()) + 3
    inv_freq = 10000.0 ** (-np.arange(0, D, 2) / D)
    angle = np.arange(max_pos)[:, None] * inv_freq[None, :]
    arrays = dict(
        qkv=qkv, key_cache=kc, value_cache=vc, seq_lens_encoder=encoder, seq_lens_decoder=decoder,
        seq_lens_this_time=this_time, cu_seqlens_q=cu, block_tables=table,
        rotary_cos=np.cos(angle).astype(np.float32), rotary_sin=np.sin(angle).astype(np.float32),
        head_windows=windows,
    )
    if case.sinks:  # their own stream, so the other inputs stay those of the case without sinks
        arrays["attention_sinks"] = sink_logits(case.seed, case.num_heads)
    return arrays


def sink_logits(seed: int, num_heads: int) -> np.ndarray:
    """Per query head a sink logit around the scores' scale; the first one far above every score (its
    softmax then gives the keys almost nothing: exp(sink - max) must not turn the output into NaN)."""
    logits = np.random.default_rng(seed + 1000).normal(0.0, 2.0, num_heads).astype(np.float32)
    logits[0] = 60.0
    return logits


def to_paddle(arrays, case: Case):
    t = {k: paddle.to_tensor(v) for k, v in arrays.items()}
    if case.cache_dtype == "bfloat16":
        t["key_cache"] = t["key_cache"].astype("bfloat16")
        t["value_cache"] = t["value_cache"].astype("bfloat16")
    if case.qkv_dtype == "bfloat16":
        t["qkv"] = t["qkv"].astype("bfloat16")
    return t


def run_op(case: Case, arrays, visit_all_pages=False):
    """Runs the op on fresh tensors; returns (out, key_cache, value_cache) as float32 numpy."""
    t = to_paddle(arrays, case)
    # Poison: the op's output comes from the same allocator, which hands back
    # this just-freed NaN block for a same-sized request.
    poison = paddle.full([t["qkv"].shape[0], case.num_heads * case.head_dim], float("nan"), t["qkv"].dtype)
    del poison
    out = append_attention(
        **t, num_heads=case.num_heads, kv_num_heads=case.kv_heads, head_dim=case.head_dim,
        visit_all_pages=visit_all_pages, softcap=case.softcap,
    )
    f32 = lambda x: x.astype("float32").numpy()  # noqa: E731
    return f32(out), f32(t["key_cache"]), f32(t["value_cache"])


def reference(case: Case, arrays):
    a = dict(arrays)
    a.pop("seq_lens_encoder")
    return reference_append_attention(
        **a, num_heads=case.num_heads, kv_num_heads=case.kv_heads, head_dim=case.head_dim,
        cache_is_bf16=case.cache_dtype == "bfloat16", softcap=case.softcap,
    )


def rel_err(out, ref):
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def check_against_reference(name, case: Case):
    arrays = build_inputs(case)
    out, kc, vc = run_op(case, arrays)
    ref, kc_ref, vc_ref = reference(case, arrays)
    err = rel_err(out, ref)
    tol = BF16_TOL if "bfloat16" in (case.cache_dtype, case.qkv_dtype) else FP32_TOL
    print(f"[append_attention_cpu] {name}: |out-ref|/|ref| = {err:.2e} (tol {tol:g})")
    assert np.isfinite(out).all(), f"{name}: NaN/inf in the output (unwritten element or a forbidden row was read)"
    assert err < tol, f"{name}: relative error {err:.3e} >= {tol}"
    # The whole cache: new rows at their page/slot, everything else untouched (NaN stays NaN).
    cache_rtol = 2.0**-7 if case.cache_dtype == "bfloat16" else 1e-5
    np.testing.assert_allclose(kc, kc_ref, rtol=cache_rtol, atol=1e-6, equal_nan=True)
    np.testing.assert_allclose(vc, vc_ref, rtol=cache_rtol, atol=1e-6, equal_nan=True)
    return out


PREFILL = [(0, 37), (0, 20)]
DECODE = [(50, 1), (130, 1), (7, 1), (16, 1)]
MIXED = [(0, 25), (90, 1), (0, 0), (40, 13), (63, 1)]  # includes an idle slot and a chunked prefill
CHUNKED = [(64, 32), (100, 17)]

ACCURACY_CASES = {
    "prefill_gqa1_window_lt_block": Case(1, PREFILL, window=8, sink=0),
    "decode_gqa4_unaligned_window_sink_lt_bs": Case(
        2, DECODE, kv_heads=4, group=4, window=20, sink=5, swa_heads=(0, 2)),
    "mixed_gqa5_sink_gt_bs": Case(3, MIXED, group=5, window=33, sink=20, swa_heads=(1,)),
    "chunked_prefill_from_cache": Case(4, CHUNKED, group=4, window=24, sink=16, swa_heads=(0, 1)),
    "block64_window_lt_block_sink_gt_bs": Case(
        5, [(200, 1), (70, 30), (0, 50)], block_size=64, group=4, window=40, sink=70),
    "window_longer_than_sequence": Case(6, [(30, 5), (0, 12)], window=500, sink=3),
    "all_heads_full": Case(7, MIXED, group=4, swa_heads=()),
    "all_heads_swa_head_dim_128": Case(
        8, [(300, 1), (150, 4)], kv_heads=2, group=4, head_dim=128, window=64, sink=16, swa_heads=(0, 1)),
    "block64_long_decode_dead_pages": Case(
        9, [(700, 1), (520, 1)], block_size=64, group=5, window=100, sink=64, swa_heads=(0,)),
}


@pytest.mark.parametrize("table", ["1d", "headwise", "headwise_nan_dead_pages"])
@pytest.mark.parametrize("name", list(ACCURACY_CASES))
def test_matches_float64_reference_and_writes_cache(name, table):
    base = ACCURACY_CASES[name]
    case = Case(**{**base.__dict__, "table": "headwise" if table.startswith("headwise") else "1d",
                   "dead": "nan_page" if table == "headwise_nan_dead_pages" else "minus1"})
    check_against_reference(f"{name}/{table}", case)


SCORE_MOD_CASES = ("mixed_gqa5_sink_gt_bs", "chunked_prefill_from_cache", "block64_long_decode_dead_pages",
                   "decode_gqa4_unaligned_window_sink_lt_bs")


@pytest.mark.parametrize("table", ["1d", "headwise"])
@pytest.mark.parametrize("mods", ["sinks", "softcap", "sinks+softcap"])
@pytest.mark.parametrize("name", SCORE_MOD_CASES)
def test_learned_sinks_and_soft_capping_match_the_reference(name, mods, table):
    """gpt-oss's sink logits and Gemma 2's soft-capping, on sliding and full heads with recycled pages: the
    float64 reference; without them the output differs (the test would catch an op that ignored them)."""
    base = ACCURACY_CASES[name]
    case = Case(**{**base.__dict__, "table": table, "sinks": "sinks" in mods,
                   "softcap": 0.5 if "softcap" in mods else 0.0})  # 0.5: the cap bends most scores here
    out = check_against_reference(f"{name}/{mods}/{table}", case)
    plain = check_against_reference(f"{name}/plain/{table}", Case(**{**case.__dict__, "sinks": False, "softcap": 0.0}))
    assert rel_err(out, plain) > 1e-2


@pytest.mark.parametrize("change, message", [
    (dict(attention_sinks=np.zeros(3, np.float32)), "attention_sinks must be [num_heads]"),
    (dict(attention_sinks=np.zeros(8, np.int32)), "attention_sinks must be float32"),
    (dict(softcap=-1.0), "softcap must be >= 0"),
    (dict(softcap=float("nan")), "softcap must be >= 0"),
])
def test_bad_sinks_or_softcap_are_refused_by_name(change, message):
    case = Case(21, MIXED, kv_heads=2, group=4)
    t = to_paddle(build_inputs(case), case)
    softcap = change.pop("softcap", 0.0)
    t.update({k: paddle.to_tensor(v) for k, v in change.items()})
    with pytest.raises(ValueError, match=re.escape(message)):
        append_attention(**t, num_heads=case.num_heads, kv_num_heads=case.kv_heads, head_dim=case.head_dim,
                         softcap=softcap)


@pytest.mark.parametrize("table", ["1d", "headwise"])
@pytest.mark.parametrize("qkv_dtype", ["float32", "bfloat16"])
def test_bf16_cache_matches_reference(table, qkv_dtype):
    case = Case(11, MIXED + [(200, 1)], kv_heads=4, group=4, window=20, sink=20, swa_heads=(0, 3),
                table=table, cache_dtype="bfloat16", qkv_dtype=qkv_dtype)
    check_against_reference(f"bf16_cache/qkv_{qkv_dtype}/{table}", case)


def test_head_wise_and_1d_tables_are_bit_identical_on_the_same_pages():
    base = dict(seed=12, requests=MIXED + [(180, 1)], group=4, window=20, sink=8, swa_heads=(0,))
    one_d = Case(**base, table="1d")
    head_wise = Case(**base, table="headwise_same", dead="none")
    arrays_1d, arrays_hw = build_inputs(one_d), build_inputs(head_wise)
    # Same random stream and same pages: only the table's shape differs.
    np.testing.assert_array_equal(arrays_1d["key_cache"], arrays_hw["key_cache"])
    out_1d, kc_1d, vc_1d = run_op(one_d, arrays_1d)
    out_hw, kc_hw, vc_hw = run_op(head_wise, arrays_hw)
    assert np.isfinite(out_1d).all()
    assert np.array_equal(out_1d, out_hw)
    assert np.array_equal(kc_1d, kc_hw, equal_nan=True) and np.array_equal(vc_1d, vc_hw, equal_nan=True)


def test_visit_all_pages_matches_skipping():
    # The baseline reads (and masks) every page, so nothing may be poisoned.
    case = Case(13, MIXED + [(150, 1)], group=4, window=20, sink=20, swa_heads=(0,), table="1d",
                poison_invisible_rows=False)
    arrays = build_inputs(case)
    skip, _, _ = run_op(case, arrays)
    visit_all, _, _ = run_op(case, arrays, visit_all_pages=True)
    ref, _, _ = reference(case, arrays)
    err = rel_err(visit_all, skip)
    print(f"[append_attention_cpu] visit_all vs skip: {err:.2e}; visit_all vs ref: {rel_err(visit_all, ref):.2e}")
    assert err < 1e-5
    assert rel_err(visit_all, ref) < FP32_TOL


def test_parallel_and_serial_runs_are_bit_identical():
    # Long enough that the helper thread really takes items while the caller
    # works (a shared-scratch race shows up here); every (token, head) item
    # has a fixed summation order, so the thread count cannot change a bit.
    case = Case(14, [(1500, 1)] * 4 + [(0, 48)], block_size=64, kv_heads=2, group=4, head_dim=128,
                window=256, sink=16, swa_heads=(0,))
    arrays = build_inputs(case)
    saved = set_cpu_options(attn_threads=1)  # FD_CPU_ATTN_NUM_THREADS, changed between calls
    try:
        serial, _, _ = run_op(case, arrays)
        assert np.isfinite(serial).all()
        set_cpu_options(attn_threads=2)
        for _ in range(3):
            parallel, _, _ = run_op(case, arrays)
            assert np.array_equal(serial, parallel)
    finally:
        set_cpu_options(**saved)


def test_padding_rows_past_the_batch_are_zeroed():
    case = Case(15, DECODE)
    arrays = build_inputs(case)
    arrays["qkv"] = np.concatenate([arrays["qkv"], np.ones((3, arrays["qkv"].shape[1]), np.float32)])
    out, _, _ = run_op(case, arrays)
    ref, _, _ = reference(case, {**arrays, "qkv": arrays["qkv"][: len(DECODE)]})
    assert np.array_equal(out[len(DECODE):], np.zeros_like(out[len(DECODE):]))
    assert rel_err(out[: len(DECODE)], ref) < FP32_TOL


# -- per-head windows: head_windows [2, kv_heads], each head with its own window and sink -------------
# A full head, three sliding types (a sink shorter than a block, one longer, none) on 4 KV heads.
HEAD_WINDOWS = ((20, 5), (0, 0), (40, 20), (9, 0))
PER_HEAD_STEPS = {
    "decode": DECODE + [(300, 1)],
    "chunked_prefill": CHUNKED,
    "mixed": MIXED,
}


@pytest.mark.parametrize("table", ["1d", "headwise", "headwise_nan_dead_pages"])
@pytest.mark.parametrize("step", list(PER_HEAD_STEPS))
def test_each_kv_head_masks_with_its_own_window_and_sink(step, table):
    """Head-wise tables hold -1 (or a NaN page) at each head's own dead blocks (its W and S), and the
    rows no query of the head may see are NaN: any read past a head's own window fails."""
    case = Case(21, PER_HEAD_STEPS[step], kv_heads=4, group=2, head_windows=HEAD_WINDOWS,
                table="headwise" if table.startswith("headwise") else "1d",
                dead="nan_page" if table == "headwise_nan_dead_pages" else "minus1")
    check_against_reference(f"per_head_windows/{step}/{table}", case)


@pytest.mark.parametrize("table", ["1d", "headwise"])
def test_the_kv_heads_flag_form_is_refused_naming_the_expected_shape(table):
    """head_windows has one form, [2, kv_heads]: the former [kv_heads] 0/1 flags (which slid with the
    call's window and sink, attributes the op no longer has) are refused before anything is written."""
    case = Case(22, MIXED + [(180, 1)] + CHUNKED, kv_heads=4, group=2, window=20, sink=8, swa_heads=(0, 2),
                table=table)
    arrays = build_inputs(case)
    assert np.array_equal(arrays["head_windows"], [[20, 0, 20, 0], [8, 0, 8, 0]])
    t = to_paddle({**arrays, "head_windows": np.array([1, 0, 1, 0], np.int32)}, case)
    before = t["key_cache"].numpy().copy()
    with pytest.raises(ValueError, match=r"head_windows must be \[2, kv_num_heads=4\] \(row 0 the window of each KV "
                                         r"head, 0 = full attention; row 1 its sink\), got \[4\] \(the \[kv_num_heads\] "
                                         r"form of 0 / 1 flags is no longer accepted"):
        append_attention(**t, num_heads=case.num_heads, kv_num_heads=case.kv_heads, head_dim=case.head_dim)
    assert np.array_equal(t["key_cache"].numpy(), before, equal_nan=True)
    with pytest.raises(TypeError, match="sliding_window"):  # the attributes are gone
        append_attention(**to_paddle(arrays, case), num_heads=case.num_heads, kv_num_heads=case.kv_heads,
                         head_dim=case.head_dim, sliding_window=20, sink_size=8)


def test_visit_all_pages_masks_each_head_with_its_own_window():
    case = Case(23, MIXED + [(150, 1)], kv_heads=4, group=2, head_windows=HEAD_WINDOWS, table="1d",
                poison_invisible_rows=False)
    arrays = build_inputs(case)
    skip, _, _ = run_op(case, arrays)
    visit_all, _, _ = run_op(case, arrays, visit_all_pages=True)
    ref, _, _ = reference(case, arrays)
    assert rel_err(visit_all, skip) < 1e-5
    assert rel_err(visit_all, ref) < FP32_TOL


def _needed_entry_set_to_minus1(case: Case, r: int, h: int, i: int):
    arrays = build_inputs(case)
    arrays["block_tables"][r, h, i] = -1
    return arrays


@pytest.mark.parametrize(
    "what, r, h, i",
    [
        # request 1 decodes t=130 with W=40, S=5, bs=16: it sees block 0 (sink) and blocks 5..8.
        ("block inside the window of a SWA head", 1, 0, 6),
        ("sink block of a SWA head", 1, 0, 0),
        ("any block of a full head", 0, 1, 1),
        ("destination block of the new token", 3, 1, 1),  # request 3 writes t=16 -> block 1
    ],
)
def test_minus1_in_a_needed_entry_raises_and_leaves_cache_untouched(what, r, h, i):
    case = Case(16, DECODE, kv_heads=2, group=2, window=40, sink=5, swa_heads=(0,), dead="minus1")
    arrays = _needed_entry_set_to_minus1(case, r, h, i)
    t = to_paddle(arrays, case)
    before = t["key_cache"].numpy().copy()
    with pytest.raises(ValueError, match=rf"request {r}, kv head {h}, block index {i}\b"):
        append_attention(**t, num_heads=case.num_heads, kv_num_heads=case.kv_heads, head_dim=case.head_dim)
    assert np.array_equal(t["key_cache"].numpy(), before, equal_nan=True)


def test_visit_all_pages_refuses_a_recycled_table():
    case = Case(17, [(200, 1)], window=20, sink=0, swa_heads=(0,), dead="minus1")
    t = to_paddle(build_inputs(case), case)
    with pytest.raises(ValueError, match="visit_all_pages"):
        append_attention(**t, num_heads=case.num_heads, kv_num_heads=case.kv_heads, head_dim=case.head_dim,
                         visit_all_pages=True)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(num_heads=3), "multiple of kv_num_heads"),
        (dict(head_dim=16), "qkv must be"),
        (dict(head_windows=np.array([[-1, 0], [0, 0]], np.int32)),
         r"head_windows\[0\]\[0\] \(the window of KV head 0\) must be >= 0"),
        (dict(head_windows=np.array([[8, 0]], np.int32)), r"head_windows must be \[2, kv_num_heads=2\].*got \[1, 2\]"),
    ],
)
def test_bad_arguments_raise_clear_errors(change, message):
    case = Case(18, DECODE)
    arrays = build_inputs(case)
    t = to_paddle({**arrays, **{k: v for k, v in change.items() if k == "head_windows"}}, case)
    kwargs = dict(num_heads=case.num_heads, kv_num_heads=case.kv_heads, head_dim=case.head_dim)
    with pytest.raises(ValueError, match=message):
        append_attention(**t, **{**kwargs, **{k: v for k, v in change.items() if k != "head_windows"}})


def test_table_too_narrow_for_the_step_raises():
    case = Case(19, DECODE)
    arrays = build_inputs(case)
    arrays["block_tables"] = np.ascontiguousarray(arrays["block_tables"][:, :, :2])
    t = to_paddle(arrays, case)
    with pytest.raises(ValueError, match="needs block index"):
        append_attention(**t, num_heads=case.num_heads, kv_num_heads=case.kv_heads, head_dim=case.head_dim)


def test_missing_compiler_is_a_clear_runtime_error(monkeypatch):
    from fastdeploy.model_executor.layers.attention.ops import cpu_op_loader

    monkeypatch.setenv("CC", "/nonexistent/bin/cc")
    with pytest.raises(RuntimeError, match=r"needs a C\+\+ compiler.*CC='/nonexistent/bin/cc'"):
        cpu_op_loader._check_compiler()


def test_build_cache_key_follows_sources_and_flags(tmp_path):
    from fastdeploy.model_executor.layers.attention.ops import cpu_op_loader

    src = tmp_path / "op.cc"
    src.write_text("int x;")
    key = cpu_op_loader._build_key([src], ["-O3"])
    assert key == cpu_op_loader._build_key([src], ["-O3"])
    assert key != cpu_op_loader._build_key([src], ["-O3", "-mavx2"])
    src.write_text("int y;")
    assert key != cpu_op_loader._build_key([src], ["-O3"])


# -- lanes of the slot layout: a layer's heads in some of a wider cache's slots ---------------------
def _into_lane(case: Case, arrays, head_slots, lane_slots):
    """The same step on a lane [num_blocks, G, bs, D] where KV head slot j of `arrays` sits in lane slot
    head_slots[j]; the other slots are NaN (belonging to other layers: never read or written)."""
    H = case.kv_heads
    kc, vc = arrays["key_cache"], arrays["value_cache"]
    shape = (kc.shape[0], lane_slots) + kc.shape[2:]
    lk, lv = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    lk[:, list(head_slots)], lv[:, list(head_slots)] = kc, vc
    lane = dict(arrays, key_cache=lk, value_cache=lv, kv_head_slots=np.array(head_slots, np.int32))
    table = arrays["block_tables"]
    if table.ndim == 3:  # page p = cache[p // H, p % H] -> lane page (p // H) * G + head_slots[p % H]
        mapped = np.where(table < 0, -1, (table // H) * lane_slots + np.array(head_slots)[table % H])
        rows = np.full((table.shape[0], lane_slots, table.shape[2]), -1, np.int32)
        rows[:, list(head_slots)] = mapped
        lane["block_tables"] = rows.astype(np.int32)
    return lane


@pytest.mark.parametrize("table", ["headwise", "1d"])
def test_kv_head_slots_address_a_lane_exactly_like_the_per_head_cache(table):
    case = Case(seed=71, requests=[(40, 1), (0, 23), (19, 6)], kv_heads=2, group=2, table=table,
                poison_invisible_rows=False)
    arrays = build_inputs(case)
    out, kc, vc = run_op(case, arrays)
    head_slots, lane_slots = (3, 1), 5
    lane_out, lk, lv = run_op(case, _into_lane(case, arrays, head_slots, lane_slots))
    np.testing.assert_array_equal(lane_out, out)
    np.testing.assert_array_equal(lk[:, list(head_slots)], kc)
    np.testing.assert_array_equal(lv[:, list(head_slots)], vc)
    other = [s for s in range(lane_slots) if s not in head_slots]
    assert np.isnan(lk[:, other]).all() and np.isnan(lv[:, other]).all()  # other layers' slots untouched


@pytest.mark.parametrize("head_slots, message", [((1, 1), "same slot 1"), ((0, 3), r"kv_head_slots\[1\] = 3 is not a slot"),
                                                 ((0, -1), r"kv_head_slots\[1\] = -1 is not a slot")])
def test_bad_kv_head_slots_are_refused_before_anything_is_written(head_slots, message):
    case = Case(seed=72, requests=[(0, 5)], kv_heads=2)
    arrays = build_inputs(case)
    lane = _into_lane(case, arrays, (0, 1), 3)
    lane["kv_head_slots"] = np.array(head_slots, np.int32)
    before = lane["key_cache"].copy()
    t = to_paddle(lane, case)
    with pytest.raises(ValueError, match=message):
        append_attention(**t, num_heads=case.num_heads, kv_num_heads=case.kv_heads, head_dim=case.head_dim)
    np.testing.assert_array_equal(t["key_cache"].numpy(), before)
