"""RoPE scaling from config.json: Llama 3's rule read from `rope_parameters` (transformers 5) or the older
`rope_scaling`, as per-frequency divisors; every other kind, and a bad field, refused by name."""

import json

import pytest

from fastdeploy.model_config import ModelConfig

SMALL = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=128,
             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
             max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def model_config(tmp_path, **fields):
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, **fields}))
    return ModelConfig.create(str(tmp_path), None, None)


def test_llama3_divisors_keep_short_waves_and_slow_long_ones_by_the_factor(tmp_path):
    new = model_config(tmp_path, rope_parameters={"rope_theta": 10000.0, **LLAMA3}).rope_freq_divisors
    old = model_config(tmp_path, rope_theta=10000.0, rope_scaling=LLAMA3).rope_freq_divisors
    assert new == old and len(new) == 16
    assert new[0] == 1.0 and new[-1] == pytest.approx(8.0)  # the fastest frequency kept, the slowest slowed
    assert list(new) == sorted(new)  # in between, smoothly from one to the other
    assert model_config(tmp_path).rope_freq_divisors is None


@pytest.mark.parametrize("fields, named", [
    (dict(rope_parameters={"rope_theta": 10000.0, "rope_type": "longrope", "factor": 4.0}), "rope_type='longrope'"),
    (dict(rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0}),
     "original_max_position_embeddings must be a positive number for rope_type 'yarn'"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "yarn", "factor": 4.0},
                           "full_attention": {"rope_type": "default"}}), "rope_type='yarn' is not supported on sliding"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type='linear'"),
    (dict(rope_scaling={**LLAMA3, "factor": 0}), "factor must be a positive number"),
    (dict(rope_scaling={k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}),
     "original_max_position_embeddings"),
    (dict(rope_scaling={**LLAMA3, "high_freq_factor": 1.0}), "high_freq_factor"),
])
def test_a_rope_scaling_the_engine_does_not_implement_is_refused_by_name(tmp_path, fields, named):
    with pytest.raises(ValueError, match=named):
        model_config(tmp_path, **fields)
