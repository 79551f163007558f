"""The dense reference backend (NATIVE_ATTN) with per-(layer, KV head) SWA masks and a probe.

The head finder and the evaluation install it in an engine built with FD_ATTENTION_BACKEND=
NATIVE_ATTN (tensor parallel 1), so every token goes through the engine's scheduler, model and
attention semantics; only which (layer, head) pairs slide is set here, and a probe may read each
layer's queries and the cached keys/values after the layer ran.
"""

from __future__ import annotations

import numpy as np

from fastdeploy.model_executor.layers.attention.native_attn_backend import NativeAttentionBackend
from fastdeploy.model_executor.layers.rotary_embedding import apply_rope


class ProbedNativeAttention(NativeAttentionBackend):
    def __init__(self, fd_config, rotary: list, swa_masks: np.ndarray, window: int, sink: int, probe=None):
        """swa_masks: bool [num_layers, num_kv_heads] (all False = full attention everywhere). A model's own
        sliding layers (Gemma 3) keep their semantics; every other layer takes its row of the masks."""
        if fd_config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("the probed reference backend runs with tensor_parallel_size 1")
        super().__init__(fd_config, rotary)
        self.probe = probe
        group = self.num_heads // self.kv_num_heads
        windows = fd_config.model_config.layer_sliding_window
        for layer, mask in enumerate(np.asarray(swa_masks, bool)):
            if windows is None or windows[layer] is None:
                self.layer_masks[layer] = (np.repeat(mask, group), int(window), int(sink))

    def forward(self, layer_id, qkv, meta):
        out = super().forward(layer_id, qkv, meta)
        if self.probe is not None:
            self.probe(self, layer_id, qkv, meta)
        return out

    def request_tensors(self, layer_id: int, qkv, meta):
        """Per request of the step: (start, n, rotated q [n, nh, d], keys and values [start + n, nh, d]
        expanded to the query heads) — what forward() attended with."""
        nh, kvh, d = self.num_heads, self.kv_num_heads, self.head_dim
        group, row = nh // kvh, 0
        qkv = qkv.astype("float32")
        for start, n, slot in zip(meta.starts, meta.lengths, meta.slot_ids):
            q = qkv[row:row + n, :nh * d].reshape([n, nh, d])
            row += n
            cos, sin = (table[start:start + n] for table in self.rotary[layer_id])
            q = apply_rope(q, cos, sin)
            keys = self.keys[layer_id][slot, :start + n].repeat_interleave(group, axis=1)
            values = self.values[layer_id][slot, :start + n].repeat_interleave(group, axis=1)
            yield start, n, q, keys, values


def install(llm, swa_masks: np.ndarray, window: int, sink: int, probe=None) -> ProbedNativeAttention:
    """Replace the attention backend of an in-process NATIVE_ATTN engine (LLM) with a probed one."""
    fd = llm.engine.fd_config
    if fd.attention_backend != "NATIVE_ATTN":
        raise ValueError("build the engine with FD_ATTENTION_BACKEND=NATIVE_ATTN before installing masks")
    runner = llm.engine.runner.ranks
    old = runner.attn_backend
    backend = ProbedNativeAttention(fd, old.rotary, swa_masks, window, sink, probe)
    runner.attn_backend = backend
    return backend
