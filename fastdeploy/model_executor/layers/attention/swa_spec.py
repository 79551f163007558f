"""The model's attention semantics as kernel arguments: which KV heads slide, window, sink.

These are a *model* property (docs/architecture.md): identical in every memory mode, so both backends read
them from the model config, never from the head-wise flags. Head indices are in the load-time order.
"""


def layer_attention_args(model_config, layer: int) -> tuple:
    """(mask, window, sink) of one layer: a sliding layer (Gemma 3) slides every head with its window and
    no sink; any other layer has its head-wise SWA heads of `head_wise_swa` (any per-layer pattern)."""
    windows = model_config.layer_sliding_window
    if windows is not None and windows[layer] is not None:
        return [1] * model_config.num_key_value_heads, windows[layer], 0
    masks, window, sink = swa_layer_masks(model_config)
    return masks[layer], window, sink


def swa_attention_args(model_config) -> tuple:
    """(mask with 1 per SWA KV head, window, sink) for a model whose layers share one SWA head set
    (the paged backend's kernel takes one mask); a model without SWA heads gets an all-zero mask."""
    spec = model_config.head_wise_swa
    if spec is not None and not spec.same_in_every_layer:
        raise ValueError("head_wise_swa: the paged attention backend needs the same SWA KV heads in every layer "
                         "(start-up permutes per-layer heads into shared slots; see swa_head_placement.py)")
    masks, window, sink = swa_layer_masks(model_config)
    return masks[0], window, sink


def swa_layer_masks(model_config) -> tuple:
    """([per layer: mask with 1 per SWA KV head], window, sink): any (layer, head) pattern."""
    spec = model_config.head_wise_swa
    masks = []
    for layer in range(model_config.num_hidden_layers):
        mask = [0] * model_config.num_key_value_heads
        for h in model_config.layer_swa_kv_heads(layer):
            mask[h] = 1
        masks.append(mask)
    if spec is None:
        return masks, 1, 0
    return masks, spec.sliding_window, spec.sink_size
