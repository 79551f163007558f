"""Greedy tokens are identical in every memory mode and equal to the dense NATIVE_ATTN oracle."""

import pytest

from fastdeploy import LLM, SamplingParams
from greedy_run import MODES, greedy_tokens

# The tiny preset: 4 KV heads, head 0 SWA with window 128 and sink 16.
PROMPT_LENGTHS = [1, 7, 16, 130, 300, 520]  # up to ~4x the window
MAX_TOKENS = 24


def prompts():
    # Deterministic, varied token ids (a plain repeated pattern would let the model lock into a loop).
    return [[3 + (i * 37 + n * 11 + (i * i) % 23) % 250 for i in range(n)] for n in PROMPT_LENGTHS]


def generate(monkeypatch, backend, head_wise, recycle, reserve="1", **engine_args):
    engine_args = {"block_size": 16, "max_model_len": 1024, "max_num_seqs": 8, **engine_args}
    return greedy_tokens(monkeypatch, prompts(), MAX_TOKENS, backend, head_wise, recycle, reserve, **engine_args)


@pytest.fixture(scope="module")
def oracle():
    mp = pytest.MonkeyPatch()
    try:
        tokens, _ = generate(mp, "NATIVE_ATTN", "0", "1", num_gpu_blocks_override=512)
    finally:
        mp.undo()
    assert all(len(t) == MAX_TOKENS for t in tokens)
    return tokens




@pytest.mark.parametrize("mode", MODES)
def test_paged_modes_match_the_dense_oracle(monkeypatch, oracle, mode):
    tokens, _ = generate(monkeypatch, "APPEND_ATTN", *MODES[mode], num_gpu_blocks_override=512)
    assert tokens == oracle


@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_matches_the_oracle(monkeypatch, oracle, mode):
    tokens, _ = generate(monkeypatch, "APPEND_ATTN", *MODES[mode], num_gpu_blocks_override=512,
                         max_num_batched_tokens=40)
    assert tokens == oracle


@pytest.mark.parametrize("mode", MODES)
def test_preemption_under_a_tight_page_budget_matches_the_oracle(monkeypatch, oracle, mode):
    # 60 blocks cannot hold all six requests at full length: on-demand admission must preempt.
    tokens, engine = generate(monkeypatch, "APPEND_ATTN", *MODES[mode], reserve="0", num_gpu_blocks_override=60,
                              max_num_batched_tokens=64)
    assert engine.get_stats()["num_preemptions_total"] > 0
    assert tokens == oracle
    stats = engine.get_stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_recycling_really_frees_pages_during_generation(monkeypatch, oracle):
    tokens, engine = generate(monkeypatch, "APPEND_ATTN", "1", "1", num_gpu_blocks_override=512)
    assert tokens == oracle
    assert engine.get_stats()["swa_pages_recycled_total"] > 0


def test_native_oracle_with_chunking_and_preemption_is_self_consistent(monkeypatch, oracle):
    tokens, engine = generate(monkeypatch, "NATIVE_ATTN", "1", "1", reserve="0", num_gpu_blocks_override=48,
                              max_num_batched_tokens=40)
    assert engine.get_stats()["num_preemptions_total"] > 0
    assert tokens == oracle


def test_a_requests_tokens_do_not_depend_on_its_batch_mates(monkeypatch):
    """Bit-identical logprobs alone and in a crowd: the basis of 'identical outputs' across A/B arms."""
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    probe = prompts()[3]

    def run(batch):
        llm = LLM(block_size=16, num_gpu_blocks_override=512, max_model_len=1024, max_num_batched_tokens=96)
        out = llm.generate(batch, params, use_tqdm=False)
        return out[0].outputs.token_ids, out[0].outputs.logprobs

    alone = run([probe])
    crowded = run([probe] + prompts()[:3] + prompts()[4:] + [[7] * 11, [200] * 3])
    assert crowded == alone


# Tensor parallelism (real worker processes) is compared with TP=1 in tests/e2e/test_tensor_parallel.py.
