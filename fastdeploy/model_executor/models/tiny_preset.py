"""Shapes of the built-in tiny presets: the dense one runs when no --model is given; `--model tiny-moe`
selects a miniature of ERNIE-4.5-21B-A3B's MoE architecture.

Four KV heads, the first of them sliding-window, so head-wise recycling has something to do on
any machine. The weights are generated from a fixed seed by the model code: random, so the text
these presets produce means nothing.
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

TINY_MOE_PRESET_NAME = "tiny-moe"

# ERNIE-4.5-21B-A3B in miniature: 5 query heads per KV head (20/4), shared experts, MoE from
# layer 1 on (layer 0 dense), top-6 of 64 routed experts scaled down to top-4 of 16.
TINY_MOE_PRESET_CONFIG = {
    "architectures": ["Ernie4_5_MoeForCausalLM"],
    "model_type": "ernie4_5_moe",
    "vocab_size": 259,  # byte-level tokenizer, like the dense preset
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 20,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": 32768,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
    "moe_num_experts": 16,
    "moe_k": 4,
    "moe_intermediate_size": 128,
    "moe_num_shared_experts": 2,
    "moe_layer_start_index": 1,
    "moe_layer_end_index": 3,
    "moe_layer_interval": 1,
    "head_wise_swa": {"sliding_window": 128, "sink_size": 16, "swa_kv_heads": [0]},
    "seed": 2025,
}

TINY_SLIDING_PRESET_NAME = "tiny-sliding-layers"

# A model trained with sliding *layers* in miniature (Gemma 3's pattern: five sliding layers to one
# global), two KV heads, a window shorter than the test prompts. Its sliding layers are the model's
# semantics in every memory mode; with FD_HEAD_WISE_KV_CACHE=1 their slots recycle.
TINY_SLIDING_PRESET_CONFIG = {
    **{k: v for k, v in TINY_PRESET_CONFIG.items() if k != "head_wise_swa"},
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "layer_sliding_window": [48, 48, 48, 48, 48, None],
    "seed": 2026,
}

# The CUDA AppendAttention op has kernels for head_dim 64, 128 and 256 only (worker/device.py), so the
# GPU runs twins of the presets with head_dim 64: same layers, heads, SWA spec and seed, wider
# heads (different random weights). Without --model the GPU serves the dense twin; the GPU-vs-CPU
# checks name a twin on both devices so that they compare one model.
GPU_PRESET_HEAD_DIM = 64
TINY_GPU_PRESET_NAME = TINY_PRESET_NAME + "-hd64"
TINY_MOE_GPU_PRESET_NAME = TINY_MOE_PRESET_NAME + "-hd64"

PRESETS = {
    TINY_PRESET_NAME: TINY_PRESET_CONFIG,
    TINY_MOE_PRESET_NAME: TINY_MOE_PRESET_CONFIG,
    TINY_SLIDING_PRESET_NAME: TINY_SLIDING_PRESET_CONFIG,
    TINY_GPU_PRESET_NAME: {**TINY_PRESET_CONFIG, "head_dim": GPU_PRESET_HEAD_DIM},
    TINY_MOE_GPU_PRESET_NAME: {**TINY_MOE_PRESET_CONFIG, "head_dim": GPU_PRESET_HEAD_DIM},
}
GPU_TWIN = {TINY_PRESET_NAME: TINY_GPU_PRESET_NAME, TINY_MOE_PRESET_NAME: TINY_MOE_GPU_PRESET_NAME}


def default_preset(device: str) -> str:
    """The preset served when no --model is given."""
    return TINY_GPU_PRESET_NAME if device == "gpu" else TINY_PRESET_NAME
