"""Greedy tokens with prefix caching on are identical to tokens with it off (real engine, tiny preset).

The tiny preset has 4 KV heads; head 0 is SWA with window 128 and sink 16. Block size 16, so a hit
deeper than 8 blocks makes the SWA head skip (-1) the blocks already out of its window.
"""

import pytest

from fastdeploy import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
MODES = {"1d": ("0", "1"), "head_wise_recycle_off": ("1", "0"), "head_wise_recycle_on": ("1", "1")}


def text(n, seed):
    return [3 + (i * 37 + seed * 11 + (i * i) % 23) % 250 for i in range(n)]


SYSTEM = text(300, 1)   # a system prompt longer than the SWA window
CHAT = text(150, 2)     # first turn of a conversation


def conversation(llm):
    """Three rounds: warm the cache, share the system prompt, continue the chat, then repeat a prompt."""
    first = llm.generate([SYSTEM + text(20, 3), CHAT], GREEDY, use_tqdm=False)
    turn2 = CHAT + first[1].outputs.token_ids + text(25, 4)
    second = llm.generate([SYSTEM + text(37, 5), SYSTEM + text(9, 6), turn2], GREEDY, use_tqdm=False)
    turn3 = turn2 + second[2].outputs.token_ids + text(30, 7)
    third = llm.generate([turn3, SYSTEM + text(20, 3)], GREEDY, use_tqdm=False)
    return [o.outputs.token_ids for o in first + second + third]


def engine(monkeypatch, mode, caching, reserve="1", **kwargs):
    head_wise, recycle = MODES[mode]
    monkeypatch.setenv("FD_ATTENTION_BACKEND", "APPEND_ATTN")
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", head_wise)
    monkeypatch.setenv("FD_HEAD_WISE_SWA_RECYCLE", recycle)
    monkeypatch.setenv("FD_RESERVE_OUTPUT_PAGES", reserve)
    kwargs.setdefault("num_gpu_blocks_override", 256)
    return LLM(block_size=16, max_model_len=1024, max_num_seqs=8, enable_prefix_caching=caching, **kwargs)


@pytest.mark.parametrize("mode", MODES)
def test_shared_system_prompts_and_multi_turn_chat_give_the_same_tokens(monkeypatch, mode):
    off = conversation(engine(monkeypatch, mode, False))
    llm = engine(monkeypatch, mode, True)
    assert conversation(llm) == off
    stats = llm.engine.get_stats()
    # Round 2 hits 18 blocks of the system prompt twice and the first turn; round 3 the second turn
    # and a repeated prompt: every hit here reaches far past the 128-token window.
    assert stats["prefix_cache_hit_tokens_total"] >= 2 * 288 + 144 + 288
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_chunked_prefill_and_preemption_with_hits_give_the_same_tokens(monkeypatch):
    # Few pages and on-demand admission: requests are preempted and resume from cached blocks.
    kwargs = dict(reserve="0", num_gpu_blocks_override=28, max_num_batched_tokens=64)
    off = conversation(engine(monkeypatch, "head_wise_recycle_on", False, **kwargs))
    llm = engine(monkeypatch, "head_wise_recycle_on", True, **kwargs)
    assert conversation(llm) == off
    stats = llm.engine.get_stats()
    assert stats["num_preemptions_total"] > 0 and stats["prefix_cache_hit_tokens_total"] > 0
    assert stats["prefix_cache_evictions_total"] > 0
