"""Rotary position embedding, interleaved pairs (ERNIE style): (x[2i], x[2i+1]) rotate by t * theta^(-2i/d)."""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy.model_executor.layers.rope_scaling import inverse_frequencies


def rope_tables(head_dim: int, max_position: int, theta, divisors=None, attention_factor: float = 1.0) -> tuple:
    """cos and sin, float32 [max_position, head_dim // 2]; computed in float64 so every backend shares them.
    `divisors`: one per frequency (RoPE scaling, layers/rope_scaling.py). `theta` None: no rotation (a layer
    without positional encoding, Cohere2's full ones): cos 1 and sin 0 leave q and k exactly as they are.
    `attention_factor` scales cos and sin (YaRN's: q and k both grow by it, scores by its square)."""
    if theta is None:
        return (paddle.ones([max_position, head_dim // 2], dtype="float32"),
                paddle.zeros([max_position, head_dim // 2], dtype="float32"))
    inv_freq = inverse_frequencies(head_dim, theta)
    if divisors is not None:
        inv_freq = inv_freq / np.asarray(divisors, np.float64)
    angles = np.outer(np.arange(max_position, dtype=np.float64), inv_freq)
    return (paddle.to_tensor((np.cos(angles) * attention_factor).astype(np.float32)),
            paddle.to_tensor((np.sin(angles) * attention_factor).astype(np.float32)))


def layer_rope_tables(model_config) -> list:
    """(cos, sin) per layer, one table per distinct base and scaling (Gemma 3's sliding layers use a local base,
    OLMo 3's RoPE scaling applies to its full layers only; a base None: a layer without RoPE)."""
    layers = model_config.num_hidden_layers
    thetas = model_config.layer_rope_theta or (model_config.rope_theta,) * layers
    scaled = model_config.rope_scaled_layers or (True,) * layers  # the RoPE scaling's layers (OLMo 3: full ones)
    tables = {}
    for key in set(zip(thetas, scaled)):
        theta, with_scaling = key
        tables[key] = rope_tables(model_config.head_dim, model_config.max_model_len, theta,
                                  model_config.rope_freq_divisors if with_scaling else None,
                                  model_config.rope_attention_factor if with_scaling else 1.0)
    return [tables[key] for key in zip(thetas, scaled)]


def apply_rope(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """x [tokens, heads, head_dim]; cos/sin [tokens, head_dim // 2] already gathered at the positions."""
    tokens, heads, dim = x.shape
    pairs = x.reshape([tokens, heads, dim // 2, 2])
    even, odd = pairs[..., 0], pairs[..., 1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return paddle.stack([even * c - odd * s, odd * c + even * s], axis=-1).reshape([tokens, heads, dim])
