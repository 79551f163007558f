"""Megatron-style tensor parallelism: which slice of each parameter a rank holds, and the collectives.

Parameters are named as in the checkpoint (`[out, in]` storage) and sliced by name:
- column-parallel (output rows split): q/k/v projections by whole KV-head groups (a KV head and its
  query heads stay on one rank), gate/up projections by intermediate columns;
- row-parallel (input columns split, partial sums all-reduced): o_proj, down_proj;
- vocab-parallel (rows split, padded to equal slices): embed_tokens, lm_head;
- everything else (norms, a MoE router) is replicated.
Rank r holds KV heads [r*H/N, (r+1)*H/N) of the load-time head order, which moves whole KV-head
groups, per layer (ModelConfig.layer_kv_head_order, set by swa_head_placement.py: per-layer SWA heads
into shared slots, `--balance-swa-heads`). A tensor's layer is the number in its name.
"""

from __future__ import annotations

import re

import numpy as np

# A q/k/v bias (Qwen-style attention) is one value per output row: it moves and splits with the rows.
COLUMN_HEADS_Q = ("self_attn.q_proj.weight", "self_attn.q_proj.bias")
COLUMN_HEADS_KV = ("self_attn.k_proj.weight", "self_attn.v_proj.weight",
                   "self_attn.k_proj.bias", "self_attn.v_proj.bias")
ROW_HEADS = ("self_attn.o_proj.weight",)  # an o_proj bias is per hidden unit: neither moved nor split
# q/k norm weights: one head_dim vector shared by every head (Qwen3, Gemma 3: unmoved), or one value per
# row over all heads (OLMo: moved with the heads' rows; such a model runs on one rank, decoder.CausalLM).
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
SINKS = "self_attn.sinks"  # one logit per query head (gpt-oss): moved with the heads (such a model runs on one rank)
COLUMN_FFN = ("gate_proj.weight", "up_proj.weight")
ROW_FFN = ("down_proj.weight",)
VOCAB = ("embed_tokens.weight", "lm_head.weight")


def vocab_slice(vocab_size: int, rank: int, tp: int) -> tuple:
    """(first token id, end token id, padded slice length) of a rank's vocabulary shard."""
    per = -(-vocab_size // tp)
    return min(vocab_size, rank * per), min(vocab_size, (rank + 1) * per), per


def local_kv_heads(num_kv_heads: int, rank: int, tp: int) -> range:
    """The KV heads (load-time order) rank `rank` holds."""
    per = num_kv_heads // tp
    return range(rank * per, (rank + 1) * per)


def check_shardable(cfg, tp: int) -> None:
    """Start-up check: every split above must be exact."""
    if cfg.num_key_value_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide num_key_value_heads={cfg.num_key_value_heads}")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide intermediate_size={cfg.intermediate_size}")
    moe = getattr(cfg, "moe", None)
    if moe is not None:
        if moe.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide moe_intermediate_size={moe.intermediate_size}")


def permute_kv_heads(weights: dict, cfg, order) -> dict:
    """Reorder whole KV-head groups: K/V rows of head order[i] move to slot i, with the query heads
    of that group and the matching o_proj input columns. Attention is per head and o_proj sums over
    heads, so outputs are unchanged (up to float summation order). `order` is one order for every
    layer, or one per layer (indexed by the layer number in each name). numpy arrays or Paddle tensors."""
    per_layer = order is not None and len(order) > 0 and isinstance(order[0], (list, tuple))

    def order_of(name: str):
        if not per_layer:
            return order
        layer = layer_of(name)
        return None if layer is None else order[layer]

    return {name: _permute_one(name, w, cfg, order_of(name)) for name, w in weights.items()}


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str):
    """The decoder layer a checkpoint tensor belongs to (`...layers.N....`), None for the others."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _head_index(order: list, width: int) -> np.ndarray:
    """Rows (or columns) of whole heads `width` wide, in `order`."""
    return (np.asarray(order, dtype=np.int64)[:, None] * width + np.arange(width)).ravel()


def _permute_one(name: str, w, cfg, order):
    if order is None or list(order) == list(range(cfg.num_key_value_heads)):
        return w
    group = cfg.num_attention_heads // cfg.num_key_value_heads * cfg.head_dim  # query rows per KV head
    if name.endswith(COLUMN_HEADS_Q) or (name.endswith(QK_NORMS[0]) and w.shape[0] > cfg.head_dim):  # [rows, in], [rows]
        return _take(w, _head_index(order, group), 0)
    if name.endswith(COLUMN_HEADS_KV) or (name.endswith(QK_NORMS[1]) and w.shape[0] > cfg.head_dim):
        return _take(w, _head_index(order, cfg.head_dim), 0)
    if name.endswith(ROW_HEADS):
        return _take(w, _head_index(order, group), 1)
    if name.endswith(SINKS):
        return _take(w, _head_index(order, cfg.num_attention_heads // cfg.num_key_value_heads), 0)
    return w


def rank_tensor(name: str, w, cfg, rank: int, tp: int):
    """What rank `rank` keeps of one checkpoint tensor: permuted to its layer's load-time KV-head
    order, then sliced. Applied to each tensor as it is read, so a rank never holds the whole model.
    Both steps are row / column selections that keep the tensor's dtype and a GGUF tensor's blocks
    (layers/gguf_blocks.py): a rank computes with the file's format, as one process does."""
    layer = layer_of(name)
    order = None if layer is None or cfg.kv_head_orders is None else cfg.layer_kv_head_order(layer)
    return _shard_one(name, _permute_one(name, w, cfg, order), cfg, rank, tp)


