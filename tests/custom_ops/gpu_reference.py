"""Float64 reference of AppendAttention and random case builder for the CUDA kernel tests.

Written straight from the op contract (docs/op_contract.md: visibility rule, RoPE pairs, table modes), independent of
the kernels' page-walking arithmetic: it gathers exactly the keys each query may see and raises
if one of them sits behind a -1 entry.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import gpu_harness
from gpu_harness import BF16, Case, from_storage, storage_nan, to_storage
from reference_attention import head_window_array, head_window_pairs
from reference_kv_quant import quantized_pages

# kv_cache_quant_type -> AppendAttnCacheQuant
QUANT = {"int8": gpu_harness.CACHE_INT8, "block_wise_fp8": gpu_harness.CACHE_FP8_E4M3,
         "block_wise_int4": gpu_harness.CACHE_INT4, "k8v4": gpu_harness.CACHE_K8V4}


# Per-head windows (build_case's head_windows) for 4 KV heads: a full head and three sliding types, a
# sink shorter than a block of 16, one longer, and none.
MIXED_HEAD_WINDOWS = ((24, 5), (0, 0), (70, 20), (33, 0))


class DeadEntryNeeded(LookupError):
    pass


def rotary_tables(max_position: int, head_dim: int, theta: float = 10000.0):
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(max_position, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 1::2] * cos + x[..., 0::2] * sin
    return out


def visible(q_pos: np.ndarray, k_pos: np.ndarray, swa: bool, window: int, sink: int):
    q = np.asarray(q_pos)[:, None]
    k = np.asarray(k_pos)[None, :]
    vis = k <= q
    if swa:
        vis &= (k < sink) | (k > q - window)
    return vis


def reference(case: Case):
    """Returns (out [token_num, num_heads, head_dim], key_cache, value_cache) in float64;
    the caches as the kernel must leave them (new K rotated and rounded to storage)."""
    p = case.params
    dtype = p["dtype"]
    nh, kvh, d, bs = p["num_heads"], p["kv_num_heads"], p["head_dim"], p["block_size"]
    group = nh // kvh
    head_wise = bool(p["head_wise_table"])
    tables = case.block_tables
    kc = from_storage(case.key_cache, dtype).astype(np.float64)
    vc = from_storage(case.value_cache, dtype).astype(np.float64)
    k_pages = kc.reshape(-1, bs, d)  # views: writes land in kc / vc
    v_pages = vc.reshape(-1, bs, d)
    qkv = from_storage(case.qkv, dtype).astype(np.float64)
    cos = case.rotary_cos.astype(np.float64)
    sin = case.rotary_sin.astype(np.float64)

    def page_of(r: int, h: int, blk: int) -> int:
        entry = int(tables[r, h, blk] if head_wise else tables[r, blk])
        if entry < 0:
            raise DeadEntryNeeded(f"request {r}, kv head {h}, block index {blk}")
        return entry if head_wise else entry * kvh + h

    def round_storage(x: np.ndarray) -> np.ndarray:
        return from_storage(to_storage(x.astype(np.float32), dtype), dtype).astype(np.float64)

    bsz = len(case.seq_lens_this_time)
    q_rot = np.zeros((qkv.shape[0], nh, d))
    for r in range(bsz):
        for j in range(int(case.seq_lens_this_time[r])):
            tok = int(case.cu_seqlens_q[r]) + j
            t = int(case.seq_lens_decoder[r]) + j
            row = qkv[tok]
            q_rot[tok] = _rotate(row[: nh * d].reshape(nh, d), cos[t], sin[t])
            k = _rotate(row[nh * d : (nh + kvh) * d].reshape(kvh, d), cos[t], sin[t])
            v = row[(nh + kvh) * d :].reshape(kvh, d)
            for h in range(kvh):
                page = page_of(r, h, t // bs)
                k_pages[page, t % bs] = round_storage(k[h])
                v_pages[page, t % bs] = v[h]

    out = np.zeros((qkv.shape[0], nh, d))
    scale = 1.0 / np.sqrt(d)
    windows = head_window_pairs(case.head_windows)
    softcap = float(p.get("softcap", 0.0))  # Gemma 2: scores soft-capped before the mask
    sinks = case.attention_sinks  # gpt-oss: a logit per q head in the denominator only
    for r in range(bsz):
        n = int(case.seq_lens_this_time[r])
        if n == 0:
            continue
        tok0 = int(case.cu_seqlens_q[r])
        q_pos = int(case.seq_lens_decoder[r]) + np.arange(n)
        k_pos = np.arange(q_pos[-1] + 1)
        for h in range(kvh):
            w_h, s_h = windows[h]  # the head's own window and sink
            vis = visible(q_pos, k_pos, w_h > 0, w_h, s_h)
            needed = np.flatnonzero(vis.any(axis=0))
            keys = np.zeros((len(k_pos), d))
            vals = np.zeros((len(k_pos), d))
            for j in needed:
                page = page_of(r, h, int(j) // bs)
                keys[j] = k_pages[page, j % bs]
                vals[j] = v_pages[page, j % bs]
            for g in range(group):
                qh = h * group + g
                s = q_rot[tok0 : tok0 + n, qh] @ keys.T * scale
                if softcap:
                    s = softcap * np.tanh(s / softcap)
                s = np.where(vis, s, -np.inf)
                sink = -np.inf if sinks is None else float(sinks[qh])
                top = np.maximum(s.max(axis=1, keepdims=True), sink)
                w = np.exp(s - top)
                w /= w.sum(axis=1, keepdims=True) + np.exp(sink - top)
                out[tok0 : tok0 + n, qh] = w @ vals
    return out, kc, vc


def dead_blocks(processed: int, window: int, sink: int, block_size: int) -> list[int]:
    """Blocks of a SWA head the retention rule (docs/retention_rule.md) lets the scheduler recycle."""
    first = -(-sink // block_size)
    dead = []
    i = first
    while (i + 1) * block_size <= processed - window + 1:
        dead.append(i)
        i += 1
    return dead


def build_case(
    rng: np.random.Generator,
    requests: list[tuple[int, int]],
    *,
    dtype: int = BF16,
    num_heads: int = 8,
    kv_num_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    window: int = 32,
    sink: int = 4,
    swa_heads: tuple[int, ...] = (0,),
    head_wise: bool = True,
    scatter: bool = True,
    recycle: bool = True,
    spare_blocks: int = 3,
    head_windows: tuple[tuple[int, int], ...] | None = None,
) -> Case:
    """A random step. requests = [(cached tokens, new tokens)]; (n, 0) is an idle slot.

    Cache memory starts as NaN everywhere except the cached tokens, so a kernel that reads an
    unwritten row, a recycled page or a foreign page turns the output into NaN. Head-wise tables
    hand out pages in random order across all heads' home lists (scatter) and, with recycle,
    mark the SWA heads' dead blocks -1. The op's head_windows [2, kv_num_heads]: the heads
    `swa_heads` slide with (window, sink), the others are full; or, given head_windows, one (window,
    sink) per KV head (window 0 = full; swa_heads, window and sink then unused). Each head recycles
    with its own pair.
    """
    kvh, d, bs = kv_num_heads, head_dim, block_size
    bsz = len(requests)
    cached = np.array([c for c, _ in requests], dtype=np.int32)
    new = np.array([n for _, n in requests], dtype=np.int32)
    need = [-(-(c + n) // bs) for c, n in requests]
    max_blocks = max(max(need), 1) + 1
    num_blocks = sum(need) + spare_blocks
    token_num = int(new.sum())

    blocks = rng.permutation(num_blocks) if scatter else np.arange(num_blocks)
    block_of = []  # per request, 1-D block ids
    cursor = 0
    for r in range(bsz):
        block_of.append(blocks[cursor : cursor + need[r]])
        cursor += need[r]
    if head_wise:
        tables = np.full((bsz, kvh, max_blocks), -1, dtype=np.int32)
        pages = rng.permutation(num_blocks * kvh)
        cursor = 0
        for r in range(bsz):
            for h in range(kvh):
                if scatter:
                    tables[r, h, : need[r]] = pages[cursor : cursor + need[r]]
                    cursor += need[r]
                else:
                    tables[r, h, : need[r]] = block_of[r] * kvh + h
    else:
        tables = np.full((bsz, max_blocks), -1, dtype=np.int32)
        for r in range(bsz):
            tables[r, : need[r]] = block_of[r]

    key_cache = storage_nan((num_blocks, kvh, bs, d), dtype)
    value_cache = storage_nan((num_blocks, kvh, bs, d), dtype)
    k_pages = key_cache.reshape(-1, bs, d)
    v_pages = value_cache.reshape(-1, bs, d)
    if head_windows is None:
        windows = head_window_array(kvh, window, sink, swa_heads)
    else:
        windows = np.array([(int(w), int(s)) for w, s in head_windows], dtype=np.int32).T.copy()
    pairs = head_window_pairs(windows)
    for r in range(bsz):
        for h in range(kvh):
            dead = set()
            if head_wise and recycle and pairs[h][0] > 0:
                dead = set(dead_blocks(int(cached[r]), pairs[h][0], pairs[h][1], bs))
            for blk in range(need[r]):
                entry = int(tables[r, h, blk] if head_wise else tables[r, blk])
                page = entry if head_wise else entry * kvh + h
                rows = min(bs, int(cached[r]) - blk * bs)
                if blk in dead:
                    tables[r, h, blk] = -1  # page stays NaN: it must never be read
                elif rows > 0:
                    k_pages[page, :rows] = to_storage(rng.standard_normal((rows, d)), dtype)
                    v_pages[page, :rows] = to_storage(rng.standard_normal((rows, d)), dtype)

    qkv = rng.standard_normal((token_num, (num_heads + 2 * kvh) * d))
    qkv[:, : num_heads * d] *= 1.5  # sharper softmax than unit-variance scores
    max_position = int((cached + new).max()) + 8
    cos, sin = rotary_tables(max_position, d)
    cu = np.zeros(bsz + 1, dtype=np.int32)
    cu[1:] = np.cumsum(new)
    params = dict(
        dtype=dtype,
        token_num=token_num,
        bsz=bsz,
        num_heads=num_heads,
        kv_num_heads=kvh,
        head_dim=d,
        block_size=bs,
        num_blocks=num_blocks,
        max_blocks_per_seq=max_blocks,
        head_wise_table=int(head_wise),
        max_position=max_position,
        visit_all_pages=0,
        dual_pass=0,
    )
    return Case(
        params=params,
        qkv=to_storage(qkv, dtype),
        key_cache=key_cache,
        value_cache=value_cache,
        seq_lens_encoder=np.where(cached == 0, new, 0).astype(np.int32),
        seq_lens_decoder=cached,
        seq_lens_this_time=new,
        cu_seqlens_q=cu,
        block_tables=tables,
        rotary_cos=cos,
        rotary_sin=sin,
        head_windows=windows,
        out=storage_nan((token_num, num_heads * d), dtype),
    )


def relative_error(out_bits: np.ndarray, ref: np.ndarray, dtype: int) -> float:
    got = from_storage(out_bits, dtype).astype(np.float64).reshape(ref.shape)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def quantize_case(case: Case, fmt: str) -> Case:
    """The (bf16) case with its cache rows as quantized pages of `fmt`, each lane in its own format (tests/
    custom_ops/reference_kv_quant.py; NaN rows: scale NaN, codes 0, so a stray read still poisons the output)."""
    shape = case.key_cache.shape
    kc, ks = quantized_pages(from_storage(case.key_cache, BF16).reshape(shape), fmt, keys=True)
    vc, vs = quantized_pages(from_storage(case.value_cache, BF16).reshape(shape), fmt, keys=False)
    return dataclasses.replace(case.with_params(cache_quant=QUANT[fmt]), key_cache=kc, value_cache=vc,
                               key_cache_scales=ks, value_cache_scales=vs)


def written_rows(case: Case):
    """Every K/V row the step writes, as [(page, row in page, k, v)]: k RoPE'd and v as they enter,
    float32 with the kernels' (and the CPU op's) float32 arithmetic (x0 c - x1 s: two products, one
    difference, each rounded), so quantizing them reproduces the written codes bit for bit. Pages
    index the cache viewed as [num_blocks * kv_slots, block_size, ...]; kv_head_slots honoured."""
    p = case.params
    nh, kvh, d, bs = p["num_heads"], p["kv_num_heads"], p["head_dim"], p["block_size"]
    kv_slots = p.get("kv_slots") or kvh
    slots = case.kv_head_slots if case.kv_head_slots is not None else np.arange(kvh)
    qkv = from_storage(case.qkv, p["dtype"]).astype(np.float32)
    cos, sin = case.rotary_cos.astype(np.float32), case.rotary_sin.astype(np.float32)
    rows = []
    for r in range(len(case.seq_lens_this_time)):
        for j in range(int(case.seq_lens_this_time[r])):
            tok, t = int(case.cu_seqlens_q[r]) + j, int(case.seq_lens_decoder[r]) + j
            k = qkv[tok, nh * d:(nh + kvh) * d].reshape(kvh, d)
            v = qkv[tok, (nh + kvh) * d:].reshape(kvh, d)
            k_rot = np.empty_like(k)
            k_rot[:, 0::2] = k[:, 0::2] * cos[t] - k[:, 1::2] * sin[t]
            k_rot[:, 1::2] = k[:, 1::2] * cos[t] + k[:, 0::2] * sin[t]
            for h in range(kvh):
                slot = int(slots[h])
                if p["head_wise_table"]:
                    page = int(case.block_tables[r, slot, t // bs])
                else:
                    page = int(case.block_tables[r, t // bs]) * kv_slots + slot
                rows.append((page, t % bs, k_rot[h], v[h]))
    return rows


def expected_quantized_caches(case: Case, fmt: str):
    """(key codes, key scales, value codes, value scales) a step on quantized pages `fmt` must leave:
    the case's pages and scales, each written row replaced by reference_kv_quant's quantization of
    its float32 row (keys rotated where the format rotates them). Codes as uint8 bytes."""
    bs = case.params["block_size"]
    caches = []
    for codes, scales, keys in ((case.key_cache, case.key_cache_scales, True),
                                (case.value_cache, case.value_cache_scales, False)):
        codes = np.array(codes, copy=True).view(np.uint8)
        scales = np.array(scales, dtype=np.float32, copy=True)
        pages = codes.reshape(-1, bs, codes.shape[-1])
        page_scales = scales.reshape(-1, bs)
        for page, row, k, v in written_rows(case):
            stored, scale = quantized_pages((k if keys else v)[None], fmt, keys=keys)
            pages[page, row] = stored[0].view(np.uint8)
            page_scales[page, row] = scale[0]
        caches += [codes, scales]
    return tuple(caches)
