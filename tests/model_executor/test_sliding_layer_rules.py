"""Which layers slide, read from each family's own config.json fields as transformers reads them (the
architecture's `sliding_layers` rule where `layer_types` is absent), and the families' bias rules."""

import json

import pytest

from fastdeploy.model_config import ModelConfig

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def model_config(tmp_path, architecture, **fields):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture], **SMALL, **fields}))
    return ModelConfig.create(str(tmp_path), None, None)


def test_mistrals_window_slides_every_layer_and_null_slides_none(tmp_path):
    assert model_config(tmp_path, "MistralForCausalLM", sliding_window=64).layer_sliding_window == (64,) * 4
    assert model_config(tmp_path, "MistralForCausalLM", sliding_window=None).layer_sliding_window is None


@pytest.mark.parametrize("architecture", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_slides_from_max_window_layers_up_only_with_use_sliding_window(tmp_path, architecture):
    on = dict(use_sliding_window=True, sliding_window=64, max_window_layers=2)
    assert model_config(tmp_path, architecture, **on).layer_sliding_window == (None, None, 64, 64)
    # transformers' own layer_types, where the config holds them, win
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert model_config(tmp_path, architecture, **on, layer_types=types).layer_sliding_window == (64, None, 64, None)
    # without use_sliding_window no layer slides, whatever layer_types says (transformers drops the window)
    off = dict(on, use_sliding_window=False, layer_types=["sliding_attention"] * 4)
    assert model_config(tmp_path, architecture, **off).layer_sliding_window is None
    with pytest.raises(ValueError, match="max_window_layers must be an integer"):
        model_config(tmp_path, architecture, **dict(on, max_window_layers="two"))


def test_qwen2_always_has_qkv_biases_and_qwen3_only_with_attention_bias(tmp_path):
    assert model_config(tmp_path, "Qwen2ForCausalLM", attention_bias=False).qkv_bias
    assert not model_config(tmp_path, "Qwen3ForCausalLM").qkv_bias
    assert model_config(tmp_path, "Qwen3ForCausalLM", attention_bias=True).qkv_bias
    assert model_config(tmp_path, "Qwen3ForCausalLM").arch.qk_norm


def test_olmo3_slides_three_layers_of_four_by_default_and_its_layer_types_win(tmp_path):
    # transformers' Olmo3Config: layer i slides unless (i + 1) % 4 == 0, when the config lists no layer_types
    assert model_config(tmp_path, "Olmo3ForCausalLM", sliding_window=64).layer_sliding_window == (64, 64, 64, None)
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    assert model_config(tmp_path, "Olmo3ForCausalLM", sliding_window=64,
                        layer_types=types).layer_sliding_window == (None, 64, None, 64)
    with pytest.raises(ValueError, match="sliding_window must be an integer"):
        model_config(tmp_path, "Olmo3ForCausalLM", sliding_window=0)


def test_cohere2_slides_three_of_four_rotates_only_sliding_layers_and_scales_logits(tmp_path):
    config = model_config(tmp_path, "Cohere2ForCausalLM", sliding_window=64, logit_scale=0.25)
    assert config.layer_sliding_window == (64, 64, 64, None)
    assert config.layer_rope_theta[:3] == (10000.0,) * 3 and config.layer_rope_theta[3] is None  # no RoPE: full
    assert config.logit_scale == 0.25 and config.rms_norm_eps == 1e-5  # layer_norm_eps's default
    with pytest.raises(ValueError, match="logit_scale must be a positive number"):
        model_config(tmp_path, "Cohere2ForCausalLM", logit_scale="big")


def test_olmo3_refuses_tensor_parallelism_by_name(tmp_path):
    # its q/k RMSNorm spans every head, which ranks would split: refused, never computed per shard
    from fastdeploy.model_executor.models.decoder import CausalLM

    config = model_config(tmp_path, "Olmo3ForCausalLM", sliding_window=64)
    with pytest.raises(ValueError, match="Olmo3ForCausalLM: tensor parallelism is not supported"):
        CausalLM(config, {}, tp_rank=0, tp_size=2)


def test_gemma2_alternates_sliding_layers_and_reads_both_softcaps(tmp_path):
    config = model_config(tmp_path, "Gemma2ForCausalLM", sliding_window=64, query_pre_attn_scalar=8)
    assert config.layer_sliding_window == (64, None, 64, None)  # transformers: layer i slides iff (i + 1) % 2
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)  # its defaults
    assert config.attn_scale_ratio == pytest.approx(2 ** 0.5)  # (head_dim 16 / query_pre_attn_scalar 8) ** 0.5
    off = model_config(tmp_path, "Gemma2ForCausalLM", attn_logit_softcapping=None, final_logit_softcapping=None)
    assert (off.attn_logit_softcapping, off.final_logit_softcapping) == (0.0, 0.0)
    with pytest.raises(ValueError, match="attn_logit_softcapping must be a positive number"):
        model_config(tmp_path, "Gemma2ForCausalLM", attn_logit_softcapping=-5)
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0 is not supported for LlamaForCausalLM"):
        model_config(tmp_path, "LlamaForCausalLM", final_logit_softcapping=30.0)


def test_gpt_oss_reads_its_moe_yarn_and_bias_fields(tmp_path):
    config = model_config(tmp_path, "GptOssForCausalLM", sliding_window=32, num_local_experts=4, num_experts_per_tok=2,
                          rope_scaling=dict(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
                                            beta_fast=32.0, beta_slow=1.0, truncate=False))
    assert config.layer_sliding_window == (32, None, 32, None)
    assert config.qkv_bias and config.o_bias  # attention_bias (default true) covers o_proj too
    assert (config.moe.style, config.moe.num_experts, config.moe.top_k) == ("gpt_oss", 4, 2)
    assert (config.moe.swiglu_alpha, config.moe.swiglu_limit) == (1.702, 7.0)
    assert config.rope_attention_factor == pytest.approx(0.1 * 3.4657359 + 1.0)  # 0.1 ln(32) + 1
    divisors = config.rope_freq_divisors
    assert divisors[0] == pytest.approx(1.0) and divisors[-1] == pytest.approx(32.0)  # fast kept, slow slowed 32x
    with pytest.raises(ValueError, match="num_experts_per_tok=5 exceeds num_local_experts=4"):
        model_config(tmp_path, "GptOssForCausalLM", num_local_experts=4, num_experts_per_tok=5)


def test_gpt_oss_mxfp4_experts_and_tensor_parallelism_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="quant_method 'mxfp4'"):
        model_config(tmp_path, "GptOssForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                     quantization_config=dict(quant_method="mxfp4"))
    from fastdeploy.model_executor.models.decoder import CausalLM

    config = model_config(tmp_path, "GptOssForCausalLM", num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="GptOssForCausalLM: tensor parallelism is not supported"):
        CausalLM(config, {}, tp_rank=0, tp_size=2)
