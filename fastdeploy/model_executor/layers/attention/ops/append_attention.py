"""Python entry of the AppendAttention op (one layer, one step, paged KV cache).

The argument layout is the op contract (docs/op_contract.md): ``qkv`` rows are the new
tokens of a mixed prefill/decode batch; ``key_cache``/``value_cache``
(``[num_blocks, kv_num_heads, block_size, head_dim]``) are updated in place
with the rotated K and the V of those tokens; ``block_tables`` is either the
1-D table ``[bsz, max_blocks]`` or the head-wise page table
``[bsz, kv_num_heads, max_blocks]`` (told apart by rank). Returns
``[token_num, num_heads * head_dim]`` in the dtype of ``qkv``.
"""

from __future__ import annotations

import paddle

from .cpu_op_loader import load_cpu_ops


def append_attention(
    qkv: paddle.Tensor,
    key_cache: paddle.Tensor,
    value_cache: paddle.Tensor,
    seq_lens_encoder: paddle.Tensor,
    seq_lens_decoder: paddle.Tensor,
    seq_lens_this_time: paddle.Tensor,
    cu_seqlens_q: paddle.Tensor,
    block_tables: paddle.Tensor,
    rotary_cos: paddle.Tensor,
    rotary_sin: paddle.Tensor,
    swa_head_mask: paddle.Tensor,
    *,
    num_heads: int,
    kv_num_heads: int,
    head_dim: int,
    sliding_window: int,
    sink_size: int,
    visit_all_pages: bool = False,
) -> paddle.Tensor:
    """Rotate q/k, write the new K/V into the paged cache, attend.

    ``sliding_window``/``sink_size`` apply to the KV heads flagged in
    ``swa_head_mask``; ``visit_all_pages`` is the benchmark baseline that reads
    every page and masks instead of skipping (needs a table without -1 in the
    visible range). Bad shapes, or a -1 in a table entry the step needs
    (a scheduler bug), raise ``ValueError`` naming request, head and block
    index; the cache is left untouched in that case.
    """
    if not qkv.place.is_cpu_place():
        raise ValueError(f"append_attention: this is the CPU op, but qkv lives on {qkv.place}")
    tensors = (qkv, key_cache, value_cache, seq_lens_encoder, seq_lens_decoder, seq_lens_this_time,
               cu_seqlens_q, block_tables, rotary_cos, rotary_sin, swa_head_mask)
    attrs = (int(num_heads), int(kv_num_heads), int(head_dim), int(sliding_window), int(sink_size),
             bool(visit_all_pages))
    out, _, _ = _call(load_cpu_ops().append_attention_cpu, *tensors, *attrs)
    return out


def validate_append_attention_inputs(*tensors: paddle.Tensor, rules: str, check_place: bool = True,
                                     num_heads: int, kv_num_heads: int, head_dim: int,
                                     sliding_window: int, sink_size: int,
                                     visit_all_pages: bool = False) -> None:
    """Runs only the input checks shared by the CPU op and the CUDA wrapper
    (custom_ops/cpu_ops/append_attention_checks.h) on CPU tensors, with the
    ``rules`` of the ``"cpu"`` op or the ``"gpu"`` wrapper (its dtypes; its place
    rule too unless ``check_place=False``). Raises ``ValueError`` like the op."""
    if rules not in ("cpu", "gpu"):
        raise ValueError(f"rules must be 'cpu' or 'gpu', got {rules!r}")
    attrs = (int(num_heads), int(kv_num_heads), int(head_dim), int(sliding_window), int(sink_size),
             bool(visit_all_pages), rules == "gpu", bool(check_place))
    _call(load_cpu_ops().append_attention_validate, *tensors, *attrs)


def _call(op, *args):
    try:
        return op(*args)
    except OSError as e:  # how Paddle surfaces PD_CHECK/PD_THROW of a custom op
        if "append_attention" in str(e):
            raise ValueError(str(e).strip()) from e
        raise
