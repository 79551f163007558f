"""APPEND_ATTN: the paged attention backend (default), one custom-op call per layer, rank and step.

Under tensor parallelism each rank owns `H / tp` KV heads (and their query heads) and its own
cache `[num_blocks, H / tp, block_size, head_dim]`, addressed by rank-local page ids. This CPU
engine runs the ranks one after another in one process: the same arithmetic as real ranks,
without the communication.
"""

from __future__ import annotations

import paddle

from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.ops import append_attention
from fastdeploy.model_executor.layers.attention.ops.cpu_op_loader import load_cpu_ops
from fastdeploy.model_executor.layers.attention.swa_spec import swa_attention_args


class AppendAttentionBackend:
    """Owns the paged KV cache: per layer and rank, K and V of shape `[num_blocks, H/tp, block_size, head_dim]`."""

    def __init__(self, fd_config, rotary_cos: paddle.Tensor, rotary_sin: paddle.Tensor):
        model, cache = fd_config.model_config, fd_config.cache_config
        self.tp = fd_config.parallel_config.tensor_parallel_size
        self.num_heads, self.kv_num_heads, self.head_dim = (model.num_attention_heads, model.num_key_value_heads,
                                                            model.head_dim)
        self.q_per_rank, self.kv_per_rank = self.num_heads // self.tp, self.kv_num_heads // self.tp
        shape = [cache.num_gpu_blocks, self.kv_per_rank, cache.block_size, model.head_dim]

        def caches() -> list:
            return [[paddle.zeros(shape, dtype=cache.cache_dtype) for _ in range(self.tp)]
                    for _ in range(model.num_hidden_layers)]

        self.key_caches, self.value_caches = caches(), caches()
        self.rotary_cos, self.rotary_sin = rotary_cos, rotary_sin
        mask, self.window, self.sink = swa_attention_args(model)
        self.swa_head_masks = [paddle.to_tensor(mask[r * self.kv_per_rank:(r + 1) * self.kv_per_rank], dtype="int32")
                               for r in range(self.tp)]
        self._rank_columns = [self._columns(r) for r in range(self.tp)]
        load_cpu_ops()  # build (first use only) before the engine reports ready, not inside the first step

    def _columns(self, rank: int) -> paddle.Tensor:
        """qkv columns of one rank: its query heads, then its K heads, then its V heads."""
        d, q, kv = self.head_dim, self.q_per_rank, self.kv_per_rank
        k0, v0 = self.num_heads * d, (self.num_heads + self.kv_num_heads) * d
        cols = (list(range(rank * q * d, (rank + 1) * q * d)) + list(range(k0 + rank * kv * d, k0 + (rank + 1) * kv * d))
                + list(range(v0 + rank * kv * d, v0 + (rank + 1) * kv * d)))
        return paddle.to_tensor(cols, dtype="int64")

    def forward(self, layer_id: int, qkv: paddle.Tensor, meta: ForwardMeta) -> paddle.Tensor:
        head_wise = meta.block_tables_head_wise is not None
        table = meta.block_tables_head_wise if head_wise else meta.block_tables
        outs = []
        for rank in range(self.tp):
            rank_qkv = qkv if self.tp == 1 else paddle.index_select(qkv, self._rank_columns[rank], axis=1)
            rank_table = table[:, rank * self.kv_per_rank:(rank + 1) * self.kv_per_rank] \
                if head_wise and self.tp > 1 else table
            outs.append(append_attention(
                rank_qkv, self.key_caches[layer_id][rank], self.value_caches[layer_id][rank], meta.seq_lens_encoder,
                meta.seq_lens_decoder, meta.seq_lens_this_time, meta.cu_seqlens_q, rank_table, self.rotary_cos,
                self.rotary_sin, self.swa_head_masks[rank], num_heads=self.q_per_rank,
                kv_num_heads=self.kv_per_rank, head_dim=self.head_dim, sliding_window=self.window,
                sink_size=self.sink))
        return outs[0] if self.tp == 1 else paddle.concat(outs, axis=1)