def shard_weights(weights: dict, cfg, rank: int, tp: int) -> dict:
    """The slice of every parameter rank `rank` of `tp` holds (a new dict of copies, so the full
    tensors can be freed). numpy arrays or Paddle tensors, `[out, in]` as in the checkpoint."""
    return {name: _shard_one(name, w, cfg, rank, tp) for name, w in weights.items()}


def _shard_one(name: str, w, cfg, rank: int, tp: int):
    if tp == 1:
        return w
    q_rows = cfg.num_attention_heads // tp * cfg.head_dim
    kv_rows = cfg.num_key_value_heads // tp * cfg.head_dim
    if name.endswith(COLUMN_HEADS_Q):
        return _take(w, np.arange(rank * q_rows, (rank + 1) * q_rows), 0)
    if name.endswith(COLUMN_HEADS_KV):
        return _take(w, np.arange(rank * kv_rows, (rank + 1) * kv_rows), 0)
    if name.endswith(ROW_HEADS):
        return _take(w, np.arange(rank * q_rows, (rank + 1) * q_rows), 1)
    if name.endswith(COLUMN_FFN):  # dense MLP, every routed expert, the shared experts
        n = w.shape[0] // tp
        return _take(w, np.arange(rank * n, (rank + 1) * n), 0)
    if name.endswith(ROW_FFN):
        n = w.shape[1] // tp
        return _take(w, np.arange(rank * n, (rank + 1) * n), 1)
    if name.endswith(VOCAB):
        lo, hi, per = vocab_slice(cfg.vocab_size, rank, tp)
        return _pad_rows(_take(w, np.arange(lo, hi), 0), per)  # the last shard is padded with zero rows
    return w  # replicated: norms, the MoE router and its correction bias


# numpy and Paddle tensors alike (the loader yields Paddle tensors, bfloat16 included). Every selection
# returns a copy (so the full tensor can be freed) in the tensor's own dtype.
def _is_numpy(w) -> bool:
    return isinstance(w, np.ndarray)


def _take(w, index: np.ndarray, axis: int):
    """Rows (axis 0) or columns (axis 1) `index` of `w`; a GGUF tensor's blocks go along (rows always,
    columns in whole groups; else the float copy alone serves: layers/linear.py logs the format)."""
    if _is_numpy(w):
        return np.take(w, index, axis=axis)
    import paddle

    out = paddle.index_select(w, paddle.to_tensor(index, dtype="int64"), axis=axis)
    blocks = getattr(w, "gguf_blocks", None)
    if blocks is not None:
        out.gguf_blocks = blocks.take_rows(index) if axis == 0 else blocks.take_columns(index)
    return out


def _pad_rows(w, rows: int):
    extra = rows - w.shape[0]
    if extra == 0:
        return w
    if _is_numpy(w):
        return np.concatenate([w, np.zeros((extra,) + tuple(w.shape[1:]), w.dtype)])
    import paddle

    out = paddle.concat([w, paddle.zeros([extra] + list(w.shape[1:]), dtype=w.dtype)], axis=0)
    blocks = getattr(w, "gguf_blocks", None)
    if blocks is not None:
        out.gguf_blocks = blocks.pad_rows(rows)
    return out


def balanced_kv_head_order(num_kv_heads: int, swa_kv_heads, tp: int) -> list:
    """A KV-head order that gives every rank floor or ceil of its share of the SWA heads (dealt
    round-robin), keeping each kind's heads in their original order; identity when already so."""
    per_rank = num_kv_heads // tp
    swa = sorted(swa_kv_heads)
    counts = [sum(1 for h in swa if h // per_rank == r) for r in range(tp)]
    if max(counts) - min(counts) <= 1:
        return list(range(num_kv_heads))
    full = [h for h in range(num_kv_heads) if h not in set(swa)]
    slots: list = [[] for _ in range(tp)]
    for i, h in enumerate(swa):
        slots[i % tp].append(h)
    for r in range(tp):
        while len(slots[r]) < per_rank:
            slots[r].append(full.pop(0))
    return [h for r in range(tp) for h in sorted(slots[r])]


# -- collectives (paddle.distributed; gloo on CPU, NCCL where Paddle has CUDA) -------------------

def all_reduce(x, tp: int):
    """Sum of the ranks' partial results (row-parallel layers, vocab-parallel embedding)."""
    if tp > 1:
        import paddle.distributed as dist

        dist.all_reduce(x)
    return x


def all_gather_last_axis(x, tp: int):
    """The ranks' column slices side by side (vocab-parallel lm_head)."""
    if tp == 1:
        return x
    import paddle
    import paddle.distributed as dist

    parts: list = []
    dist.all_gather(parts, x)
    return paddle.concat(parts, axis=-1)
