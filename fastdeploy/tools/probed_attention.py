"""The dense reference backend (NATIVE_ATTN) with per-(layer, KV head) SWA masks and a probe.

The head finder and the evaluation install it in an engine built with FD_ATTENTION_BACKEND=
NATIVE_ATTN (tensor parallel 1), so every token goes through the engine's scheduler, model and
attention semantics; only which (layer, head) pairs slide is set here, and a probe may read each
layer's queries and the cached keys/values after the layer ran.
"""

from __future__ import annotations

import numpy as np

from fastdeploy.model_executor.layers.attention.native_attn_backend import NativeAttentionBackend, \
    query_head_windows
from fastdeploy.model_executor.layers.rotary_embedding import apply_rope


def pair_windows(swa_masks, window, sink) -> tuple:
    """(windows, sinks) int64 [num_layers, num_kv_heads], window 0 = full attention, from either
    description of which (layer, KV head) pairs slide:
    - swa_masks bool [L, H] with one `window` and `sink` for every sliding pair (window an int);
    - swa_masks int [L, H] holding each pair's own window (0 = full) with `window` None, and `sink`
      an int or an int [L, H] of each pair's sink."""
    masks = np.asarray(swa_masks)
    if masks.ndim != 2:
        raise ValueError(f"swa_masks must be [num_layers, num_kv_heads], got shape {masks.shape}")
    if window is None:
        windows = masks.astype(np.int64)
    else:
        if int(window) < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        windows = np.where(masks.astype(bool), int(window), 0).astype(np.int64)
    sinks = np.asarray(sink, np.int64)
    if sinks.ndim == 0:
        sinks = np.full(windows.shape, int(sinks), np.int64)
    elif sinks.shape != windows.shape:
        raise ValueError(f"sink must be an int or [num_layers, num_kv_heads] = {list(windows.shape)}, got "
                         f"{list(sinks.shape)}")
    if (windows < 0).any() or (sinks < 0).any():
        raise ValueError("windows and sinks must be >= 0 (window 0 = full attention)")
    return windows, np.where(windows > 0, sinks, 0)


class ProbedNativeAttention(NativeAttentionBackend):
    def __init__(self, fd_config, rotary: list, swa_masks: np.ndarray, window, sink, probe=None):
        """swa_masks, window, sink: which pairs slide, with which window and sink (pair_windows: bool
        masks with one window and sink, or each pair's own windows and sinks; all full = full attention
        everywhere). A model's own sliding layers (Gemma 3) keep their semantics; every other layer takes
        its row."""
        if fd_config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("the probed reference backend runs with tensor_parallel_size 1")
        super().__init__(fd_config, rotary)
        self.probe = probe
        group = self.num_heads // self.kv_num_heads
        layer_windows = fd_config.model_config.layer_sliding_window
        windows, sinks = pair_windows(swa_masks, window, sink)
        for layer in range(windows.shape[0]):
            if layer_windows is None or layer_windows[layer] is None:
                self.layer_masks[layer] = query_head_windows(windows[layer], sinks[layer], group)

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


def install(llm, swa_masks: np.ndarray, window, sink, probe=None) -> ProbedNativeAttention:
    """Replace the attention backend of an in-process NATIVE_ATTN engine (LLM) with a probed one.
    (swa_masks, window, sink) as pair_windows takes them: bool masks with one window and sink, or
    int windows per (layer, KV head) with window=None and a sink or sinks per pair."""
    fd = llm.engine.fd_config
    if fd.attention_backend != "NATIVE_ATTN":
        raise ValueError("build the engine with FD_ATTENTION_BACKEND=NATIVE_ATTN before installing masks")
    runner = llm.engine.runner.ranks
    old = runner.attn_backend
    backend = ProbedNativeAttention(fd, old.rotary, swa_masks, window, sink, probe)
    runner.attn_backend = backend
    return backend
