"""A (layer, KV head) pattern of sliding heads: one list of KV heads per layer.

`head_wise_swa.swa_kv_heads` is either one list (every layer) or one list per layer; the tools work
with the per-layer form throughout and say whether a pattern is servable by the paged engine (the
same count in every layer) or only evaluable with the dense reference's per-(layer, head) masks.
"""

from __future__ import annotations

import numpy as np


def per_layer(swa_kv_heads, num_layers: int) -> list:
    """swa_kv_heads as one sorted list per layer."""
    heads = list(swa_kv_heads)
    if heads and all(isinstance(h, (list, tuple)) for h in heads):
        if len(heads) != num_layers:
            raise ValueError(f"swa_kv_heads has {len(heads)} per-layer lists, the model has {num_layers} layers")
        return [sorted(int(h) for h in layer) for layer in heads]
    return [sorted(int(h) for h in heads) for _ in range(num_layers)]


def is_even(layers: list) -> bool:
    """Every layer slides the same number of heads: servable by the paged engine (after the load-time
    permutation that moves each layer's SWA heads to shared slots)."""
    return len({len(h) for h in layers}) == 1 and len(layers[0]) > 0


def masks(layers: list, num_kv_heads: int) -> np.ndarray:
    """bool [num_layers, num_kv_heads]: True where a (layer, KV head) slides."""
    m = np.zeros((len(layers), num_kv_heads), bool)
    for layer, heads in enumerate(layers):
        m[layer, heads] = True
    return m


def section(layers: list, window: int, sink: int) -> dict:
    """The `head_wise_swa` section for this pattern (one list when every layer agrees)."""
    uniform = all(h == layers[0] for h in layers)
    return {"sliding_window": int(window), "sink_size": int(sink),
            "swa_kv_heads": list(layers[0]) if uniform else [list(h) for h in layers]}


def lowest_per_layer(scores: np.ndarray, k: int) -> list:
    """The k heads of each layer with the lowest score (a low score = safe to slide)."""
    return [sorted(int(h) for h in np.argsort(row, kind="stable")[:k]) for row in scores]


def lowest_global(scores: np.ndarray, total: int) -> list:
    """The `total` lowest-scoring (layer, head) pairs over the whole model, as per-layer lists
    (counts may differ between layers; a layer may slide none)."""
    order = np.argsort(scores.ravel(), kind="stable")[:total]
    layers = [[] for _ in range(scores.shape[0])]
    for flat in order:
        layers[flat // scores.shape[1]].append(int(flat % scores.shape[1]))
    return [sorted(h) for h in layers]


def random_per_layer(num_layers: int, num_kv_heads: int, k: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [sorted(int(h) for h in rng.choice(num_kv_heads, size=k, replace=False)) for _ in range(num_layers)]
