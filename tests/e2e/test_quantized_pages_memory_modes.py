"""Quantized KV pages change the numbers once (where K/V are written), and the memory model must not
change them again: with int8 or block_wise_fp8 pages every memory mode gives the bits of the
quantized 1-D run (greedy tokens and their logprobs), through head-wise tables with recycling off
and on, chunked prefill, preemption and recompute, prefix-cache hits, and the slots + lanes of a
model with sliding layers. The dense NATIVE_ATTN oracle keeps float K/V, so the quantized 1-D run is
the reference here; that it really is quantized shows in its logprobs, which differ from float
pages'."""

import pytest

import test_memory_modes as tiny
import test_prefix_caching_e2e as chat
import test_sliding_layers as sliding

FORMATS = ["int8", "block_wise_fp8"]
LOGPROBS = 2


@pytest.fixture(scope="module", params=FORMATS)
def quantized_1d(request):
    mp = pytest.MonkeyPatch()
    try:
        outputs, _ = tiny.generate(mp, "APPEND_ATTN", "0", "1", num_gpu_blocks_override=512, logprobs=LOGPROBS,
                                   kv_cache_quant_type=request.param)
    finally:
        mp.undo()
    return request.param, outputs


# name -> (memory mode, engine args): the tight budget (60 blocks, on-demand admission) preempts.
ARMS = {
    "head_wise_recycle_off": ("head_wise_recycle_off", {}),
    "head_wise_recycle_on": ("head_wise_recycle_on", {}),
    "1d_chunked_prefill_preemption": ("1d", dict(reserve="0", num_gpu_blocks_override=60, max_num_batched_tokens=64)),
    "head_wise_recycle_on_chunked_prefill_preemption": (
        "head_wise_recycle_on", dict(reserve="0", num_gpu_blocks_override=60, max_num_batched_tokens=64)),
}


@pytest.mark.parametrize("arm", ARMS)
def test_quantized_pages_give_the_same_bits_in_every_memory_mode(monkeypatch, quantized_1d, arm):
    fmt, reference = quantized_1d
    mode, args = ARMS[arm]
    args = {"num_gpu_blocks_override": 512, **args}
    outputs, engine = tiny.generate(monkeypatch, "APPEND_ATTN", *tiny.MODES[mode], logprobs=LOGPROBS,
                                    kv_cache_quant_type=fmt, **args)
    assert outputs == reference
    stats = engine.get_stats()
    if args.get("reserve") == "0":
        assert stats["num_preemptions_total"] > 0
    if mode == "head_wise_recycle_on":
        assert stats["swa_pages_recycled_total"] > 0
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_the_quantized_reference_is_not_the_float_run(monkeypatch, quantized_1d):
    fmt, reference = quantized_1d
    float_pages, _ = tiny.generate(monkeypatch, "APPEND_ATTN", "0", "1", num_gpu_blocks_override=512,
                                   logprobs=LOGPROBS)
    assert [lp for _, lp in float_pages] != [lp for _, lp in reference]


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefix_cache_hits_reuse_quantized_pages_with_their_scales(monkeypatch, fmt):
    """A hit reads the cached pages' codes and scales as written: the tokens of caching off."""
    off = chat.conversation(chat.engine(monkeypatch, "head_wise_recycle_on", False, kv_cache_quant_type=fmt))
    llm = chat.engine(monkeypatch, "head_wise_recycle_on", True, kv_cache_quant_type=fmt)
    assert chat.conversation(llm) == off
    assert llm.engine.get_stats()["prefix_cache_hit_tokens_total"] >= 2 * 288 + 144 + 288


@pytest.mark.parametrize("fmt", FORMATS)
def test_slots_of_sliding_layers_give_the_bits_of_1d_pages(monkeypatch, fmt):
    """tiny-sliding-layers (five sliding layers to one global, Gemma 3's pattern): one lane of 12 slots,
    recycling on, chunked prefill and preemption, against 1-D quantized pages."""
    reference, _ = sliding.generate(monkeypatch, "APPEND_ATTN", "0", "1", num_gpu_blocks_override=256,
                                    logprobs=LOGPROBS, kv_cache_quant_type=fmt)
    outputs, engine = sliding.generate(monkeypatch, "APPEND_ATTN", "1", "1", reserve="0", logprobs=LOGPROBS,
                                       num_gpu_blocks_override=sliding.TIGHT_BLOCKS["slots_recycle_on"],
                                       max_num_batched_tokens=40, kv_cache_quant_type=fmt)
    assert outputs == reference
    stats = engine.get_stats()
    assert stats["num_preemptions_total"] > 0 and stats["swa_pages_recycled_total"] > 0
