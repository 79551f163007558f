"""The model's attention semantics: which (layer, KV head) pairs slide, with which window and sink.

These are a *model* property (docs/architecture.md): identical in every memory mode, so both backends
and the slot layout read them from the model config, never from the head-wise flags. Head indices are
in the load-time order. Two sources:
- sliding *layers* (`ModelConfig.layer_sliding_window`, one window or None per layer: Gemma 3 and
  other models trained with sliding layers): every KV head of such a layer slides, sink 0;
- head-wise SWA (`head_wise_swa`: window, sink and the KV heads that slide, in every layer or one
  list per layer, optionally a window and sink per listed head): it applies to the heads of the layers
  that do not slide as a whole.
"""

from __future__ import annotations

from fastdeploy.cache_manager.slots import FULL, AttentionType


def attention_type_table(model_config) -> tuple:
    """types[layer][kv_head] of the whole model (global KV heads, load-time order): the input of the
    slot layout (cache_manager/slots.py) and of both backends' per-layer kernel arguments."""
    return type_table(model_config.num_hidden_layers, model_config.num_key_value_heads,
                      model_config.layer_sliding_window, model_config.head_wise_swa)


def type_table(num_layers: int, num_heads: int, layer_windows, spec) -> tuple:
    """attention_type_table from its parts: per-layer sliding windows (None, or a window or None per
    layer) and a HeadWiseSWAConfig (or None). Tools that size pages for a spec without loading the model
    (benchmarks/eval_swa_quality.py) call it with the engine's own rule."""
    windows = layer_windows or (None,) * num_layers
    table = []
    for layer in range(num_layers):
        if windows[layer] is not None:
            table.append((AttentionType(int(windows[layer]), 0),) * num_heads)
            continue
        row = [FULL] * num_heads
        for h in (spec.heads_of_layer(layer) if spec is not None else ()):
            row[h] = AttentionType(*spec.head_type(layer, h))  # each pair its own window and sink (§17)
        table.append(tuple(row))
    return tuple(table)


def layer_attention_args(model_config, layer: int) -> tuple:
    """(windows, sinks) of one layer, every KV head of the model (row_attention_args)."""
    return row_attention_args(attention_type_table(model_config)[layer])


def row_attention_args(row) -> tuple:
    """(windows, sinks) of one layer's row of the type table (or some of its heads): one window per
    head, 0 for a full head, and its sink (0 for a full head). The op's head_windows [2, kv_heads]
    is exactly these two rows (docs/op_contract.md), so a layer may mix full heads with any number of
    sliding types."""
    windows = [int(t.window) if t.sliding else 0 for t in row]
    sinks = [int(t.sink) if t.sliding else 0 for t in row]
    return windows, sinks
