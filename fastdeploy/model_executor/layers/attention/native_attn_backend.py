"""NATIVE_ATTN: dense, unpaged attention in plain Paddle ops — the oracle for every paged path.

Under tensor parallelism it holds one rank's heads, like the paged backend.
Each running request keeps its rotated K and its V in a dense per-slot buffer
`[max_num_seqs, max_model_len, H, head_dim]`; every query scores every key of its request and the
SWA rule of docs/retention_rule.md is applied as a mask, each query head with its KV head's own window
and sink; soft-capping (Gemma 2) is a tanh on the scores, a learned sink logit (gpt-oss) one more
column of the softmax that no value row follows. Slow on purpose: nothing here is clever.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import paddle.nn.functional as F

from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.host_tensor import host_tensor
from fastdeploy.model_executor.layers.attention.swa_spec import layer_attention_args
from fastdeploy.model_executor.layers.rotary_embedding import apply_rope
from fastdeploy.model_executor.tensor_parallel import local_kv_heads


def query_head_windows(windows, sinks, group: int) -> tuple:
    """(windows, sinks) int64 [num_heads] of the query heads from their KV heads' (group query heads a
    KV head, in order)."""
    return (np.repeat(np.asarray(windows, np.int64), group), np.repeat(np.asarray(sinks, np.int64), group))


class NativeAttentionBackend:
    def __init__(self, fd_config, rotary: list, tp_rank: int = 0, attention_sinks=None):
        model = fd_config.model_config
        tp = fd_config.parallel_config.tensor_parallel_size
        shape = [fd_config.scheduler_config.max_num_seqs, model.max_model_len, model.num_key_value_heads // tp,
                 model.head_dim]
        self.keys = [paddle.zeros(shape, dtype="float32") for _ in range(model.num_hidden_layers)]
        self.values = [paddle.zeros(shape, dtype="float32") for _ in range(model.num_hidden_layers)]
        self.rotary = rotary
        self.softcap = float(model.attn_logit_softcapping)
        self.layer_sinks = attention_sinks or [None] * model.num_hidden_layers
        self.num_heads, self.kv_num_heads, self.head_dim = (model.num_attention_heads // tp,
                                                            model.num_key_value_heads // tp, model.head_dim)
        group = self.num_heads // self.kv_num_heads
        heads = local_kv_heads(model.num_key_value_heads, tp_rank, tp)  # this rank's heads
        # Per layer: (window, sink) of every query head, its KV head's (window 0 = full attention).
        self.layer_masks = []
        for layer in range(model.num_hidden_layers):
            windows, sinks = layer_attention_args(model, layer)
            self.layer_masks.append(query_head_windows([windows[h] for h in heads], [sinks[h] for h in heads], group))

    def visibility(self, start: int, num_new: int, layer_id: int = 0) -> paddle.Tensor:
        """[num_heads, num_new, start + num_new] bool: docs/retention_rule.md, per query head.

        Built from aranges in Paddle: handing Paddle a numpy mask this size copies it through a Python
        list (paddle.assign), which took seconds per layer on long prompts."""
        windows, sinks = self.layer_masks[layer_id]
        t = paddle.arange(start, start + num_new, dtype="int64").unsqueeze(1)
        j = paddle.arange(start + num_new, dtype="int64").unsqueeze(0)
        causal = (j <= t).unsqueeze(0)
        window = host_tensor(windows.reshape(-1, 1, 1))
        sink = host_tensor(sinks.reshape(-1, 1, 1))
        # A full head (window 0) sees every earlier key; a sliding one its sink and its window.
        in_reach = (window == 0) | (j.unsqueeze(0) < sink) | ((t - j).unsqueeze(0) < window)
        return causal & in_reach

    def forward(self, layer_id: int, qkv: paddle.Tensor, meta: ForwardMeta) -> paddle.Tensor:
        nh, kvh, d = self.num_heads, self.kv_num_heads, self.head_dim
        group = nh // kvh
        outs, row = [], 0
        compute_dtype = qkv.dtype
        qkv = qkv if compute_dtype == paddle.float32 else qkv.astype("float32")  # the oracle works in float32
        for start, n, slot in zip(meta.starts, meta.lengths, meta.slot_ids):
            x = qkv[row:row + n]
            row += n
            q = x[:, :nh * d].reshape([n, nh, d])
            k = x[:, nh * d:(nh + kvh) * d].reshape([n, kvh, d])
            v = x[:, (nh + kvh) * d:].reshape([n, kvh, d])
            cos, sin = (table[start:start + n] for table in self.rotary[layer_id])
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            self.keys[layer_id][slot, start:start + n] = k
            self.values[layer_id][slot, start:start + n] = v
            keys = self.keys[layer_id][slot, :start + n].repeat_interleave(group, axis=1)    # [L, nh, d]
            values = self.values[layer_id][slot, :start + n].repeat_interleave(group, axis=1)
            scores = paddle.matmul(q.transpose([1, 0, 2]), keys.transpose([1, 2, 0])) / math.sqrt(d)
            if self.softcap:
                scores = paddle.tanh(scores / self.softcap) * self.softcap
            visible = self.visibility(start, n, layer_id)
            scores = paddle.where(visible, scores, paddle.full_like(scores, float("-inf")))
            sinks = self.layer_sinks[layer_id]
            if sinks is None:
                probs = F.softmax(scores, axis=-1)                                          # [nh, n, L]
            else:  # the sink's column takes its share of each row's mass, then is dropped
                column = sinks.astype("float32").reshape([nh, 1, 1]).expand([nh, n, 1])
                probs = F.softmax(paddle.concat([scores, column], axis=-1), axis=-1)[:, :, :-1]
            out = paddle.matmul(probs, values.transpose([1, 0, 2]))                         # [nh, n, d]
            outs.append(out.transpose([1, 0, 2]).reshape([n, nh * d]))
        out = paddle.concat(outs, axis=0)
        return out if compute_dtype == paddle.float32 else out.astype(compute_dtype)
