"""Llama 3's RoPE scaling (rope_type "llama3") against transformers 5.24, on a small random Llama whose
original context is 64 tokens, so prompts of 90 tokens and more rotate every frequency class (kept, slowed
and smoothed). From its Hugging Face directory (`rope_parameters`, as save_pretrained writes it) and from a
GGUF of the same weights written with the `gguf` package the way llama.cpp's converter lays a Llama out
(q/k rows interleaved, `rope_freqs` holding the divisors, computed here with transformers' own llama3
initialiser, SmolLM2's tokenizer fields): prompt log-probs within float32 tolerance, greedy tokens equal."""

import numpy as np
import pytest

from fastdeploy import LLM
from transformers_reference import assert_greedy_equal, logprob_diff, write_gguf

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

VOCAB = 49152
ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 2, 32, 2
PROMPTS = [[(7 + 131 * i + 17 * n) % (VOCAB - 10) + 5 for i in range(n)] for n in (5, 90, 200)]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def llama3(tmp_path_factory, smollm2_reference):
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                      num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=1024,
                                      rope_parameters=dict(ROPE), tie_word_embeddings=False, initializer_range=0.1,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("llama3")
    model.save_pretrained(path)
    smollm2_reference[0].save_pretrained(path)
    return str(path), model


def _write_gguf(path, model, smollm2_path) -> None:
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    plain = ROPE["rope_theta"] ** (-np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM)
    scaled = ROPE_INIT_FUNCTIONS["llama3"](model.config, torch.device("cpu"))[0].double().numpy()
    write_gguf(path, model, "llama", smollm2_path, interleave_qk=True,
               extra_tensors={"rope_freqs.weight": (plain / scaled).astype(np.float32)})


@pytest.mark.parametrize("source", ["directory", "gguf"])
def test_llama3_rope_scaling_logprobs_and_greedy_tokens_equal_transformers(llama3, smollm2_path, tmp_path, source):
    path, model = llama3
    if source == "gguf":
        path = str(tmp_path / "llama3.gguf")
        _write_gguf(path, model, smollm2_path)
    llm = LLM(model=path, max_model_len=512, block_size=16, enable_prefix_caching=False)
    divisors = llm.engine.model_config.rope_freq_divisors
    assert divisors is not None and min(divisors) == pytest.approx(1.0) and max(divisors) == pytest.approx(8.0)
    diff = logprob_diff(llm, model, PROMPTS[-1])[0]
    print(f"Llama 3 RoPE from a {source}: max |log-prob diff| over {len(PROMPTS[-1])} positions {diff:.2e}")
    assert diff < 1e-3
    assert_greedy_equal(llm, model, PROMPTS, MAX_TOKENS)
