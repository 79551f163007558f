"""Hugging Face directories (config.json + safetensors, as transformers' save_pretrained writes them) of
Llama and Gemma 3: rotate-half q/k rows converted at load, Gemma's norm offset, q/k norms and sliding
layers — the engine's greedy tokens equal transformers' on the same small random weights."""

import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy import envs
from transformers_reference import reference_greedy

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

VOCAB = 49152  # SmolLM2's tokenizer is saved beside the weights; prompts are token ids
PROMPT_LENGTHS = (5, 40, 90)  # the Gemma model's window is 32: the longer prompts leave it
MAX_TOKENS = 12


def _save(tmp_path_factory, name, config, smollm2_reference):
    import torch
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, name)(config).eval()
    with torch.no_grad():  # peaked logits: a float32 rounding difference cannot flip a greedy token
        model.lm_head.weight.mul_(8.0) if not config.tie_word_embeddings else model.model.embed_tokens.weight.mul_(4.0)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    smollm2_reference[0].save_pretrained(path)
    return str(path), model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, smollm2_reference):
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.1,
                                      bos_token_id=1, eos_token_id=2)
    return _save(tmp_path_factory, "LlamaForCausalLM", config, smollm2_reference)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, smollm2_reference):
    import transformers

    config = transformers.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                                           head_dim=64, sliding_window=32, layer_types=[
                                               "sliding_attention", "sliding_attention", "full_attention"],
                                           max_position_embeddings=1024, initializer_range=0.1,
                                           query_pre_attn_scalar=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.architectures = ["Gemma3ForCausalLM"]
    return _save(tmp_path_factory, "Gemma3ForCausalLM", config, smollm2_reference)


def _prompts():
    return [[(7 + 131 * i + 17 * n) % (VOCAB - 10) + 5 for i in range(n)] for n in PROMPT_LENGTHS]


def _check(path, model, mode):
    flags = dict(FD_HEAD_WISE_KV_CACHE=0) if mode == "1d" else dict(FD_HEAD_WISE_KV_CACHE=1,
                                                                     FD_HEAD_WISE_SWA_RECYCLE=1)
    extra = {} if mode == "1d" else dict(head_wise_swa_config={"sliding_window": 4096, "sink_size": 0,
                                                               "swa_kv_heads": [0]})
    with envs.override(**flags):
        llm = LLM(model=path, max_model_len=512, block_size=16, **extra)
    outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    for ids, out in zip(_prompts(), outs):
        assert list(out.outputs.token_ids) == reference_greedy(model, ids, MAX_TOKENS, [-1])


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_on"])
def test_llama_directory_tokens_equal_transformers(llama_dir, mode):
    _check(*llama_dir, mode)


def test_gemma3_directory_tokens_equal_transformers(gemma3_dir):
    _check(*gemma3_dir, "1d")
