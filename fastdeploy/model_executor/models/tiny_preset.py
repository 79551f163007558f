"""Shapes of the built-in tiny ERNIE-style preset: what runs when no --model is given.

Four KV heads, the first of them sliding-window, so head-wise recycling has something to do on
any machine. The weights are generated from a fixed seed by the model code.
"""

TINY_PRESET_NAME = "ernie-4.5-tiny-swa"

TINY_PRESET_CONFIG = {
    "architectures": ["Ernie4_5_ForCausalLM"],
    "model_type": "ernie4_5",
    "vocab_size": 259,  # byte-level tokenizer: 3 specials + 256 bytes
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 32768,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
    "head_wise_swa": {"sliding_window": 128, "sink_size": 16, "swa_kv_heads": [0]},
    "seed": 2024,
}
