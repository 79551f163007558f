"""The prefix cache's host tier (--swap-space): a hit on pages the pool evicted gives the greedy tokens of a
recompute (real engine, tiny preset: 4 KV heads, head 0 sliding with window 128 and sink 16, block size 16).

The pool is too small to keep the system prompts of the first round, so the second round finds them in
the host tier only; its tokens must equal those of an engine that recomputes every prompt.
"""

import os

import pytest

from fastdeploy import LLM, SamplingParams

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MODES = {"1d": ("0", "1"), "head_wise_recycle_off": ("1", "0"), "head_wise_recycle_on": ("1", "1")}


def text(n, seed):
    return [3 + (i * 37 + seed * 11 + (i * i + seed) % 23) % 250 for i in range(n)]


SYSTEMS = [text(300, 10 + k) for k in range(4)]  # each longer than the sliding window


def rounds(llm):
    """Round 1 caches four system prompts, two conversations each (the second makes the prompt's end a
    branch point, where the prefix cache keeps the sliding window); rounds 2 and 3 come back to them one
    conversation at a time. The pool holds fewer than four, so each comes back after the others evicted it."""
    outs = []
    for r in range(3):
        for k, system in enumerate(SYSTEMS):
            for q in range(2 if r == 0 else 1):
                prompt = system + text(20, 100 * r + 10 * q + k)
                outs.append(llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs.token_ids)
    return outs


def engine(monkeypatch, mode, swap_space=None, caching=True, quant=None, **flags):
    head_wise, recycle = MODES[mode]
    monkeypatch.setenv("FD_ATTENTION_BACKEND", "APPEND_ATTN")
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", head_wise)
    monkeypatch.setenv("FD_HEAD_WISE_SWA_RECYCLE", recycle)
    return LLM(block_size=16, max_model_len=1024, max_num_seqs=4, enable_prefix_caching=caching,
               num_gpu_blocks_override=48, swap_space=swap_space, kv_cache_quant_type=quant, **flags)


@pytest.mark.parametrize("quant", [None, "int8"])
@pytest.mark.parametrize("mode", MODES)
def test_hits_on_pages_the_pool_evicted_give_the_tokens_of_a_recompute(monkeypatch, mode, quant):
    recompute = rounds(engine(monkeypatch, mode, caching=False, quant=quant))
    monkeypatch.setenv("FD_TIER_LOAD_INLINE_MS", "0")  # every load runs on the loader's thread
    llm = engine(monkeypatch, mode, swap_space=0.02, quant=quant)
    assert rounds(llm) == recompute
    stats = llm.engine.get_stats()
    # Rounds 2 and 3 find each system prompt (18 full blocks) whole, in the host tier: the prompts of the
    # other three evicted it from the pool. (Round 1's second conversations hit in the pool, in 1-D mode
    # whole; with recycling, a prompt's window in front of the branch point is kept once it is one.)
    assert stats["prefix_cache_host_hit_tokens_total"] >= 8 * 288
    assert stats["prefix_cache_hit_tokens_total"] >= 8 * 288 + 2 * 128
    assert stats["host_cache_loaded_pages_total"] > 0
    # Those pages were loaded off the step: their requests waited in the loading state, and no load failed.
    assert stats["host_cache_loads_total"] > 0 and stats["host_cache_load_failures_total"] == 0
    assert stats["host_cache_load_wait_seconds_total"] > 0 and stats["host_cache_loading_requests"] == 0
    llm.engine.scheduler.check_integrity()


def test_short_copies_run_in_the_engine_loop_and_give_the_tokens_of_a_recompute(monkeypatch):
    """FD_TIER_LOAD_INLINE_MS: copies from host memory estimated under it run at admission, in the engine loop;
    no request waits in the loading state, and the tokens are a recompute's."""
    recompute = rounds(engine(monkeypatch, "head_wise_recycle_on", caching=False))
    monkeypatch.setenv("FD_TIER_LOAD_INLINE_MS", "10000")
    llm = engine(monkeypatch, "head_wise_recycle_on", swap_space=0.02)
    assert rounds(llm) == recompute
    stats = llm.engine.get_stats()
    assert stats["prefix_cache_host_hit_tokens_total"] >= 8 * 288 and stats["host_cache_loads_total"] > 0
    assert stats["host_cache_load_wait_seconds_total"] == 0 and not llm.engine.scheduler.tier_loads_pending
    llm.engine.scheduler.check_integrity()


def test_without_the_tier_the_same_workload_recomputes_what_the_pool_evicted(monkeypatch):
    """The workload above really overflows the pool: without the tier the hits are far fewer."""
    llm = engine(monkeypatch, "head_wise_recycle_on")
    rounds(llm)
    assert llm.engine.get_stats()["prefix_cache_hit_tokens_total"] < 4 * 288


