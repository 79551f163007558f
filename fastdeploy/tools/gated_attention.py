"""Attention with one trainable gate per (layer, KV head), mixing full and streaming attention
(DuoAttention's construction): out = g * full + (1 - g) * streaming, where streaming attends to the
first `sink` positions and the last `window` (the engine's retention rule, docs/retention_rule.md) and
g in [0, 1] is the gate of the query head's KV head. g = 1 everywhere is the model as trained; a head
whose gate the optimizer drives to 0 loses nothing the model's answers need when it slides.

Registered with transformers as the attention implementation `fd_gated_swa` (eager-style float masks are
not used: the two visibility rules are built here from positions, batch 1, no padding, no KV cache).
A layer the model already slides (Gemma 3's sliding layers: the module's own `sliding_window`) keeps its
window in both branches and has no gates to learn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IMPLEMENTATION = "fd_gated_swa"


@dataclass
class Gates:
    """What every layer's attention mixes with, one object shared by the layers: the gate tensor
    [layers, kv_heads] (clamped to [0, 1] where it is read; a layer reads its `layer_idx` row), the
    streaming rule, and `mixing` (False: every layer attends as trained, the distillation target)."""
    values: torch.Tensor
    window: int
    sink: int
    mixing: bool = True


def _attend(scores: torch.Tensor, visible: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.matmul(probs, values)


def gated_swa_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' attention-function signature: query [b, heads, q, d], key/value [b, kv_heads, k, d];
    returns ([b, q, heads, d], None)."""
    groups = query.shape[1] // key.shape[1]
    keys = key.repeat_interleave(groups, dim=1)
    values = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scaling
    q_len, k_len = scores.shape[-2:]
    q_pos = torch.arange(k_len - q_len, k_len, device=scores.device)[:, None]
    k_pos = torch.arange(k_len, device=scores.device)[None, :]
    visible = k_pos <= q_pos
    own_window = getattr(module, "sliding_window", None)
    if own_window:
        visible = visible & (k_pos > q_pos - own_window)
    full = _attend(scores, visible, values)
    gates: Gates | None = getattr(module, "fd_gates", None)
    if gates is None or not gates.mixing or own_window:
        out = full
    else:
        streaming = visible & ((k_pos < gates.sink) | (k_pos > q_pos - gates.window))
        stream = _attend(scores, streaming, values)
        gate = gates.values[module.layer_idx].clamp(0.0, 1.0).repeat_interleave(groups)[None, :, None, None]
        out = full - (1.0 - gate) * (full - stream)  # exactly `full` at g = 1: no rounding to chase
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `fd_gated_swa` an attention implementation transformers' models can be switched to."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    AttentionInterface.register(IMPLEMENTATION, gated_swa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, eager_mask)  # built by the model, not read here


def install(model, gates: Gates) -> list:
    """Switch `model` to the gated attention with `gates`; returns the (layer, KV head) pairs whose gates
    matter (layers the model does not already slide)."""
    register()
    model.config._attn_implementation = IMPLEMENTATION
    candidates = []
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        attn.config._attn_implementation = IMPLEMENTATION
        attn.fd_gates = gates
        if not getattr(attn, "sliding_window", None):
            candidates += [(index, h) for h in range(gates.values.shape[1])]
    return candidates
