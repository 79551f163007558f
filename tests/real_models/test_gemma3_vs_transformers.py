"""Gemma 3 270M from its GGUF file (18 layers, sliding window 512 in five of six): the engine's greedy
tokens equal transformers' on raw prompts, prompts longer than the window included."""

import pydoc_data.topics
import pytest

from fastdeploy import LLM, SamplingParams
from transformers_reference import reference_greedy

MAX_TOKENS = 16
SHORT = ["The capital of France is", "def quicksort(items):\n    ", "In 1969, the first humans"]


def _long_prompt(tokenizer, start: int, tokens: int) -> list:
    text = " ".join(pydoc_data.topics.topics.values())[start:start + 8 * tokens]
    return tokenizer.encode(text)[:tokens]


@pytest.fixture(scope="module")
def prompts(gemma3_reference):
    tokenizer, _ = gemma3_reference
    return [tokenizer.encode(t) for t in SHORT] + [_long_prompt(tokenizer, 0, 700), _long_prompt(tokenizer, 9000, 1100)]


@pytest.fixture(scope="module")
def reference_tokens(gemma3_reference, prompts):
    _, model = gemma3_reference
    return [reference_greedy(model, ids, MAX_TOKENS, [-1]) for ids in prompts]


@pytest.mark.parametrize("head_wise", ["0", "1"], ids=["1d", "slots_recycle_on"])
def test_gemma3_gguf_greedy_tokens_equal_transformers(monkeypatch, gemma3_path, prompts, reference_tokens, head_wise):
    """1-D tables (sliding layers masked) and slots + recycling (3 lanes of 6 layers, 5 sliding slots
    and 1 full per block: the sliding layers' out-of-window pages are recycled) give the same tokens,
    with n-gram speculation too (one engine: drafts switched on for the second run)."""
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", head_wise)
    monkeypatch.setenv("FD_HEAD_WISE_SWA_RECYCLE", "1")
    llm = LLM(model=gemma3_path, max_model_len=2048, block_size=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None})
    proposer, llm.engine.scheduler.proposer = llm.engine.scheduler.proposer, None  # plain decoding first
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(o.outputs.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    slots = llm.engine.fd_config.slot_layout
    assert (slots.num_lanes, slots.slots_per_rank, len(slots.sliding_slots)) == (3, 6, 5)
    if head_wise == "1":
        assert llm.engine.get_stats()["swa_pages_recycled_total"] > 0
    assert [g[0] for g in got] == [r[0] for r in reference_tokens]
    assert got == reference_tokens
    llm.engine.scheduler.proposer = proposer
    speculated = [list(o.outputs.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert speculated == reference_tokens
    assert llm.engine.get_stats()["spec_decode_num_accepted_tokens_total"] > 0
    # Every dense layer on the file's blocks (Q5_0, Q8_0, Q4_K, Q6_K; q/k rows permuted with their blocks).
    assert all(layer.storage.startswith("gguf ") for layer in llm.engine.runner.model.dense_layers())
