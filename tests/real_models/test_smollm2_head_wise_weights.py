"""SmolLM2 with the head-wise configuration it ships (two of three KV heads sliding, uneven per layer, each
with its own window from a menu of 256 to 2048 tokens): turning the flag on costs no weight bytes — each layer's heads meet their
cache slots through the attention op's head -> slot map, so the weights keep the file's GGUF blocks in
the checkpoint's order — and the tokens are those of full attention (transformers) within the window
and those of the dense per-(layer, head) oracle past it."""

import json

import pytest

from fastdeploy import LLM, SamplingParams, envs
from fastdeploy.model_executor.layers.attention.swa_spec import attention_type_table
from fastdeploy.model_executor.models.named_models import CALIBRATED_DIR
from transformers_reference import reference_greedy

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

CHATS = ["What is the capital of France? Answer in one sentence.", "Write a haiku about the sea."]
MAX_TOKENS = 16


def _shipped() -> dict:
    with open(f"{CALIBRATED_DIR}/smollm2-135m-instruct.json", encoding="utf-8") as f:
        return json.load(f)["head_wise_swa"]


def test_head_wise_mode_holds_the_flag_off_weights_format_and_bytes(smollm2_flag_off, smollm2_flag_on):
    off, on = smollm2_flag_off.engine.runner.model, smollm2_flag_on.engine.runner.model
    heads = on.config.head_wise_swa.layer_kv_heads
    assert heads is not None and len(set(heads)) > 1  # different sliding heads per layer: the case that moved weights
    assert on.config.kv_head_orders is None  # nothing permuted
    assert on.dense_layer_storage() == off.dense_layer_storage()  # the start-up log's line
    assert on.dense_layer_bytes() == off.dense_layer_bytes()
    assert {layer.storage for layer in on.dense_layers()} == {"gguf Q4_1", "gguf Q8_0"}  # no float32 copy
    slots = smollm2_flag_on.engine.fd_config.slot_layout
    types = attention_type_table(on.config)
    assert len({t for row in types for t in row if t.sliding}) > 1  # several windows
    # every (layer, head) reads and writes a slot of its own attention type
    assert all(slots.slot_types[slots.head_slots[layer][h]] == types[layer][h]
               for layer in range(len(types)) for h in range(len(types[layer])))


def test_within_the_window_head_wise_tokens_equal_flag_off_and_transformers(smollm2_flag_off, smollm2_flag_on,
                                                                            smollm2_reference):
    _, model = smollm2_reference
    stop = smollm2_flag_on.engine.model_config.eos_token_ids
    chats = [[{"role": "user", "content": c}] for c in CHATS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    on = smollm2_flag_on.chat(chats, params, use_tqdm=False)
    off = smollm2_flag_off.chat(chats, params, use_tqdm=False)
    assert [list(o.outputs.token_ids) for o in on] == [list(o.outputs.token_ids) for o in off]
    assert [list(o.outputs.token_ids) for o in on] == \
        [reference_greedy(model, list(o.prompt_token_ids), MAX_TOKENS, stop) for o in on]


def test_past_the_window_the_slot_mapped_heads_give_the_dense_oracles_tokens(smollm2_flag_on):
    """The shipped per-layer heads with their windows divided by 32 (8 to 64 tokens), so that short prompts
    reach past them: the paged path (weights in checkpoint order, per-layer head -> slot map, every window
    recycling) against NATIVE_ATTN, which masks every (layer, head) of the same checkpoint densely."""
    shipped = _shipped()
    spec = dict(shipped, sliding_window=64, sink_size=4,
                head_windows=[[w // 32 for w in layer] for layer in shipped["head_windows"]])
    tokenizer = smollm2_flag_on.engine.tokenizer
    text = "The history of the printing press begins in China, long before Gutenberg. " * 12
    prompts = [tokenizer.encode(text)[:150], tokenizer.encode("def fibonacci(n):\n    " * 20)[:120]]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = {}
    for backend in ("APPEND_ATTN", "NATIVE_ATTN"):
        with envs.override(FD_HEAD_WISE_KV_CACHE=1, FD_HEAD_WISE_SWA_RECYCLE=1, FD_ATTENTION_BACKEND=backend):
            llm = LLM(model="smollm2-135m-instruct", max_model_len=256, max_num_seqs=2, block_size=16,
                      head_wise_swa_config=spec, enable_prefix_caching=False)
        runs[backend] = [list(o.outputs.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        if backend == "APPEND_ATTN":
            assert llm.engine.model_config.kv_head_orders is None
            assert llm.engine.get_stats()["swa_pages_recycled_total"] > 0  # the window was left behind
    assert runs["APPEND_ATTN"] == runs["NATIVE_ATTN"]
