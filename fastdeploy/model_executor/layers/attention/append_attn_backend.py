"""APPEND_ATTN: the paged attention backend (default), one custom-op call per layer per step."""

from __future__ import annotations

import paddle

from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.ops import append_attention
from fastdeploy.model_executor.layers.attention.ops.cpu_op_loader import load_cpu_ops
from fastdeploy.model_executor.layers.attention.swa_spec import swa_attention_args


class AppendAttentionBackend:
    """Owns the paged KV cache, `[num_blocks, H, block_size, head_dim]` per layer for K and for V."""

    def __init__(self, fd_config, rotary_cos: paddle.Tensor, rotary_sin: paddle.Tensor):
        model, cache = fd_config.model_config, fd_config.cache_config
        shape = [cache.num_gpu_blocks, model.num_key_value_heads, cache.block_size, model.head_dim]
        self.key_caches = [paddle.zeros(shape, dtype=cache.cache_dtype) for _ in range(model.num_hidden_layers)]
        self.value_caches = [paddle.zeros(shape, dtype=cache.cache_dtype) for _ in range(model.num_hidden_layers)]
        self.rotary_cos, self.rotary_sin = rotary_cos, rotary_sin
        self.num_heads, self.kv_num_heads, self.head_dim = (model.num_attention_heads, model.num_key_value_heads,
                                                            model.head_dim)
        mask, self.window, self.sink = swa_attention_args(model)
        self.swa_head_mask = paddle.to_tensor(mask, dtype="int32")
        load_cpu_ops()  # build (first use only) before the engine reports ready, not inside the first step

    def forward(self, layer_id: int, qkv: paddle.Tensor, meta: ForwardMeta) -> paddle.Tensor:
        table = meta.block_tables_head_wise if meta.block_tables_head_wise is not None else meta.block_tables
        return append_attention(
            qkv, self.key_caches[layer_id], self.value_caches[layer_id], meta.seq_lens_encoder,
            meta.seq_lens_decoder, meta.seq_lens_this_time, meta.cu_seqlens_q, table, self.rotary_cos,
            self.rotary_sin, self.swa_head_mask, num_heads=self.num_heads, kv_num_heads=self.kv_num_heads,
            head_dim=self.head_dim, sliding_window=self.window, sink_size=self.sink)
