"""Every decoder layer of a step in one op call (FD_CPU_FUSED_LAYERS=2, the default;
custom_ops/cpu_ops/decoder_stack.cc) gives the bits of the per-layer calls (FD_CPU_FUSED_LAYERS=1) on
SmolLM2 from text: greedy chat answers with their log-probs, and the prompt log-probs of a prose prompt
long enough that the shipped head-wise configuration recycles pages, flag off and on, exact weights
and int8 activations, float and k8v4 pages (int8 keys beside int4 values: lanes of two dtypes and
widths bound per layer); and a decode step is then one op call for all 30 layers and the LM head."""

from __future__ import annotations

import numpy as np
import pytest
from paddle import _C_ops

from fastdeploy import LLM, SamplingParams, envs

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "List three prime numbers and explain why they are prime."]
PROSE_TOKENS = 900  # > the shipped configuration's 256- and 512-token windows + sink: pages recycle


def answers(llm) -> list:
    outs = llm.chat([[{"role": "user", "content": c}] for c in CHATS],
                    SamplingParams(temperature=0, max_tokens=32, logprobs=3), use_tqdm=False)
    return [(list(o.outputs.token_ids), [sorted(d.items()) for d in o.outputs.logprobs]) for o in outs]


def prose_logprobs(llm) -> np.ndarray:
    from fastdeploy.tools.calibration_text import held_out_text, token_segments
    from fastdeploy.tools.prompt_logits import full_prompt_logprobs

    prose = token_segments(llm.engine.tokenizer, held_out_text(), PROSE_TOKENS, 1)[0]
    return full_prompt_logprobs(llm, prose)


def assert_stack_equals_per_layer_calls(llm):
    stacked = answers(llm), prose_logprobs(llm)
    model = llm.engine.runner.model
    assert model._stack is not None, "the whole-stack op did not run"
    model.fused_layers_level = 1  # FD_CPU_FUSED_LAYERS=1, in the same engine
    try:
        per_layer = answers(llm), prose_logprobs(llm)
    finally:
        model.fused_layers_level = 2
    assert stacked[0] == per_layer[0]
    assert np.array_equal(stacked[1].view(np.int32), per_layer[1].view(np.int32))


def engine(kv_cache_quant_type=None, **flags):
    # The named model: its shipped head-wise configuration. Prefix caching off: the per-layer run must
    # compute every prompt position again.
    with envs.override(**flags):
        return LLM(model="smollm2-135m-instruct", max_model_len=1024, max_num_seqs=8, block_size=16, enable_prefix_caching=False,
                   kv_cache_quant_type=kv_cache_quant_type)


@pytest.mark.parametrize("flags", [dict(FD_HEAD_WISE_KV_CACHE=0), dict(FD_HEAD_WISE_KV_CACHE=1),
                                   dict(FD_HEAD_WISE_KV_CACHE=1, FD_CPU_INT8_ACTIVATIONS=1)],
                         ids=["flag-off", "flag-on", "flag-on-int8-activations"])
def test_decoder_stack_gives_the_per_layer_calls_bits(smollm2_path, flags):  # smollm2_path: skips without it
    assert_stack_equals_per_layer_calls(engine(**flags))


def test_decoder_stack_on_k8v4_pages_gives_the_per_layer_calls_bits(smollm2_path):
    llm = engine("k8v4", FD_HEAD_WISE_KV_CACHE=1)
    backend = llm.engine.runner.attn_backend
    assert backend.key_caches[0].dtype.name == "INT8" and backend.value_caches[0].dtype.name == "UINT8"
    assert_stack_equals_per_layer_calls(llm)


def test_a_decode_step_is_one_op_call_for_every_layer(smollm2_flag_on):
    engine = smollm2_flag_on.engine
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": CHATS[0]}])
    engine.add_request("one-op", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()  # the prompt
    calls = []
    run_op = _C_ops._run_custom_op

    def counted(name, *args):
        calls.append(name)
        return run_op(name, *args)

    _C_ops._run_custom_op = counted
    try:
        engine.step()  # one decode step
    finally:
        _C_ops._run_custom_op = run_op
    while engine.has_unfinished_requests():
        engine.step()
    assert calls.count("decoder_stack_forward") == 1
    # ... and the final norm and the LM head ran inside it: what is left is the embedding's row lookup.
    assert set(calls) == {"block_rows", "decoder_stack_forward"}, calls


def test_a_wrapper_on_the_attention_backend_is_called_not_bypassed(smollm2_flag_on):
    """Whoever wraps the backend's forward (a probe, a timer) sees every layer's call: the one-op path
    steps aside for that backend."""
    engine = smollm2_flag_on.engine
    backend = engine.runner.ranks.attn_backend
    seen = []
    inner = backend.forward

    def wrapped(layer_id, qkv, meta):
        seen.append(layer_id)
        return inner(layer_id, qkv, meta)

    backend.forward = wrapped
    try:
        out = smollm2_flag_on.generate([engine.tokenizer.encode_chat([{"role": "user", "content": CHATS[0]}])],
                                       SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    finally:
        del backend.forward
    assert len(out[0].outputs.token_ids) == 2
    assert seen[:30] == list(range(30)) and len(seen) >= 60  # every layer, in each of the two steps
