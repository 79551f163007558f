"""Gemma 3 270M from its GGUF file (18 layers, sliding window 512 in five of six), text in: the engine's
prompt ids equal transformers' tokenizer on the same text, then its greedy tokens equal transformers',
on raw prompts, prompts longer than the window included."""

import pydoc_data.topics
import pytest

from fastdeploy import LLM, SamplingParams
from transformers_reference import reference_greedy

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

MAX_TOKENS = 16
_PROSE = " ".join(pydoc_data.topics.topics.values())
PROMPTS = ["The capital of France is", "def quicksort(items):\n    ", "In 1969, the first humans",
           "Ünïcödé naïve café, 中文 and 3.14159:\t\tdone\n\n",
           _PROSE[:3300], _PROSE[12000:17200]]  # ~700 and ~1100 tokens: past the 512-token window
# (Prose without a space run longer than Gemma's longest space piece: there transformers and llama.cpp
# disagree, and the engine follows llama.cpp; tests/input/test_gguf_tokenizer.py pins those ids.)


@pytest.fixture(scope="module")
def reference(gemma3_reference):
    """transformers' prompt ids of each text (its tokenizer adds <bos>, as the file says) and its greedy tokens."""
    tokenizer, model = gemma3_reference
    ids = [tokenizer.encode(text) for text in PROMPTS]
    return ids, [reference_greedy(model, i, MAX_TOKENS, [-1]) for i in ids]


@pytest.mark.parametrize("head_wise", ["0", "1"], ids=["1d", "slots_recycle_on"])
def test_gemma3_gguf_text_prompts_give_transformers_ids_and_greedy_tokens(monkeypatch, gemma3_path, reference,
                                                                          head_wise):
    """1-D tables (sliding layers masked) and slots + recycling (3 lanes of 6 layers, 5 sliding slots
    and 1 full per block: the sliding layers' out-of-window pages are recycled) give the same tokens,
    with n-gram speculation too (one engine: drafts switched on for the second run)."""
    reference_ids, reference_tokens = reference
    assert len(reference_ids[4]) > 512 and len(reference_ids[5]) > 1000
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", head_wise)
    monkeypatch.setenv("FD_HEAD_WISE_SWA_RECYCLE", "1")
    llm = LLM(model=gemma3_path, max_model_len=2048, block_size=16,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None})
    proposer, llm.engine.scheduler.proposer = llm.engine.scheduler.proposer, None  # plain decoding first
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [list(o.prompt_token_ids) for o in outs] == reference_ids  # the text first: same tokenization
    got = [list(o.outputs.token_ids) for o in outs]
    slots = llm.engine.fd_config.slot_layout
    assert (slots.num_lanes, slots.slots_per_rank, len(slots.sliding_slots)) == (3, 6, 5)
    if head_wise == "1":
        assert llm.engine.get_stats()["swa_pages_recycled_total"] > 0
    assert [g[0] for g in got] == [r[0] for r in reference_tokens]
    assert got == reference_tokens
    assert [o.outputs.text for o in outs] == [llm.engine.tokenizer.decode(r) for r in reference_tokens]
    llm.engine.scheduler.proposer = proposer
    speculated = [list(o.outputs.token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert speculated == reference_tokens
    assert llm.engine.get_stats()["spec_decode_num_accepted_tokens_total"] > 0
    # Every dense layer on the file's blocks (Q5_0, Q8_0, Q4_K, Q6_K; q/k rows permuted with their blocks).
    assert all(layer.storage.startswith("gguf ") for layer in llm.engine.runner.model.dense_layers())


# A Gemma-style chat template that writes <bos> itself (the instruction-tuned files carry one like it).
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_a_template_that_writes_bos_gives_transformers_prompt_ids_offline_and_over_http(gemma3_path,
                                                                                      gemma3_reference):
    """The file's tokenizer adds <bos> to raw prompts; a chat is not a raw prompt, so under a template that
    writes <bos> the prompt holds one, as transformers' apply_chat_template gives it. Checked on both
    paths: LLM.chat and the server's engine loop (which once encoded the rendered text as a raw prompt)."""
    import multiprocessing

    from fastdeploy.entrypoints.openai.engine_client import AddPayload, EngineInfo, _EngineLoop
    from fastdeploy.input.chat_template import JinjaChatTemplate

    tokenizer, _ = gemma3_reference
    messages = [{"role": "user", "content": "Name a  colour."}, {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another one, please."}]
    expected = tokenizer.apply_chat_template(messages, chat_template=BOS_TEMPLATE, add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    assert expected.count(tokenizer.bos_token_id) == 1
    llm = LLM(model=gemma3_path, max_model_len=256, block_size=16)
    ours = llm.engine.tokenizer
    ours.chat_template = JinjaChatTemplate(BOS_TEMPLATE, ours.special_tokens)
    offline = llm.chat(messages, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert list(offline.prompt_token_ids) == list(expected)
    queues = multiprocessing.get_context("spawn")
    loop = _EngineLoop(llm.engine, EngineInfo("gemma", 256, ours.vocab_size), queues.Queue(), queues.Queue())
    loop._add("served", AddPayload(prompt=None, messages=messages, sampling={"max_tokens": 1}))
    assert list(llm.engine.scheduler.requests["served"].prompt_token_ids) == list(expected)
