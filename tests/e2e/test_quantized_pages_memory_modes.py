"""Quantized KV pages change the numbers once (where K/V are written), and the memory model must not
change them again: with int8, block_wise_fp8, block_wise_int4 or k8v4 (int8 keys, int4 values) pages every
memory mode gives the bits of the quantized 1-D run (greedy tokens and their logprobs), through head-wise tables with recycling off
and on, chunked prefill, preemption and recompute, prefix-cache hits, and the slots + lanes of a
model with sliding layers. The dense NATIVE_ATTN oracle keeps float K/V, so the quantized 1-D run is
the reference here; that it really is quantized shows in its logprobs, which differ from float
pages'."""

import paddle
import pytest

import test_memory_modes as tiny
from fastdeploy import LLM, SamplingParams
import test_prefix_caching_e2e as chat
import test_sliding_layers as sliding

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

FORMATS = ["int8", "block_wise_fp8", "block_wise_int4", "k8v4"]
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


def poison_pages_when_freed(monkeypatch, llm) -> list:
    """Every page the cache manager frees gets, in every lane, NaN scales (and, int4 lanes — k8v4's values
    among them —, the codes 0x88 = nibbles -8, which no write of the page rule produces): a later read of any row of it that the new
    owner has not rewritten (a stale scale, stale codes) turns that step's logits into NaN. Returns
    the list of poisoned pages as it grows."""
    backend = llm.engine.runner.attn_backend
    manager = llm.engine.scheduler.cache_manager
    slots = int(backend.lane_keys[0].shape[1])
    release, poisoned = manager._release, []

    def poisoning_release(rank, pages, owner):
        release(rank, pages, owner)
        for page in pages:
            block, slot = divmod(int(page), slots)
            for codes in backend.lane_keys + backend.lane_values:
                if codes.dtype == paddle.uint8:  # int4 lanes; the 8-bit lanes have no unused code
                    codes[block, slot] = 0x88
            for scales in backend.lane_key_scales + backend.lane_value_scales:
                scales[block, slot] = float("nan")
            poisoned.append(page)

    monkeypatch.setattr(manager, "_release", poisoning_release)
    return poisoned


def test_recycled_pages_never_show_a_stale_scale_to_their_next_request(monkeypatch, quantized_1d):
    """Pages freed by sliding heads (recycling) and by finished or preempted requests, poisoned as they
    are freed, then taken by other requests under a tight budget: every row is rewritten, codes and
    scale, before any read, so the tokens and logprobs are the 1-D run's."""
    fmt, reference = quantized_1d
    for name, value in zip(("FD_ATTENTION_BACKEND", "FD_HEAD_WISE_KV_CACHE", "FD_HEAD_WISE_SWA_RECYCLE",
                            "FD_RESERVE_OUTPUT_PAGES"), ("APPEND_ATTN", "1", "1", "0")):
        monkeypatch.setenv(name, value)
    llm = LLM(block_size=16, max_model_len=1024, max_num_seqs=8, num_gpu_blocks_override=60, max_num_batched_tokens=64,
              enable_prefix_caching=False, kv_cache_quant_type=fmt)
    poisoned = poison_pages_when_freed(monkeypatch, llm)
    outs = llm.generate(tiny.prompts(), SamplingParams(temperature=0, max_tokens=tiny.MAX_TOKENS, ignore_eos=True,
                                                       logprobs=LOGPROBS), use_tqdm=False)
    assert [(o.outputs.token_ids, o.outputs.logprobs) for o in outs] == reference
    stats = llm.engine.get_stats()
    assert stats["swa_pages_recycled_total"] > 0 and stats["num_preemptions_total"] > 0
    assert len(poisoned) > len(set(poisoned))  # pages freed, taken again and freed again
