"""APPEND_ATTN: the paged attention backend (default), one custom-op call per layer and step.

Under tensor parallelism this is one rank's backend, in that rank's worker process: it owns the
rank's `H / tp` KV heads (and their query heads, which arrive as the rank's qkv columns) and the
cache `[num_blocks, H / tp, block_size, head_dim]` for them, addressed by rank-local page ids.
"""

from __future__ import annotations

import paddle

from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.ops import append_attention
from fastdeploy.model_executor.layers.attention.ops.cpu_op_loader import load_cpu_ops
from fastdeploy.model_executor.layers.attention.swa_spec import swa_attention_args
from fastdeploy.model_executor.tensor_parallel import local_kv_heads


class AppendAttentionBackend:
    """Owns one rank's paged KV cache: per layer, K and V of shape `[num_blocks, H/tp, block_size, head_dim]`."""

    def __init__(self, fd_config, rotary_cos: paddle.Tensor, rotary_sin: paddle.Tensor, tp_rank: int = 0):
        model, cache = fd_config.model_config, fd_config.cache_config
        tp = fd_config.parallel_config.tensor_parallel_size
        self.num_heads, self.kv_num_heads = model.num_attention_heads // tp, model.num_key_value_heads // tp
        self.head_dim = model.head_dim
        shape = [cache.num_gpu_blocks, self.kv_num_heads, cache.block_size, model.head_dim]
        self.key_caches = [paddle.zeros(shape, dtype=cache.cache_dtype) for _ in range(model.num_hidden_layers)]
        self.value_caches = [paddle.zeros(shape, dtype=cache.cache_dtype) for _ in range(model.num_hidden_layers)]
        self.rotary_cos, self.rotary_sin = rotary_cos, rotary_sin
        mask, self.window, self.sink = swa_attention_args(model)
        heads = local_kv_heads(model.num_key_value_heads, tp_rank, tp)
        self.swa_head_mask = paddle.to_tensor([mask[h] for h in heads], dtype="int32")
        load_cpu_ops()  # build (first use only) before the engine reports ready, not inside the first step

    def forward(self, layer_id: int, qkv: paddle.Tensor, meta: ForwardMeta) -> paddle.Tensor:
        table = meta.block_tables_head_wise if meta.block_tables_head_wise is not None else meta.block_tables
        return append_attention(
            qkv, self.key_caches[layer_id], self.value_caches[layer_id], meta.seq_lens_encoder,
            meta.seq_lens_decoder, meta.seq_lens_this_time, meta.cu_seqlens_q, table, self.rotary_cos,
            self.rotary_sin, self.swa_head_mask, num_heads=self.num_heads, kv_num_heads=self.kv_num_heads,
            head_dim=self.head_dim, sliding_window=self.window, sink_size=self.sink)
