"""Float64 numpy reference of the AppendAttention op contract (docs/op_contract.md).

Deliberately simple and unpaged in its math: it reads the prior K/V of every
request through the block table into dense per-head arrays (positions whose
table entry is -1 stay NaN and are never selected by the mask), applies RoPE to
the new tokens, writes them into a copy of the cache, and computes the masked
softmax attention with explicit index sets. Used only by tests.
"""

from __future__ import annotations

import numpy as np


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest-even), returned as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x), np.float32(np.nan), out)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Interleaved (ERNIE-style) RoPE; x [..., D], cos/sin [..., D/2] broadcastable."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x1 * cos + x0 * sin
    return out


def head_window_array(kv_heads: int, window: int, sink: int, swa_heads) -> np.ndarray:
    """The op's head_windows [2, kv_heads] where the KV heads `swa_heads` slide with (window, sink) and
    the others are full (window 0, sink 0)."""
    rows = np.zeros((2, kv_heads), np.int32)
    rows[0, list(swa_heads)] = window
    rows[1, list(swa_heads)] = sink
    return rows


def head_window_pairs(head_windows) -> list[tuple[int, int]]:
    """(window, sink) of every KV head from the op's head_windows [2, H] (docs/op_contract.md): row 0
    each head's window, row 1 its sink. Window 0 = a full head."""
    m = np.asarray(head_windows)
    assert m.ndim == 2 and m.shape[0] == 2, f"head_windows must be [2, kv_heads], got {m.shape}"
    return [(int(w), int(s)) for w, s in zip(m[0], m[1])]


def visible(t: int, j: np.ndarray, swa: bool, window: int, sink: int) -> np.ndarray:
    causal = j <= t
    if not swa:
        return causal
    return causal & ((j < sink) | (j > t - window))


def page_id(table: np.ndarray, r: int, h: int, i: int, kv_heads: int) -> int:
    if table.ndim == 3:
        return int(table[r, h, i])
    b = int(table[r, i])
    return -1 if b < 0 else b * kv_heads + h


def reference_append_attention(
    qkv, key_cache, value_cache, seq_lens_decoder, seq_lens_this_time, cu_seqlens_q,
    block_tables, rotary_cos, rotary_sin, head_windows, *, num_heads, kv_num_heads,
    head_dim, cache_is_bf16=False, caches_hold_new_rows=False, attention_sinks=None, softcap=0.0,
):
    """Returns (out float64 [T, num_heads*D], expected key cache, expected value cache).

    Caches are float32 numpy arrays [num_blocks, H, bs, D] (bf16 caches passed
    as their exact float32 values); the expected caches have the same dtype.
    ``caches_hold_new_rows``: the caches already hold the step's K/V rows (e.g. the
    dequantized rows an op wrote into quantized pages), so pass 1 writes nothing.
    ``attention_sinks`` ([num_heads] or None): a logit per query head in each softmax's denominator and
    nowhere else; ``softcap`` > 0: every scaled score s becomes softcap * tanh(s / softcap) first.
    """
    d, kvh = head_dim, kv_num_heads
    group = num_heads // kvh
    bs = key_cache.shape[2]
    store = round_to_bf16 if cache_is_bf16 else (lambda a: a.astype(np.float32))
    k_pages = key_cache.reshape(-1, bs, d).copy()
    v_pages = value_cache.reshape(-1, bs, d).copy()
    x = qkv.astype(np.float64)
    out = np.zeros((qkv.shape[0], num_heads * d), np.float64)
    scale = 1.0 / np.sqrt(d)

    # Pass 1: write every request's new rows (a query may see only its own
    # request's keys, so the order of requests does not matter).
    for r in range(0 if caches_hold_new_rows else len(seq_lens_this_time)):
        n, c, row0 = int(seq_lens_decoder[r]), int(seq_lens_this_time[r]), int(cu_seqlens_q[r])
        pos = np.arange(n, n + c)
        cos, sin = rotary_cos[pos].astype(np.float64), rotary_sin[pos].astype(np.float64)
        for h in range(kvh):
            k_new = rope(x[row0:row0 + c, (num_heads + h) * d:(num_heads + h + 1) * d], cos, sin)
            v_new = x[row0:row0 + c, (num_heads + kvh + h) * d:(num_heads + kvh + h + 1) * d]
            for j, t in enumerate(pos):
                p = page_id(block_tables, r, h, t // bs, kvh)
                assert p >= 0, "reference: destination page is -1"
                k_pages[p, t % bs] = store(k_new[j].astype(np.float32))
                v_pages[p, t % bs] = store(v_new[j].astype(np.float32))

    # Pass 2: dense attention per request and KV head, each head with its own window and sink.
    windows = head_window_pairs(head_windows)
    for r in range(len(seq_lens_this_time)):
        n, c, row0 = int(seq_lens_decoder[r]), int(seq_lens_this_time[r]), int(cu_seqlens_q[r])
        if c == 0:
            continue
        total = n + c
        pos = np.arange(n, total)
        cos, sin = rotary_cos[pos].astype(np.float64), rotary_sin[pos].astype(np.float64)
        keys = np.arange(total)
        for h in range(kvh):
            k_all = np.full((total, d), np.nan)
            v_all = np.full((total, d), np.nan)
            for t in range(total):
                p = page_id(block_tables, r, h, t // bs, kvh)
                if p >= 0:
                    k_all[t] = k_pages[p, t % bs]
                    v_all[t] = v_pages[p, t % bs]
            for g in range(group):
                qh = h * group + g
                q = rope(x[row0:row0 + c, qh * d:(qh + 1) * d], cos, sin)
                for j, t in enumerate(pos):
                    w_h, s_h = windows[h]
                    sel = keys[visible(int(t), keys, w_h > 0, w_h, s_h)]
                    s = k_all[sel] @ q[j] * scale
                    if softcap:
                        s = softcap * np.tanh(s / softcap)
                    sink = -np.inf if attention_sinks is None else float(attention_sinks[qh])
                    top = max(s.max(), sink)
                    w = np.exp(s - top)
                    out[row0 + j, qh * d:(qh + 1) * d] = (w / (w.sum() + np.exp(sink - top))) @ v_all[sel]
    return out, k_pages.reshape(key_cache.shape), v_pages.reshape(value_cache.shape)
