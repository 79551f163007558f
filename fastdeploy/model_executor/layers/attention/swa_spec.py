"""The model's attention semantics as kernel arguments: which KV heads slide, window, sink.

These are a *model* property (docs/architecture.md): identical in every memory mode, so both backends read
them from the model config, never from the head-wise flags.
"""


def layer_attention_args(model_config, layer: int) -> tuple:
    """(mask, window, sink) of one layer: a sliding layer (Gemma 3) slides every head with its window and
    no sink; any other layer has the head-wise SWA heads of `head_wise_swa`."""
    windows = model_config.layer_sliding_window
    if windows is not None and windows[layer] is not None:
        return [1] * model_config.num_key_value_heads, windows[layer], 0
    return swa_attention_args(model_config)


def swa_attention_args(model_config) -> tuple:
    """(mask with 1 per SWA KV head, window, sink); a model without SWA heads gets an all-zero mask."""
    spec = model_config.head_wise_swa
    mask = [0] * model_config.num_key_value_heads
    if spec is None:
        return mask, 1, 0
    for h in spec.swa_kv_heads:
        mask[h] = 1
    return mask, spec.sliding_window, spec.sink_size
