"""CUDA AppendAttention vs the float64 reference: on a GPU where one is visible, else the same
kernel sources on the CPU through the CUDA-on-CPU executor (custom_ops/gpu_ops/cuda_on_cpu), the
same ctypes harness and C ABI. On the executor every launch runs under two thread orders (forward
and reverse between barriers, and the blocks likewise) and must leave the same bytes: a difference
is a race, reported with the kernel's name.

Every case starts from fresh random inputs (the seed is in each failure message), NaN in every
cache row that holds no token (unwritten rows, recycled pages, free pages) and NaN in the output,
so a kernel that reads what it must not, or leaves an output element unwritten, fails.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import gpu_harness  # noqa: E402
from gpu_harness import BF16, FP16, from_storage  # noqa: E402
from gpu_reference import MIXED_HEAD_WINDOWS, build_case, reference, relative_error  # noqa: E402

ON_GPU = gpu_harness.find_nvcc() is not None and gpu_harness.driver_gpu_count() > 0
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not ON_GPU and gpu_harness.find_cuda_include() is None,
    reason="neither a GPU nor the CUDA toolkit's headers (the CPU executor compiles against them)",
)]

TOLERANCE = {BF16: 1e-2, FP16: 2e-3}
CACHE_RTOL = {BF16: 1e-2, FP16: 2e-3}  # one storage ulp of the rotated K


@pytest.fixture(scope="module")
def harness():
    h = gpu_harness.Harness(gpu_harness.cached_build(on_cpu=not ON_GPU))
    # On a GPU the driver sees one, so a runtime that sees none is broken; the executor is one device.
    assert h.device_count() > 0, "the driver sees a GPU but the CUDA runtime sees no device"
    return h


class SeededGenerator(np.random.Generator):
    """A Generator that remembers its seed, for failure messages."""

    def __init__(self, seed: int):
        super().__init__(np.random.PCG64(seed))
        self.seed_value = seed


@pytest.fixture
def rng():
    return SeededGenerator(int.from_bytes(os.urandom(4), "little"))


def check(harness, case, rng):
    dtype = case.params["dtype"]
    ref_out, ref_k, ref_v = reference(case)
    result = harness.run(case)
    assert result.status == 0, f"seed {rng.seed_value}: {result.message}"
    assert not result.races, f"seed {rng.seed_value}: {result.races}"
    got = from_storage(result.out, dtype).reshape(ref_out.shape)
    assert np.isfinite(got).all(), f"seed {rng.seed_value}: NaN/unwritten output"
    err = relative_error(result.out, ref_out, dtype)
    assert err < TOLERANCE[dtype], f"seed {rng.seed_value}: relative error {err:.3g}"
    for got_cache, ref_cache in ((result.key_cache, ref_k), (result.value_cache, ref_v)):
        np.testing.assert_allclose(
            from_storage(got_cache, dtype).reshape(ref_cache.shape),
            ref_cache,
            rtol=CACHE_RTOL[dtype],
            atol=CACHE_RTOL[dtype],
            equal_nan=True,  # rows nobody wrote stay NaN: no stray writes
            err_msg=f"seed {rng.seed_value}",
        )
    return result


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("head_dim, num_heads", [(64, 16), (128, 10), (256, 8)])
@pytest.mark.parametrize("block_size", [16, 64])
def test_prefill_matches_reference(harness, rng, dtype, head_dim, num_heads, block_size):
    case = build_case(
        rng,
        [(0, 150), (0, 37), (0, 1)],
        dtype=dtype,
        num_heads=num_heads,
        kv_num_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        window=40,
        sink=5,
    )
    check(harness, case, rng)


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("head_dim, num_heads, kv_num_heads", [(128, 20, 4), (256, 4, 1)],
                         ids=["hd128_ernie", "hd256_gemma3"])
def test_decode_with_split_kv_matches_reference(harness, rng, dtype, block_size, head_dim, num_heads,
                                                kv_num_heads):
    case = build_case(
        rng,
        [(1000, 1), (517, 1), (64, 1), (63, 1), (3, 1)],
        dtype=dtype,
        num_heads=num_heads,
        kv_num_heads=kv_num_heads,
        head_dim=head_dim,
        block_size=block_size,
        window=200,
        sink=16,
    )
    check(harness, case, rng)


# (num_heads, kv_num_heads, head_dim, window, sink, swa_heads): a GQA shape with sinks, and
# Gemma 3 270M's sliding layer (4 q heads on 1 KV head of 256 dims, window 512, no sink), whose
# longest request here (450 + 64 tokens) runs past its window.
MIXED_SHAPES = {"hd128": (8, 4, 128, 48, 20, (0, 2)), "gemma3_270m": (4, 1, 256, 512, 0, (0,))}


@pytest.mark.parametrize("shape", list(MIXED_SHAPES))
@pytest.mark.parametrize(
    "head_wise, scatter, recycle",
    [(True, True, True), (True, False, False), (False, True, False)],
    ids=["head_wise_scattered_recycled", "head_wise_contiguous", "one_d"],
)
def test_mixed_batch_of_prefill_chunks_decodes_and_idle_slots(
    harness, rng, head_wise, scatter, recycle, shape
):
    num_heads, kv_num_heads, head_dim, window, sink, swa_heads = MIXED_SHAPES[shape]
    requests = [(0, 90), (300, 1), (77, 0), (200, 33), (129, 1), (0, 1), (450, 64)]
    case = build_case(
        rng,
        requests,
        num_heads=num_heads,
        kv_num_heads=kv_num_heads,
        head_dim=head_dim,
        block_size=16,
        window=window,
        sink=sink,
        swa_heads=swa_heads,
        head_wise=head_wise,
        scatter=scatter,
        recycle=recycle,
    )
    check(harness, case, rng)


@pytest.mark.parametrize(
    "window, sink",
    [(16, 16), (15, 17), (17, 15), (1, 0), (1, 1), (32, 0), (33, 16), (200, 64)],
)
def test_windows_and_sinks_at_block_edges(harness, rng, window, sink):
    # cached lengths straddle block edges; chunks start and end on and off edges
    requests = [(31, 1), (32, 1), (33, 1), (48, 16), (47, 18), (64, 40), (15, 2), (0, 70)]
    case = build_case(
        rng,
        requests,
        num_heads=4,
        kv_num_heads=2,
        head_dim=64,
        block_size=16,
        window=window,
        sink=sink,
        swa_heads=(1,),
    )
    check(harness, case, rng)


@pytest.mark.parametrize("num_heads, kv_num_heads", [(4, 4), (8, 4), (12, 4), (16, 2)])
def test_gqa_groups_one_to_eight(harness, rng, num_heads, kv_num_heads):
    case = build_case(
        rng,
        [(0, 70), (130, 1), (90, 20)],
        num_heads=num_heads,
        kv_num_heads=kv_num_heads,
        head_dim=64,
        block_size=64,
        window=64,
        sink=64,
        swa_heads=(0,),
    )
    check(harness, case, rng)


# (learned sinks, softcap): gpt-oss's per-head sink logits, Gemma 2's soft-capping, both.
SCORE_MODS = {"sinks": (True, 0.0), "softcap": (False, 0.5), "sinks_and_softcap": (True, 0.5)}


@pytest.mark.parametrize("mods", list(SCORE_MODS))
@pytest.mark.parametrize("requests, head_dim, block_size", [
    ([(0, 90), (1000, 1), (77, 0), (200, 33), (129, 1)], 64, 16),  # prefill tiles, a split-KV decode
    ([(0, 40), (700, 1), (130, 9)], 128, 64),
], ids=["hd64_bs16", "hd128_bs64"])
def test_learned_sinks_and_soft_capping_match_reference(harness, rng, mods, requests, head_dim, block_size):
    """Both attention kernels and the split-KV merge: a sink logit per q head joins the denominator (the
    first far above every score: exp must not overflow into NaN), scores soft-capped before the mask;
    the sliding head's dead pages are -1 (never read). Without the mods the output differs."""
    with_sinks, softcap = SCORE_MODS[mods]
    case = build_case(rng, requests, num_heads=8, kv_num_heads=2, head_dim=head_dim, block_size=block_size,
                      window=48, sink=4, swa_heads=(0,))
    sinks = rng.normal(0.0, 2.0, 8).astype(np.float32)
    sinks[0] = 60.0
    case = dataclasses.replace(case, attention_sinks=sinks if with_sinks else None).with_params(softcap=softcap)
    result = check(harness, case, rng)
    plain, _, _ = reference(dataclasses.replace(case, attention_sinks=None).with_params(softcap=0.0))
    got = from_storage(result.out, BF16).reshape(plain.shape)
    assert np.linalg.norm(got - plain) / np.linalg.norm(plain) > 5e-2, f"seed {rng.seed_value}: mods ignored"


