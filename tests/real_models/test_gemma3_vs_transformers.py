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


def test_gemma3_gguf_greedy_tokens_equal_transformers(gemma3_path, prompts, reference_tokens):
    llm = LLM(model=gemma3_path, max_model_len=2048, block_size=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    got = [list(o.outputs.token_ids) for o in outs]
    assert [g[0] for g in got] == [r[0] for r in reference_tokens]
    assert got == reference_tokens
