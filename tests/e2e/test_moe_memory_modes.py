"""The MoE miniature (`tiny-moe`, ERNIE-4.5-21B-A3B's shape) gives the NATIVE_ATTN oracle's greedy
tokens in every memory mode, with SWA pages really recycled, chunked prefill and prefix caching."""

import pytest

from fastdeploy import LLM, SamplingParams

SWA = {"sliding_window": 32, "sink_size": 4, "swa_kv_heads": [0, 1]}
PROMPTS = [[3 + (i * 41 + n * 7 + (i * i) % 19) % 250 for i in range(n)] for n in (5, 90, 200)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(monkeypatch, backend, head_wise, recycle="1", **kw):
    monkeypatch.setenv("FD_ATTENTION_BACKEND", backend)
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", head_wise)
    monkeypatch.setenv("FD_HEAD_WISE_SWA_RECYCLE", recycle)
    llm = LLM(model="tiny-moe", block_size=16, max_model_len=512, head_wise_swa_config=SWA, **kw)
    return [o.outputs.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)], llm.engine


@pytest.fixture(scope="module")
def oracle():
    mp = pytest.MonkeyPatch()
    try:
        return run(mp, "NATIVE_ATTN", "0", num_gpu_blocks_override=128)[0]
    finally:
        mp.undo()


@pytest.mark.parametrize("head_wise,recycle,extra", [
    ("0", "1", {}),
    ("1", "0", {}),
    ("1", "1", {}),
    ("1", "1", {"max_num_batched_tokens": 24}),  # chunked prefill
])
def test_moe_tokens_equal_the_oracle(monkeypatch, oracle, head_wise, recycle, extra):
    tokens, engine = run(monkeypatch, "APPEND_ATTN", head_wise, recycle, num_gpu_blocks_override=128, **extra)
    assert tokens == oracle
    if head_wise == "1" and recycle == "1":
        assert engine.scheduler.kv_cache_manager.swa_pages_recycled_total > 0  # the SWA heads really gave pages back


def test_moe_prefix_cache_hit_gives_the_same_tokens(monkeypatch, oracle):
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    monkeypatch.setenv("FD_HEAD_WISE_SWA_RECYCLE", "1")
    monkeypatch.setenv("FD_ATTENTION_BACKEND", "APPEND_ATTN")
    llm = LLM(model="tiny-moe", block_size=16, max_model_len=512, head_wise_swa_config=SWA,
              num_gpu_blocks_override=128, enable_prefix_caching=True)
    first = llm.generate([PROMPTS[1]], PARAMS, use_tqdm=False)[0].outputs.token_ids
    again = llm.generate([PROMPTS[1]], PARAMS, use_tqdm=False)[0].outputs.token_ids
    assert first == again == oracle[1]
    assert llm.engine.scheduler.prefix_cache_hit_tokens_total > 0