@pytest.mark.parametrize("softcap", [-1.0, float("nan"), float("inf")])
def test_a_negative_or_non_finite_softcap_is_refused(harness, rng, softcap):
    case = build_case(rng, [(0, 20), (40, 1)], num_heads=4, kv_num_heads=2).with_params(softcap=softcap)
    result = harness.run(case)
    assert result.status == 1, result.message  # refused before any launch
    assert "softcap" in harness.lib.append_attention_last_error().decode()


@pytest.mark.parametrize("dual_pass", [0, 1], ids=["masked_single_pass", "dual_pass"])
def test_baseline_arms_on_a_1d_table_match_reference(harness, rng, dual_pass):
    case = build_case(
        rng,
        [(0, 100), (400, 1), (250, 12)],
        num_heads=20,
        kv_num_heads=4,
        head_dim=128,
        block_size=64,
        window=100,
        sink=64,
        head_wise=False,
    ).with_params(visit_all_pages=1, dual_pass=dual_pass)
    check(harness, case, rng)


def test_head_wise_table_without_recycling_is_bit_identical_to_the_1d_table(harness, rng):
    one_d = build_case(
        rng, [(0, 60), (700, 1), (333, 9)], num_heads=20, kv_num_heads=4, head_dim=128,
        block_size=64, window=128, sink=64, head_wise=False,
    )
    kvh = one_d.params["kv_num_heads"]
    blocks = one_d.block_tables[:, None, :]
    pages = np.where(blocks >= 0, blocks * kvh + np.arange(kvh)[None, :, None], -1)
    head_wise = gpu_harness.Case(
        **{**one_d.__dict__, "block_tables": pages.astype(np.int32)}
    ).with_params(head_wise_table=1)
    check(harness, one_d, rng)  # outputs start as NaN: equal bits prove nothing unless they are right
    a = harness.run(one_d)
    b = harness.run(head_wise)
    assert a.status == 0 and b.status == 0, (a.message, b.message)
    np.testing.assert_array_equal(a.out, b.out, err_msg=f"seed {rng.seed_value}")


