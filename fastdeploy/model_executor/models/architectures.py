"""Every architecture the one decoder serves, as data: what differs between them, in one table.

The decoder (decoder.py) reads an `Architecture` and never branches on a model's name. Parameter
names are the Hugging Face checkpoint names, which ERNIE-4.5 (PaddleFormers), Llama and Gemma 3
share (`model.layers.N.self_attn.q_proj.weight`, `[out, in]`); a GGUF file's tensors are renamed to
them at load (GGUF_TENSOR_NAMES). Configuration defaults are the reference implementation's
(PaddleFormers for ERNIE, transformers for the others), for fields a config.json may omit.

RoPE: the attention op rotates interleaved pairs `(x[2i], x[2i+1])`. Checkpoints that rotate halves
`(x[i], x[i + d/2])` (Hugging Face Llama and Gemma, and llama.cpp's Gemma 3 GGUF) have their q/k
rows (and q/k norm weights) permuted once at load; `rope_layout` says which layout a source holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

INTERLEAVED, ROTATE_HALF = "interleaved", "rotate_half"
# How a config.json without `layer_types` says which layers slide (`layer_types`, where present, wins):
LAYER_SLIDING_WINDOW = "layer_sliding_window"  # this engine's per-layer list, or no layer slides
EVERY_NTH_GLOBAL = "every_nth_global"          # Gemma 3: `sliding_window_pattern`, every Nth layer global
ALL_LAYERS = "all_layers"                      # Mistral: `sliding_window` (when not null) on every layer
ABOVE_MAX_WINDOW_LAYERS = "above_max_window_layers"  # Qwen2/3: with `use_sliding_window`, layers >= max_window_layers


@dataclass(frozen=True)
class Architecture:
    name: str                     # the `architectures` entry of config.json
    model_type: str
    defaults: dict                # the reference's config defaults
    activation: str = "silu"      # MLP gate: silu (SwiGLU) or gelu_tanh (GeGLU)
    norm_offset: float = 0.0      # RMSNorm scales by (norm_offset + weight): Gemma stores weight - 1
    qk_norm: bool = False         # RMSNorm over head_dim on every q and k head before RoPE
    sandwich_norms: bool = False  # norms after attention and around the MLP (Gemma 3's four per layer)
    post_norms: bool = False      # norms after attention and after the MLP only, none on a layer's input (OLMo)
    qk_norm_over_heads: bool = False  # the q (k) RMSNorm spans every head at once, not each head (OLMo)
    layer_norm: bool = False      # LayerNorm (mean removed, weight, no bias) where the others RMS-norm (Cohere)
    parallel_block: bool = False  # attention and MLP both read the layer's one normed input, both join the
                                  # residual (Cohere: no second norm)
    nope_full_layers: bool = False  # full-attention layers apply no RoPE, sliding ones do (Cohere2)
    logit_softcapping: bool = False  # attn_logit_softcapping / final_logit_softcapping are read (Gemma 2, 3)
    attention_sinks: bool = False  # a learned sink logit per query head joins each softmax (gpt-oss: `sinks`)
    o_bias: bool = False          # o_proj carries a bias where the config's attention_bias says (gpt-oss)
    embed_scale: bool = False     # embeddings times sqrt(hidden_size)
    rope_layout: str = INTERLEAVED                 # of a Hugging Face directory's q/k rows
    gguf_rope_layout: Optional[str] = None         # of llama.cpp's GGUF q/k rows (None: no GGUF)
    gguf_arch: Optional[str] = None
    moe: bool = False
    moe_style: str = "ernie4_5"  # which MoE block: ernie4_5_moe.py, or gpt_oss (gpt_oss_moe.py)
    qkv_bias: Optional[bool] = None  # q/k/v projections carry biases (None: the config's attention_bias says)
    sliding_layers: str = LAYER_SLIDING_WINDOW
    config_aliases: dict = field(default_factory=dict)  # HF field name -> the name used here


_ERNIE_DEFAULTS = dict(vocab_size=32000, hidden_size=768, intermediate_size=11008, max_position_embeddings=32768,
                       num_hidden_layers=2, num_attention_heads=2, head_dim=128, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       rope_theta=10000.0, use_bias=False, hidden_act="silu")

ERNIE4_5 = Architecture("Ernie4_5ForCausalLM", "ernie4_5", _ERNIE_DEFAULTS)
ERNIE4_5_MOE = Architecture(
    "Ernie4_5_MoeForCausalLM", "ernie4_5_moe", moe=True,
    defaults=dict(_ERNIE_DEFAULTS, vocab_size=103424, hidden_size=2560, intermediate_size=12288, num_hidden_layers=3,
                  head_dim=None, moe_num_experts=16, moe_intermediate_size=0, moe_num_shared_experts=2,
                  moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=1, moe_k=2,
                  moe_norm_min=1e-12, moe_use_aux_free=True, scoring_func="softmax", moe_group_experts=False))
LLAMA = Architecture(
    "LlamaForCausalLM", "llama", rope_layout=ROTATE_HALF, gguf_rope_layout=INTERLEAVED, gguf_arch="llama",
    defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
                  max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
                  attention_bias=False, mlp_bias=False, pad_token_id=None, bos_token_id=1, eos_token_id=2))
GEMMA3 = Architecture(
    "Gemma3ForCausalLM", "gemma3_text", activation="gelu_tanh", norm_offset=1.0, qk_norm=True, sandwich_norms=True,
    embed_scale=True, logit_softcapping=True, rope_layout=ROTATE_HALF, gguf_rope_layout=ROTATE_HALF, gguf_arch="gemma3",
    sliding_layers=EVERY_NTH_GLOBAL,
    config_aliases={"hidden_activation": "hidden_act"},
    defaults=dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_act="gelu_pytorch_tanh",
                  max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1e6,
                  rope_local_base_freq=10000.0, attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
                  sliding_window_pattern=6, final_logit_softcapping=None, attn_logit_softcapping=None,
                  pad_token_id=0, bos_token_id=2, eos_token_id=1))

# Gemma 2: Gemma 3's layer without the q/k norms, one RoPE base, sliding and full layers alternating (the
# config's layer_types; every second layer full by the rule below), attention scores and final logits soft-capped.
GEMMA2 = Architecture(
    "Gemma2ForCausalLM", "gemma2", activation="gelu_tanh", norm_offset=1.0, sandwich_norms=True, embed_scale=True,
    logit_softcapping=True, rope_layout=ROTATE_HALF, gguf_rope_layout=ROTATE_HALF, gguf_arch="gemma2",
    sliding_layers=EVERY_NTH_GLOBAL,
    config_aliases={"hidden_activation": "hidden_act"},
    defaults=dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_act="gelu_pytorch_tanh",
                  max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=10000.0,
                  attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=2,
                  final_logit_softcapping=30.0, attn_logit_softcapping=50.0, pad_token_id=0, bos_token_id=2,
                  eos_token_id=1))

# gpt-oss: Llama's layer with biases on q, k, v and o (attention_bias), a learned sink logit per query head in
# every softmax, sliding (128) and full layers alternating (layer_types), YaRN RoPE over rotate-half rows, and
# every layer's MLP an MoE block (gpt_oss_moe.py).
GPT_OSS = Architecture(
    "GptOssForCausalLM", "gpt_oss", rope_layout=ROTATE_HALF, attention_sinks=True, o_bias=True, moe=True,
    moe_style="gpt_oss",
    sliding_layers=EVERY_NTH_GLOBAL,
    defaults=dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                  num_attention_heads=64, num_key_value_heads=8, head_dim=64, hidden_act="silu",
                  max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=150000.0,
                  attention_bias=True, sliding_window=128, sliding_window_pattern=2, num_local_experts=128,
                  num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0, pad_token_id=None,
                  bos_token_id=None, eos_token_id=None))

# Mistral / Ministral: Llama's layer with a sliding window on every layer.
MISTRAL = Architecture(
    "MistralForCausalLM", "mistral", rope_layout=ROTATE_HALF, sliding_layers=ALL_LAYERS,
    defaults=dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=None, hidden_act="silu",
                  max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
                  sliding_window=4096, attention_bias=False, pad_token_id=None, bos_token_id=1, eos_token_id=2))
_QWEN_DEFAULTS = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, head_dim=None, hidden_act="silu",
                      max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
                      use_sliding_window=False, sliding_window=None, max_window_layers=28, attention_bias=False,
                      pad_token_id=None, bos_token_id=None, eos_token_id=None)
# Qwen2: biases on q, k and v always (its attention_bias field is not read by transformers either).
# llama.cpp keeps Qwen's q/k rows as Hugging Face lays them out (its NEOX RoPE); no sliding layers are read
# from a Qwen GGUF (it carries no use_sliding_window): it serves full attention in every layer.
QWEN2 = Architecture("Qwen2ForCausalLM", "qwen2", rope_layout=ROTATE_HALF, qkv_bias=True,
                     gguf_rope_layout=ROTATE_HALF, gguf_arch="qwen2",
                     sliding_layers=ABOVE_MAX_WINDOW_LAYERS, defaults=_QWEN_DEFAULTS)
# Qwen3: no biases (unless attention_bias), an RMSNorm over head_dim on every q and k head.
QWEN3 = Architecture("Qwen3ForCausalLM", "qwen3", rope_layout=ROTATE_HALF, qk_norm=True,
                     gguf_rope_layout=ROTATE_HALF, gguf_arch="qwen3",
                     sliding_layers=ABOVE_MAX_WINDOW_LAYERS, defaults=dict(_QWEN_DEFAULTS, head_dim=128))

# OLMo 3: each sublayer's output is RMS-normed before it joins the residual (no norm on a layer's input); the q
# and k projections are RMS-normed over all their heads at once, before RoPE; three sliding layers to one full
# (the config's layer_types; the rule below where it has none).
OLMO3 = Architecture(
    "Olmo3ForCausalLM", "olmo3", rope_layout=ROTATE_HALF, qk_norm=True, qk_norm_over_heads=True, post_norms=True,
    sliding_layers=EVERY_NTH_GLOBAL,
    defaults=dict(vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, head_dim=None, hidden_act="silu",
                  max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=500000.0,
                  attention_bias=False, sliding_window=4096, sliding_window_pattern=4, pad_token_id=1,
                  bos_token_id=None, eos_token_id=50279))

# Cohere2 (Command R7B): one LayerNorm per layer, read by attention and MLP side by side; RoPE (interleaved
# pairs, as this engine's op rotates) on the sliding layers only; logits times logit_scale; three sliding
# layers to one full.
COHERE2 = Architecture(
    "Cohere2ForCausalLM", "cohere2", layer_norm=True, parallel_block=True, nope_full_layers=True,
    gguf_rope_layout=INTERLEAVED, gguf_arch="cohere2", sliding_layers=EVERY_NTH_GLOBAL,
    config_aliases={"layer_norm_eps": "rms_norm_eps"},
    defaults=dict(vocab_size=256000, hidden_size=8192, intermediate_size=22528, num_hidden_layers=40,
                  num_attention_heads=64, num_key_value_heads=None, head_dim=None, hidden_act="silu",
                  max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=10000.0,
                  attention_bias=False, sliding_window=4096, sliding_window_pattern=4, logit_scale=0.0625,
                  pad_token_id=0, bos_token_id=5, eos_token_id=255001))

ARCHITECTURES = {a.name: a for a in (ERNIE4_5, ERNIE4_5_MOE, LLAMA, GEMMA2, GEMMA3, GPT_OSS, MISTRAL, QWEN2, QWEN3,
                                      OLMO3, COHERE2)}
ARCHITECTURES["Ernie4_5_ForCausalLM"] = ERNIE4_5  # the spelling upstream also uses for the dense model
GGUF_ARCHITECTURES = {a.gguf_arch: a for a in ARCHITECTURES.values() if a.gguf_arch}
# Activation names of config.json -> the decoder's.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"architecture {name!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[name]


# GGUF tensor names (llama.cpp's) -> checkpoint names; {i} is the layer.
GGUF_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    # Llama: the norm before the MLP is "post attention"; Gemma 3 has both, and a pre-FFN norm.
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}
# Tensors that are configuration, not weights: read by gguf_config, skipped by the weight iterator.
GGUF_CONFIG_TENSORS = {"rope_freqs.weight": "rope_freq_factors"}  # Llama 3's RoPE divisors per frequency
# Gemma 2's and Gemma 3's GGUF call the pre-FFN norm ffn_norm and the norm after attention post_attention_norm.
GGUF_TENSOR_NAMES_GEMMA3 = dict(GGUF_TENSOR_NAMES, **{
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight"})


def gguf_tensor_names(arch: Architecture) -> dict:
    return GGUF_TENSOR_NAMES_GEMMA3 if arch in (GEMMA2, GEMMA3) else GGUF_TENSOR_NAMES


# GGUF metadata key (after "{arch}.") -> config.json field.
GGUF_CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.value_length": "value_head_dim",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "context_length": "max_position_embeddings",
    "attention.sliding_window": "sliding_window",
    "vocab_size": "vocab_size",
    "rope.dimension_count": "rope_dimension_count",
}
# Metadata keys (after "{arch}.") only some GGUF architectures carry, as llama.cpp reads them -> config.json
# fields; for any other architecture they stay in GGUF_UNSUPPORTED_KEYS.
GGUF_ARCH_CONFIG_KEYS = {
    "gemma2": {"attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
    "cohere2": {"logit_scale": "logit_scale", "attention.layer_norm_epsilon": "layer_norm_eps"},
}
# Keys whose presence changes the math in a way the engine does not implement (for the architecture at hand:
# GGUF_ARCH_CONFIG_KEYS excepted). A value listed in GGUF_NEUTRAL_VALUES changes nothing and is accepted.
GGUF_UNSUPPORTED_KEYS = ("rope.scaling.type", "rope.scaling.factor", "attention.logit_softcapping",
                         "attn_logit_softcapping", "final_logit_softcapping", "logit_scale", "expert_count")
GGUF_NEUTRAL_VALUES = {"rope.scaling.type": ("none",)}  # Cohere2's converter writes "none"
# Which layers slide is not in a llama.cpp file of these architectures: llama.cpp fixes it per architecture
# (every Nth layer global, the others sliding, as the engine's EVERY_NTH_GLOBAL rule reads it) and reads no
# attention.sliding_window_pattern key for them; neither does the engine.
GGUF_SLIDING_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6, "cohere2": 4}
# Gemma's query scale has no metadata key either: llama.cpp scales by 1/sqrt(head_dim), except for the 27B
# model (known by its layer count), which it scales by 1/sqrt(hidden_size / heads) as its
# query_pre_attn_scalar says. GGUF architecture -> the 27B model's block count.
GGUF_QUERY_SCALE_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