def next_turns(llm):
    """One new conversation per system prompt of `rounds`' first round."""
    return [llm.generate([system + text(20, 900 + k)], GREEDY, use_tqdm=False)[0].outputs.token_ids
            for k, system in enumerate(SYSTEMS)]


@pytest.mark.parametrize("mode,quant", [("1d", None), ("head_wise_recycle_off", None), ("head_wise_recycle_on", None),
                                        ("head_wise_recycle_on", "int8")])
def test_after_a_restart_the_first_turns_hit_on_the_disk_tier_and_give_the_tokens_of_a_recompute(
        monkeypatch, tmp_path, mode, quant):
    recompute = engine(monkeypatch, mode, caching=False, quant=quant)
    want = next_turns(recompute)
    recompute.engine.close()
    disk = {"kvcache_storage_backend": "file", "kvcache_storage_path": str(tmp_path)}
    first = engine(monkeypatch, mode, swap_space=0.0005, quant=quant, **disk)  # a host tier of a few blocks
    rounds(first)
    assert first.engine.get_stats()["disk_cache_stored_pages_total"] > 0  # the host tier overflowed to disk
    first.engine.close()  # a clean shutdown writes the rest

    second = engine(monkeypatch, mode, swap_space=0.0005, quant=quant, **disk)
    stats = second.engine.get_stats()
    assert stats["disk_cache_restored_pages"] > 0 and stats["prefix_cache_cached_pages"] == 0
    assert next_turns(second) == want
    stats = second.engine.get_stats()
    # Every system prompt (18 full blocks) is found whole, from disk: the new process computed none of it.
    assert stats["prefix_cache_hit_tokens_total"] == stats["prefix_cache_host_hit_tokens_total"] == 4 * 288
    assert stats["disk_cache_loaded_pages_total"] > 0
    second.engine.scheduler.check_integrity()


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_on"])
def test_a_load_that_finds_corrupt_files_falls_back_to_recomputing_and_gives_the_tokens_of_a_recompute(
        monkeypatch, tmp_path, mode):
    recompute = engine(monkeypatch, mode, caching=False)
    want = next_turns(recompute)
    recompute.engine.close()
    disk = {"kvcache_storage_backend": "file", "kvcache_storage_path": str(tmp_path)}
    first = engine(monkeypatch, mode, swap_space=0.0005, **disk)
    rounds(first)
    first.engine.close()
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(tmp_path) for f in names if f.endswith(".kv"))
    for path in files[::7]:  # flip the last payload byte of every seventh file: headers intact, CRCs not
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))

    second = engine(monkeypatch, mode, swap_space=0.0005, **disk)
    assert next_turns(second) == want
    stats = second.engine.get_stats()
    # Loads found the corrupt files on the loader's thread; their requests went back to the queue and computed
    # what the failed loads could not bring (each hit counted once, the one it ran with).
    assert stats["host_cache_load_failures_total"] >= 1 and stats["disk_cache_corrupt_files_total"] >= 1
    assert stats["prefix_cache_hit_tokens_total"] < 4 * 288
    assert stats["prefix_cache_query_requests_total"] == 4
    second.engine.scheduler.check_integrity()
    second.engine.close()


@pytest.mark.parametrize("dtype,code_bytes", [("int8", 1.0), ("int4", 0.5)])
def test_a_compressed_tier_holds_more_pages_and_serves_the_same_hits(monkeypatch, dtype, code_bytes):
    """--swap-space-dtype: the same memory holds 4 x head_dim / (head_dim x code bytes + 4) times the pages
    (tiny preset, head_dim 32: 3.56x int8, 6.4x int4), the
    hits are the float32 tier's, and pages decoded back into the pool still give the recompute's answers
    for most turns (the rest is the cost of pages quantized on their way through the tier)."""
    recompute = rounds(engine(monkeypatch, "head_wise_recycle_on", caching=False))
    plain = engine(monkeypatch, "head_wise_recycle_on", swap_space=0.02)
    rounds(plain)
    llm = engine(monkeypatch, "head_wise_recycle_on", swap_space=0.02, swap_space_dtype=dtype)
    answers = rounds(llm)
    stats, plain_stats = llm.engine.get_stats(), plain.engine.get_stats()
    head_dim = llm.engine.model_config.head_dim
    ratio = 4 * head_dim / (head_dim * code_bytes + 4)
    assert stats["host_cache_pages_total"] / plain_stats["host_cache_pages_total"] == pytest.approx(ratio, rel=0.01)
    assert stats["prefix_cache_host_hit_tokens_total"] == plain_stats["prefix_cache_host_hit_tokens_total"] >= 8 * 288
    assert sum(a == b for a, b in zip(answers, recompute)) >= len(recompute) * 3 // 4
    llm.engine.scheduler.check_integrity()