def _swa_decode_case(rng):
    # request 1 decodes at position 400 with window 64: its live blocks are 0 (sink) and 5, 6
    return build_case(
        rng, [(0, 8), (400, 1)], num_heads=4, kv_num_heads=2, head_dim=64, block_size=64,
        window=64, sink=10, swa_heads=(0,),
    )


def test_a_needed_recycled_entry_is_reported_with_request_head_and_block(harness, rng):
    case = _swa_decode_case(rng)
    case.block_tables[1, 0, 5] = -1  # window block of the SWA head
    result = harness.run(case)
    assert result.status == 2
    assert result.error_info == (gpu_harness.ERR_DEAD_ENTRY, 1, 0, 5)
    assert "request 1, kv head 0, block index 5" in result.message


def test_a_dead_destination_for_a_new_token_is_reported(harness, rng):
    case = _swa_decode_case(rng)
    case.block_tables[1, 1, 6] = -1  # where position 400 of head 1 must be written
    result = harness.run(case)
    assert result.status == 2
    assert result.error_info == (gpu_harness.ERR_DEAD_ENTRY, 1, 1, 6)


def test_the_masked_scan_refuses_a_table_with_recycled_entries(harness, rng):
    case = _swa_decode_case(rng).with_params(visit_all_pages=1)
    assert (case.block_tables[1, 0, 1:5] == -1).all()  # recycled by the case builder
    result = harness.run(case)
    assert result.status == 2
    assert result.error_info[0] == gpu_harness.ERR_DEAD_ENTRY_MASKED
    assert result.error_info[1:3] == (1, 0)


def test_an_entry_beyond_the_cache_is_reported(harness, rng):
    case = _swa_decode_case(rng)
    case.block_tables[1, 1, 2] = case.params["num_blocks"] * case.params["kv_num_heads"]
    result = harness.run(case)
    assert result.status == 2
    assert result.error_info == (gpu_harness.ERR_OUT_OF_RANGE, 1, 1, 2)


