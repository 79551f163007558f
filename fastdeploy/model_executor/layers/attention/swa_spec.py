"""The model's attention semantics as kernel arguments: which KV heads slide, window, sink.

These are a *model* property (docs/architecture.md): identical in every memory mode, so both backends read
them from the model config, never from the head-wise flags.
"""


def swa_attention_args(model_config) -> tuple:
    """(mask with 1 per SWA KV head, window, sink); a model without SWA heads gets an all-zero mask."""
    spec = model_config.head_wise_swa
    mask = [0] * model_config.num_key_value_heads
    if spec is None:
        return mask, 1, 0
    for h in spec.swa_kv_heads:
        mask[h] = 1
    return mask, spec.sliding_window, spec.sink_size