@pytest.mark.parametrize("head_wise", [True, False])
def test_a_lane_with_a_head_slot_map_is_bit_identical_to_the_per_head_cache(harness, rng, head_wise):
    """The slot layout's lane [num_blocks, G, bs, d] with KV head h in slot kv_head_slots[h]: the same
    output bits as the per-head cache, the heads' rows written in their slots, the other slots (other
    layers') untouched."""
    case = build_case(rng, [(0, 37), (300, 1), (90, 5)], num_heads=8, kv_num_heads=2, head_dim=64,
                      block_size=16, window=32, sink=4, head_wise=head_wise)
    kvh, lane_slots, head_slots = 2, 5, np.array([3, 1], np.int32)
    kc, vc = case.key_cache, case.value_cache
    shape = (kc.shape[0], lane_slots) + kc.shape[2:]
    poison = np.uint16(0x7FC1)
    lk, lv = np.full(shape, poison, np.uint16), np.full(shape, poison, np.uint16)
    lk[:, head_slots], lv[:, head_slots] = kc, vc
    table = case.block_tables
    if head_wise:  # page p = cache[p // H, p % H] -> lane page (p // H) * G + head_slots[p % H]
        mapped = np.where(table < 0, -1, (table // kvh) * lane_slots + head_slots[table % kvh])
        rows = np.full((table.shape[0], lane_slots, table.shape[2]), -1, np.int32)
        rows[:, head_slots] = mapped
        table = rows
    lane = gpu_harness.Case(**{**case.__dict__, "key_cache": lk, "value_cache": lv,
                               "block_tables": table.astype(np.int32), "kv_head_slots": head_slots}
                            ).with_params(kv_slots=lane_slots)
    a = check(harness, case, rng)
    b = harness.run(lane)
    assert b.status == 0, b.message
    np.testing.assert_array_equal(b.out, a.out, err_msg=f"seed {rng.seed_value}")
    np.testing.assert_array_equal(b.key_cache.reshape(shape)[:, head_slots], a.key_cache.reshape(kc.shape))
    others = [s for s in range(lane_slots) if s not in head_slots]
    assert (b.key_cache.reshape(shape)[:, others] == poison).all() and \
        (b.value_cache.reshape(shape)[:, others] == poison).all()


def test_a_head_slot_outside_the_lane_is_reported(harness, rng):
    case = build_case(rng, [(0, 9)], num_heads=8, kv_num_heads=2, head_dim=64, block_size=16)
    bad = dataclasses.replace(case, kv_head_slots=np.array([0, 2], np.int32))  # the cache has 2 slots
    result = harness.run(bad)
    assert result.status == 2 and result.error_info[0] == gpu_harness.ERR_OUT_OF_RANGE, result


# -- quantized pages (int8 / e4m3fn codes, or int4 codes two per byte, or k8v4's int8 keys beside int4
# values, with a float32 scale per row; bf16 compute) -------------------------------------------------
from gpu_reference import QUANT, expected_quantized_caches, quantize_case  # noqa: E402
from reference_attention import reference_append_attention  # noqa: E402
from reference_kv_quant import pages_from_codes  # noqa: E402

# Attention over the original float values: the format's error (the CPU op's cases measure int8
# 7e-3 to 8e-3, e4m3 3e-2 to 3.5e-2; int4 pages on these random rows 1.5e-1 to 1.8e-1 at head_dim
# 64 to 256, Q = 7 levels a side; k8v4's int4 values beside int8 keys 1.05e-1 to 1.3e-1: the values'
# error alone) plus bf16 rounding of q, k, v and the output.
QUANT_TOLERANCE = {"int8": 2.5e-2, "block_wise_fp8": 7e-2, "block_wise_int4": 0.25, "k8v4": 0.2}


def attention_over_written_pages(case, result, fmt: str) -> np.ndarray:
    """float64 attention of `case` over the pages the kernels wrote (their codes and scales read back by
    the numpy rule): what the output must equal up to the kernels' own arithmetic."""
    p = case.params
    keys = pages_from_codes(result.key_cache, result.key_cache_scales, fmt, keys=True)
    values = pages_from_codes(result.value_cache, result.value_cache_scales, fmt, keys=False)
    out, _, _ = reference_append_attention(
        from_storage(case.qkv, BF16), keys, values, case.seq_lens_decoder, case.seq_lens_this_time,
        case.cu_seqlens_q, case.block_tables, case.rotary_cos, case.rotary_sin, case.head_windows,
        num_heads=p["num_heads"], kv_num_heads=p["kv_num_heads"], head_dim=p["head_dim"], caches_hold_new_rows=True)
    return out


def assert_written_bytes(harness, q, result, fmt, rng):
    """The pages and scales the step leaves equal reference_kv_quant's quantization of the rows it
    writes, every other row untouched (NaN scales stay NaN): bit for bit on the executor. A GPU may
    contract RoPE's multiply-subtract into an FMA (nvcc's default), moving a row by an ulp: there the
    scales agree to 1e-6 and at most one code in a thousand differs."""
    k_codes, k_scales, v_codes, v_scales = expected_quantized_caches(q, fmt)
    got = (result.key_cache.view(np.uint8), result.key_cache_scales, result.value_cache.view(np.uint8),
           result.value_cache_scales)
    for name, g, want in zip(("key codes", "key scales", "value codes", "value scales"), got,
                             (k_codes, k_scales, v_codes, v_scales)):
        g = g.reshape(want.shape)
        if harness.on_cpu:
            np.testing.assert_array_equal(g, want, err_msg=f"seed {rng.seed_value}: {fmt} {name}")
        elif "scales" in name:
            np.testing.assert_allclose(g, want, rtol=1e-6, equal_nan=True, err_msg=f"seed {rng.seed_value}")
        else:
            assert np.mean(g != want) < 1e-3, f"seed {rng.seed_value}: {fmt} {name}"


def run_quantized(harness, case, fmt, rng):
    """Runs the bf16 case on pages of `fmt`; checks the written bytes and returns (result, quantized
    case, error against float64 attention over the dequantized pages, error against the original
    float values)."""
    loose, _, _ = reference(case)
    q = quantize_case(case, fmt)
    result = harness.run(q)
    assert result.status == 0, f"seed {rng.seed_value}: {result.message}"
    assert not result.races, f"seed {rng.seed_value}: {result.races}"
    got = from_storage(result.out, BF16).reshape(loose.shape)
    assert np.isfinite(got).all(), f"seed {rng.seed_value}: NaN/unwritten output"
    assert_written_bytes(harness, q, result, fmt, rng)
    tight = attention_over_written_pages(case, result, fmt).reshape(loose.shape)
    err_tight = float(np.linalg.norm(got - tight) / np.linalg.norm(tight))
    err_loose = float(np.linalg.norm(got - loose) / np.linalg.norm(loose))
    print(f"[{'cpu executor' if harness.on_cpu else 'gpu'} {fmt}] vs dequantized {err_tight:.2e}, "
          f"vs original values {err_loose:.2e}")
    assert err_tight < TOLERANCE[BF16], f"seed {rng.seed_value}: {err_tight:.3g} against the dequantized pages"
    assert err_loose < QUANT_TOLERANCE[fmt], f"seed {rng.seed_value}: {err_loose:.3g} against the float values"
    return result, q, err_tight, err_loose


@pytest.mark.parametrize("fmt", list(QUANT))
@pytest.mark.parametrize("requests, head_dim, block_size", [
    ([(0, 150), (0, 37), (0, 1)], 64, 16),                      # prefill tiles
    ([(1000, 1), (517, 1), (64, 1), (63, 1), (3, 1)], 128, 64),  # split-KV decode
    ([(0, 33), (300, 1), (0, 0), (90, 17)], 64, 64),            # mixed, an idle slot, a chunk over cache
    ([(0, 40), (700, 1), (130, 9)], 256, 16),                   # head_dim 256 (Gemma 3): prefill + decode
])
def test_quantized_pages_match_float64_attention(harness, rng, fmt, requests, head_dim, block_size):
    """Float64 attention over the values the kernels read (the pages they wrote included): bf16
    tolerance; over the original float values: the format's error. The written codes and scales are
    the reference's; rows no query may see have NaN scales, so a stray read fails, and a stray write
    fails the byte comparison. Head-wise tables with the sliding head's dead pages -1."""
    case = build_case(rng, requests, dtype=BF16, num_heads=4 * 2, kv_num_heads=2, head_dim=head_dim,
                      block_size=block_size, window=40, sink=5)
    run_quantized(harness, case, fmt, rng)


@pytest.mark.parametrize("fmt", list(QUANT))
@pytest.mark.parametrize("window, sink", [(48, 20), (5, 3)])
def test_quantized_speculative_verification_rows(harness, rng, fmt, window, sink):
    """Several new tokens per decoding request (k drafts verified as one piece) on quantized pages,
    straddling block and window edges, the sliding head's pages recycled on the accepted count."""
    case = build_case(rng, [(300, 4), (77, 3), (129, 1), (47, 2), (31, 5), (200, 6)], num_heads=8,
                      kv_num_heads=2, head_dim=64, block_size=16, window=window, sink=sink,
                      swa_heads=(0,))
    run_quantized(harness, case, fmt, rng)


@pytest.mark.parametrize("fmt", list(QUANT))
@pytest.mark.parametrize("num_heads, kv_num_heads, swa_heads", [(2, 1, (0,)), (3, 1, ()), (6, 2, (1,))])
def test_quantized_tensor_parallel_head_slices(harness, rng, fmt, num_heads, kv_num_heads, swa_heads):
    """One tensor-parallel rank's head counts (a single KV head sliding or full, odd groups) on
    quantized pages with head-wise tables and recycling."""
    case = build_case(rng, [(0, 37), (150, 1), (90, 3), (64, 16)], num_heads=num_heads,
                      kv_num_heads=kv_num_heads, head_dim=64, block_size=16, window=40, sink=4,
                      swa_heads=swa_heads)
    run_quantized(harness, case, fmt, rng)


@pytest.mark.parametrize("fmt", list(QUANT))
def test_quantized_head_wise_table_without_recycling_is_bit_identical_to_the_1d_table(harness, rng, fmt):
    """A page's codes do not depend on which table found it: 1-D and head-wise tables naming the same
    pages write the same bytes and give the same output bits."""
    one_d = build_case(rng, [(0, 60), (700, 1), (333, 9)], num_heads=8, kv_num_heads=2, head_dim=128,
                       block_size=64, window=128, sink=64, head_wise=False)
    kvh = one_d.params["kv_num_heads"]
    blocks = one_d.block_tables[:, None, :]
    pages = np.where(blocks >= 0, blocks * kvh + np.arange(kvh)[None, :, None], -1).astype(np.int32)
    head_wise = dataclasses.replace(one_d, block_tables=pages).with_params(head_wise_table=1)
    a, _, _, _ = run_quantized(harness, one_d, fmt, rng)
    b = harness.run(quantize_case(head_wise, fmt))
    assert b.status == 0 and not b.races, (b.message, b.races)
    for x, y in ((a.out, b.out), (a.key_cache, b.key_cache), (a.value_cache, b.value_cache),
                 (a.key_cache_scales, b.key_cache_scales), (a.value_cache_scales, b.value_cache_scales)):
        np.testing.assert_array_equal(x, y, err_msg=f"seed {rng.seed_value}")


@pytest.mark.parametrize("fmt", list(QUANT))
def test_quantized_lane_whose_slots_mix_sliding_and_full_heads(harness, rng, fmt):
    """The lane of 3 slots (2 sliding with dead pages -1, 1 full) on quantized pages: a sliding layer
    and a full layer take turns on one cache; together they write the reference's bytes and equal
    attention over the three heads' dequantized pages."""
    case = build_case(rng, [(0, 33), (300, 1), (129, 3), (90, 17)], num_heads=6, kv_num_heads=3, head_dim=64,
                      block_size=16, window=32, sink=4, swa_heads=(0, 2))
    assert (case.block_tables[1, [0, 2], :19] == -1).any(axis=1).all()
    q = quantize_case(case, fmt)
    sliding, sliding_cols = _layer_of_lane(q, (0, 2), (0, 2))
    full, full_cols = _layer_of_lane(q, (1,), (1,))
    a = harness.run(sliding)
    assert a.status == 0 and not a.races, (a.message, a.races)
    b = harness.run(dataclasses.replace(full, key_cache=a.key_cache, value_cache=a.value_cache,
                                        key_cache_scales=a.key_cache_scales,
                                        value_cache_scales=a.value_cache_scales))
    assert b.status == 0 and not b.races, (b.message, b.races)
    assert_written_bytes(harness, q, b, fmt, rng)
    got = np.empty_like(from_storage(case.out, BF16))
    got[:, sliding_cols] = from_storage(a.out, BF16)
    got[:, full_cols] = from_storage(b.out, BF16)
    tight = attention_over_written_pages(case, b, fmt)
    err = float(np.linalg.norm(got.reshape(tight.shape) - tight) / np.linalg.norm(tight))
    assert err < TOLERANCE[BF16], f"seed {rng.seed_value}: relative error {err:.3g}"


# -- what the kernels serve beyond plain prefill / decode --------------------------------------------
@pytest.mark.parametrize("window, sink", [(48, 20), (16, 0), (5, 3)])
def test_speculative_verification_rows_match_reference(harness, rng, window, sink):
    """Decode rows with several tokens per request (a target model verifying k drafts as one piece):
    the drafts straddle block edges and the sliding window's edge, and the SWA head's pages recycled
    on the accepted (processed) count, which is what the scheduler may free under speculation."""
    case = build_case(rng, [(300, 4), (77, 3), (129, 1), (47, 2), (31, 5), (200, 6)], num_heads=8,
                      kv_num_heads=2, head_dim=64, block_size=16, window=window, sink=sink,
                      swa_heads=(0,))
    check(harness, case, rng)


@pytest.mark.parametrize("num_heads, kv_num_heads, swa_heads", [
    (2, 1, (0,)),     # 6 q / 3 KV heads over 3 ranks: a rank's one sliding head
    (2, 1, ()),       # ... a rank whose one head is full
    (3, 1, (0,)),     # 9 / 3 over 3 ranks: group size 3
    (6, 2, (1,)),     # 18 / 6 over 3 ranks: 2 KV heads, group 3, one sliding
    (4, 2, (0, 1)),   # 12 / 6 over 3 ranks: both of the rank's heads sliding
])
def test_tensor_parallel_head_slices_match_reference(harness, rng, num_heads, kv_num_heads, swa_heads):
    """The head counts one tensor-parallel rank sees (odd groups, a single KV head, all-sliding or
    all-full ranks), head-wise tables with recycling."""
    case = build_case(rng, [(0, 37), (150, 1), (90, 3), (64, 16)], num_heads=num_heads,
                      kv_num_heads=kv_num_heads, head_dim=64, block_size=16, window=40, sink=4,
                      swa_heads=swa_heads)
    check(harness, case, rng)


def _layer_of_lane(case, heads, slots):
    """The case's KV heads `heads` as one layer of the lane: its q/k/v columns, its heads' slots."""
    p = case.params
    d, kvh, group = p["head_dim"], p["kv_num_heads"], p["num_heads"] // p["kv_num_heads"]
    q_cols = [np.arange((h * group + g) * d, (h * group + g + 1) * d) for h in heads for g in range(group)]
    k_cols = [(p["num_heads"] + h) * d + np.arange(d) for h in heads]
    v_cols = [(p["num_heads"] + kvh + h) * d + np.arange(d) for h in heads]
    cols = np.concatenate(q_cols + k_cols + v_cols)
    out_cols = np.concatenate(q_cols)
    layer = dataclasses.replace(
        case, qkv=np.ascontiguousarray(case.qkv[:, cols]), head_windows=case.head_windows[:, list(heads)].copy(),
        kv_head_slots=np.array(slots, np.int32), out=np.ascontiguousarray(case.out[:, out_cols]),
    ).with_params(num_heads=len(heads) * group, kv_num_heads=len(heads), kv_slots=kvh)
    return layer, out_cols


def test_a_lane_whose_slots_mix_sliding_and_full_heads(harness, rng):
    """A lane of 3 slots (2 sliding, 1 full, as Gemma 3's layers share one): two layers take turns on
    the same cache and table, one with the sliding slots (their dead pages -1 in the table), one with
    the full slot. Each writes only its slots' rows and reads only its own; together they equal
    attention over all three heads."""
    case = build_case(rng, [(0, 33), (300, 1), (129, 3), (90, 17)], num_heads=6, kv_num_heads=3, head_dim=64,
                      block_size=16, window=32, sink=4, swa_heads=(0, 2))
    # request 1 (301 tokens, 19 blocks): the sliding slots' rows have recycled entries, the full slot's none
    assert (case.block_tables[1, [0, 2], :19] == -1).any(axis=1).all() and (case.block_tables[1, 1, :19] >= 0).all()
    ref_out, ref_k, ref_v = reference(case)
    sliding, sliding_cols = _layer_of_lane(case, (0, 2), (0, 2))
    full, full_cols = _layer_of_lane(case, (1,), (1,))
    a = harness.run(sliding)
    assert a.status == 0 and not a.races, (a.message, a.races)
    b = harness.run(dataclasses.replace(full, key_cache=a.key_cache, value_cache=a.value_cache))
    assert b.status == 0 and not b.races, (b.message, b.races)
    got = np.empty_like(from_storage(case.out, BF16))
    got[:, sliding_cols] = from_storage(a.out, BF16)
    got[:, full_cols] = from_storage(b.out, BF16)
    err = float(np.linalg.norm(got.reshape(ref_out.shape) - ref_out) / np.linalg.norm(ref_out))
    assert err < TOLERANCE[BF16], f"seed {rng.seed_value}: relative error {err:.3g}"
    for got_cache, ref_cache in ((b.key_cache, ref_k), (b.value_cache, ref_v)):
        np.testing.assert_allclose(from_storage(got_cache, BF16).reshape(ref_cache.shape), ref_cache,
                                   rtol=CACHE_RTOL[BF16], atol=CACHE_RTOL[BF16], equal_nan=True,
                                   err_msg=f"seed {rng.seed_value}")


# -- per-head windows: head_windows [2, kv_num_heads], each KV head its own (window, sink) ----------
PER_HEAD_STEPS = {
    "prefill": ([(0, 150), (0, 37)], 16),
    "split_kv_decode": ([(1000, 1), (517, 1), (64, 1), (3, 1)], 64),
    "mixed_chunks_and_idle_slot": ([(0, 33), (300, 1), (0, 0), (90, 17), (129, 3)], 16),
}


@pytest.mark.parametrize("table", ["head_wise_recycled", "one_d"])
@pytest.mark.parametrize("step", list(PER_HEAD_STEPS))
def test_each_kv_head_slides_with_its_own_window_and_sink(harness, rng, step, table):
    """Decode and prefill kernels mask and skip pages per KV head with its own (W, S): head-wise
    tables hold -1 at each head's own dead blocks and NaN behind them, so a page read past a head's
    own window fails."""
    requests, block_size = PER_HEAD_STEPS[step]
    case = build_case(rng, requests, num_heads=8, kv_num_heads=4, head_dim=64, block_size=block_size,
                      head_windows=MIXED_HEAD_WINDOWS, head_wise=table != "one_d", recycle=table != "one_d")
    if table != "one_d" and step != "prefill":
        assert (case.block_tables[:, 2] == -1).any() and (case.block_tables[:, 0] == -1).any()
    check(harness, case, rng)


def test_the_kv_heads_flag_form_is_refused_with_the_expected_shape(harness, rng):
    """head_windows has one form, [2, kv_num_heads]: the old [kv_num_heads] 0/1 flags are refused by the
    CUDA op wrapper's checks (custom_ops/cpu_ops/append_attention_checks.h, its rules run on CPU
    tensors), naming the shape it expects, and by the harness before the C side reads 2 * kv ints."""
    import paddle

    from fastdeploy.model_executor.layers.attention.ops import validate_append_attention_inputs

    case = build_case(rng, [(0, 33), (300, 1)], num_heads=8, kv_num_heads=4, head_dim=64, block_size=16,
                      swa_heads=(0, 2))
    flags = np.array([1, 0, 1, 0], np.int32)
    with pytest.raises(ValueError, match=r"head_windows must be \[2, kv_num_heads=4\]"):
        harness.run(dataclasses.replace(case, head_windows=flags))
    p = case.params
    bf16 = lambda bits: paddle.to_tensor(from_storage(bits, BF16)).astype("bfloat16")  # noqa: E731
    tensors = [bf16(case.qkv), bf16(case.key_cache), bf16(case.value_cache)] + [
        paddle.to_tensor(np.ascontiguousarray(getattr(case, n))) for n in (
            "seq_lens_encoder", "seq_lens_decoder", "seq_lens_this_time", "cu_seqlens_q", "block_tables",
            "rotary_cos", "rotary_sin")]
    attrs = dict(num_heads=p["num_heads"], kv_num_heads=p["kv_num_heads"], head_dim=p["head_dim"])
    validate_append_attention_inputs(*tensors, paddle.to_tensor(case.head_windows), rules="gpu", check_place=False,
                                     **attrs)
    with pytest.raises(ValueError, match=r"append_attention_gpu: head_windows must be \[2, kv_num_heads=4\] "
                                         r".*got \[4\] \(the \[kv_num_heads\] form of 0 / 1 flags is no longer"):
        validate_append_attention_inputs(*tensors, paddle.to_tensor(flags), rules="gpu", check_place=False, **attrs)


# dual_pass's SWA pass has one window: its sliding heads share one (window, sink), beside full heads.
SHARED_HEAD_WINDOWS = ((40, 5), (0, 0), (40, 5), (40, 5))


@pytest.mark.parametrize("dual_pass, head_windows", [(0, MIXED_HEAD_WINDOWS), (1, SHARED_HEAD_WINDOWS)],
                         ids=["masked_single_pass", "dual_pass"])
def test_baseline_arms_mask_each_head_with_its_own_window(harness, rng, dual_pass, head_windows):
    case = build_case(rng, [(0, 70), (400, 1), (250, 12)], num_heads=8, kv_num_heads=4, head_dim=64,
                      block_size=16, head_windows=head_windows, head_wise=False,
                      ).with_params(visit_all_pages=1, dual_pass=dual_pass)
    check(harness, case, rng)


def test_dual_pass_refuses_sliding_heads_with_different_windows(harness, rng):
    """Upstream's all-SWA pass slides every head with one window, derived from head_windows: two sliding
    heads with different (window, sink) pairs are a device-side error naming them (code 6)."""
    case = build_case(rng, [(0, 70), (400, 1)], num_heads=8, kv_num_heads=4, head_dim=64, block_size=16,
                      head_windows=MIXED_HEAD_WINDOWS, head_wise=False).with_params(visit_all_pages=1, dual_pass=1)
    result = harness.run(case)
    assert result.status == 2, result.message
    assert result.error_info[:3] == (gpu_harness.ERR_DUAL_PASS_WINDOWS, 0, 2)
    assert "kv heads 0 and 2 of head_windows slide with different (window, sink) pairs" in result.message
    # The same heads without dual_pass: each its own window.
    assert harness.run(case.with_params(dual_pass=0)).status == 0


@pytest.mark.parametrize("fmt", ["int8", "block_wise_int4", "k8v4"])
def test_quantized_pages_with_per_head_windows_match_float64_attention(harness, rng, fmt):
    case = build_case(rng, [(0, 40), (300, 1), (90, 17), (129, 3)], num_heads=8, kv_num_heads=4, head_dim=64,
                      block_size=16, head_windows=MIXED_HEAD_WINDOWS)
    run_quantized(harness, case, fmt, rng)


@pytest.mark.parametrize("row, value", [(0, -3), (1, -1)], ids=["window", "sink"])
def test_a_negative_per_head_window_or_sink_is_reported(harness, rng, row, value):
    case = build_case(rng, [(0, 8), (100, 1)], num_heads=8, kv_num_heads=4, head_dim=64, block_size=16,
                      head_windows=MIXED_HEAD_WINDOWS, recycle=False)
    case.head_windows[row, 2] = value
    result = harness.run(case)
    assert result.status == 2
    assert result.error_info == (gpu_harness.ERR_HEAD_WINDOW, row, 2, value)
    assert f"kv head 2) is {value}" in result.message


# -- the executor's own promises: races are found, planted bugs fail the checks ----------------------
# These run on the executor even where a GPU is visible (it needs only the toolkit's headers).
import kernel_mutants  # noqa: E402

needs_headers = pytest.mark.skipif(gpu_harness.find_cuda_include() is None,
                                   reason="the CUDA toolkit's headers are needed")


@pytest.fixture(scope="module")
def executor():
    return gpu_harness.Harness(gpu_harness.cached_build(on_cpu=True))


@needs_headers
def test_the_reference_checks_pass_under_shuffled_thread_orders(executor, rng):
    case = kernel_mutants.mixed_case(rng)
    ref_out, _, _ = reference(case)
    result = executor.run(case, orders="shuffle:1,shuffle:2,reverse")
    assert result.status == 0 and not result.races, (result.message, result.races)
    assert relative_error(result.out, ref_out, BF16) < TOLERANCE[BF16]


@needs_headers
def test_a_removed_barrier_is_reported_as_a_race_naming_the_kernel(tmp_path):
    """The real decode kernel with the barrier after thread 0 looks up the page removed: threads that
    run before thread 0 read a stale page base, so the two orders disagree and the launch is named."""
    library = kernel_mutants.build_mutant(tmp_path, kernel_mutants.MUTANTS["missing_barrier_after_page_lookup"])
    report = kernel_mutants.run_case_in_child(library, "mixed", seed=3)
    assert "crashed" not in report, report
    assert "race in decode_attention_kernel<T, PK, PV, D, BS>" in report["races"], report
    assert "decode_attention.cu" in report["races"]
    forward_only = kernel_mutants.run_case_in_child(library, "mixed", seed=3, orders="forward")
    assert forward_only["races"] == ""  # one order cannot see it: the comparison is what finds it


@needs_headers
def test_an_off_by_one_at_the_window_edge_fails_the_reference_check(tmp_path):
    mutant = kernel_mutants.MUTANTS["decode_window_edge_off_by_one"]
    report = kernel_mutants.run_case_in_child(kernel_mutants.build_mutant(tmp_path, mutant), mutant.case, seed=3)
    assert kernel_mutants.caught(report, mutant.case), report
    unmutated = kernel_mutants.run_case_in_child(gpu_harness.cached_build(on_cpu=True), mutant.case, seed=3)
    assert not kernel_mutants.caught(unmutated, mutant.case), unmutated  # the case itself passes


@needs_headers
def test_k8v4_values_read_with_the_key_codec_fail_the_reference_check(tmp_path):
    """k8v4's lanes differ: the decode kernel reading its int4 value bytes through the int8 key codec (a
    change no uniform format can see, its two codecs being one) is caught by the k8v4 case."""
    mutant = kernel_mutants.MUTANTS["k8v4_values_read_with_the_key_codec"]
    library = kernel_mutants.build_mutant(tmp_path, mutant)
    report = kernel_mutants.run_case_in_child(library, mutant.case, seed=3)
    assert kernel_mutants.caught(report, mutant.case), report
    unmutated = kernel_mutants.run_case_in_child(gpu_harness.cached_build(on_cpu=True), mutant.case, seed=3)
    assert not kernel_mutants.caught(unmutated, mutant.case), unmutated
    int4 = kernel_mutants.run_case_in_child(library, "int4", seed=3)
    assert not kernel_mutants.caught(int4, "int4"), int4  # block_wise_int4 pages: the same codec either way


@needs_headers
@pytest.mark.parametrize("source, name", [
    ("__constant__ float table[4];", "__constant__"),
    ("__global__ void k(int* x) { atomicAdd(x, 1); }", "atomicAdd"),
    ("__global__ void k(float* x) { x[0] = __shfl_down_sync(0xffffffffu, x[0], 1); }", "__shfl_down_sync"),
    ("__global__ void k(const float* x, float* y) { y[0] = __ldg(x); }", "__ldg"),
    ("__global__ void k(float* x) { x[0] = __syncthreads_count(1); }", "__syncthreads_count"),
    ("void f(float** p) { cudaMallocManaged(reinterpret_cast<void**>(p), 4); }", "cudaMallocManaged"),
])
def test_an_unimplemented_cuda_construct_fails_the_executor_build_with_its_name(tmp_path, source, name):
    (tmp_path / "snippet.cu").write_text(source + "\n")
    with pytest.raises(gpu_harness.BuildError) as failure:
        gpu_harness.build_on_cpu(tmp_path / "build", source_dir=tmp_path,
                                 reuse_from=gpu_harness.cached_build(on_cpu=True).parent)
    assert name in str(failure.value)
