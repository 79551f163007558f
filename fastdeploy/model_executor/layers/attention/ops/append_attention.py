"""Python entry of the AppendAttention op (one layer, one step, paged KV cache).

The argument layout is the op contract (docs/op_contract.md): ``qkv`` rows are the new
tokens of a mixed prefill/decode batch; ``key_cache``/``value_cache``
(``[num_blocks, G, block_size, head_dim]``, one lane of the slot layout with
G >= kv_num_heads slots) are updated in place with the rotated K and the V of
those tokens; ``block_tables`` is either the 1-D table ``[bsz, max_blocks]``
or the head-wise page table ``[bsz, G, max_blocks]`` (told apart by rank);
``head_windows`` (int32 ``[2, kv_num_heads]``) is each KV head's window (row 0, 0 = full attention)
and sink (row 1, >= 0); ``kv_head_slots`` (int32 ``[kv_num_heads]``, distinct slots < G; None = head h
in slot h) says which slot, i.e. which table row and which place in a block,
holds each KV head of this layer. Quantized pages (int8, float8_e4m3fn, or uint8 caches of int4
pairs ``[num_blocks, G, block_size, head_dim / 2]``; k8v4: an int8 key cache beside a uint8 int4 value
cache, the one pair of caches that differ) carry
``key_cache_scales``/``value_cache_scales``, float32 ``[num_blocks, G, block_size]`` (one scale
per token row of every page, written with the row); float caches take a 1-element placeholder
there (None = made here). ``attention_sinks`` (float32 ``[num_heads]``, None = an empty ``[0]``
placeholder: no sinks) is a learned logit per query head that joins each softmax's denominator
(gpt-oss); the attribute ``softcap`` (0 = off) soft-caps every scaled score to
``softcap * tanh(score / softcap)`` (Gemma 2). Returns ``[token_num, num_heads * head_dim]`` in the dtype of ``qkv``.

One entry for both devices (docs/architecture.md): the place of ``qkv`` picks the CPU op
(custom_ops/cpu_ops) or the CUDA op (custom_ops/gpu_ops); both receive the tensors
and attributes that `op_arguments` builds, so everything but the kernel is shared.
"""

from __future__ import annotations

import operator
from typing import Optional

import numpy as np
import paddle

from .cpu_op_loader import load_cpu_ops

TENSOR_ARGS = ("qkv", "key_cache", "value_cache", "seq_lens_encoder", "seq_lens_decoder", "seq_lens_this_time",
               "cu_seqlens_q", "block_tables", "rotary_cos", "rotary_sin", "head_windows", "kv_head_slots",
               "key_cache_scales", "value_cache_scales", "attention_sinks")
SCALE_ARGS = ("key_cache_scales", "value_cache_scales")
# Cache dtypes that hold quantized pages (the scales' dtype is float32).
QUANTIZED_CACHE_DTYPES = (paddle.int8, paddle.float8_e4m3fn, paddle.uint8)
# The attributes of both ops, in order; the CPU op takes all but the last (it has one pass only).
ATTR_ARGS = ("num_heads", "kv_num_heads", "head_dim", "visit_all_pages", "softcap", "dual_pass")


def op_arguments(tensors: dict, *, num_heads: int, kv_num_heads: int, head_dim: int,
                 visit_all_pages: bool = False, softcap: float = 0.0, dual_pass: bool = False) -> tuple:
    """(tensors in op order, attributes in op order): the argument contract of both ops. Without
    ``kv_head_slots`` head h uses slot h (the per-head layout); float caches without scales, and calls
    without ``attention_sinks``, get the placeholders."""
    if tensors.get("kv_head_slots") is None and tensors.get("qkv") is not None:
        tensors = {**tensors, "kv_head_slots": identity_head_slots(int(kv_num_heads), tensors["qkv"].place)}
    cache = tensors.get("key_cache")
    if cache is not None and cache.dtype not in QUANTIZED_CACHE_DTYPES:
        tensors = {**tensors, **{name: no_scales(cache.place) for name in SCALE_ARGS if tensors.get(name) is None}}
    if tensors.get("attention_sinks") is None and tensors.get("qkv") is not None:
        tensors = {**tensors, "attention_sinks": no_sinks(tensors["qkv"].place)}
    missing = [name for name in TENSOR_ARGS if tensors.get(name) is None]
    if missing:
        raise ValueError(f"append_attention: missing tensor argument(s) {', '.join(missing)}")
    if dual_pass and (not visit_all_pages or len(tensors["block_tables"].shape) != 2):
        raise ValueError("append_attention: dual_pass is upstream's 1-D baseline; it needs a 1-D block table "
                         "[bsz, max_blocks] and visit_all_pages=True")
    attrs = (int(num_heads), int(kv_num_heads), int(head_dim), bool(visit_all_pages), float(softcap),
             bool(dual_pass))
    return tuple(tensors[name] for name in TENSOR_ARGS), attrs


def dual_pass_window(head_windows) -> tuple:
    """(window, sink) of dual_pass's all-SWA pass from a host copy of ``head_windows`` ``[2, kv_num_heads]``:
    the one pair every sliding head (window > 0) shares; (0, 0) when no head slides. Heads that slide
    with different pairs are refused (ValueError): upstream's baseline has one window for the SWA pass.
    The CUDA kernels derive the same pair on the device and record error 6 where the heads disagree."""
    rows = np.asarray(head_windows, dtype=np.int64)
    if rows.ndim != 2 or rows.shape[0] != 2:
        raise ValueError(f"append_attention: head_windows must be [2, kv_num_heads], got shape {list(rows.shape)}")
    pairs = sorted({(int(w), int(s)) for w, s in zip(rows[0], rows[1]) if w > 0})
    if len(pairs) > 1:
        raise ValueError(f"append_attention: dual_pass slides every head with one window, but the sliding heads of "
                         f"head_windows have {len(pairs)} different (window, sink) pairs {pairs}: every sliding head "
                         f"must share one")
    return pairs[0] if pairs else (0, 0)


_CPU_TENSORS, _CPU_ATTRS = operator.itemgetter(*TENSOR_ARGS), operator.itemgetter(*ATTR_ARGS[:-1])


def cpu_op_attrs(attrs: dict) -> tuple:
    """The CPU op's attributes in ATTR_ARGS order (without dual_pass), from named ones: a layer's are
    fixed, so the engine orders them once when it is built."""
    return _CPU_ATTRS(attrs)


def cpu_op_arguments(tensors: dict, attrs: tuple) -> tuple:
    """The CPU op's positional arguments (TENSOR_ARGS, then the cpu_op_attrs tuple) from named
    tensors, unchecked: the engine's per-layer call, whose arguments op_arguments checked in effect
    when the engine was built."""
    return _CPU_TENSORS(tensors) + attrs


# Device-side error codes of the CUDA op (AppendAttnDeviceError in append_attn_api.cuh).
DEVICE_ERRORS = {
    1: "block table entry is -1 but the step needs it (request {0}, kv head {1}, block index {2}): the page was "
       "recycled or never allocated (scheduler bug)",
    2: "visit_all_pages met a -1 block table entry (request {0}, kv head {1}, block index {2}): the masked "
       "baseline needs every page of [0, t] allocated",
    3: "block table entry out of range (request {0}, kv head {1}, block index {2}): id beyond the cache or index "
       "beyond max_blocks_per_seq",
    4: "position {2} of request {0} is beyond the rotary tables",
    5: "head_windows[{0}][{1}] (row 0: the window, row 1: the sink of kv head {1}) is {2}; it must be >= 0",
    6: "dual_pass slides every head with one window, but kv heads {0} and {1} of head_windows slide with "
       "different (window, sink) pairs: every sliding head must share one",
}


def select_op(place, dual_pass: bool = False):
    """(op, True when it is the CUDA op) for tensors on `place`. The CUDA op takes one more tensor
    (error_info) and one more attribute (dual_pass) than the CPU op."""
    if place.is_cpu_place():
        if dual_pass:
            raise ValueError("append_attention: dual_pass exists in the CUDA op only (FD_HEAD_WISE_ATTN=dual_pass "
                             "needs --device gpu)")
        return load_cpu_ops().append_attention_cpu, False
    if place.is_gpu_place():
        from .gpu_op_loader import GpuOpUnavailable, load_gpu_ops

        try:
            return load_gpu_ops().append_attention_gpu, True
        except GpuOpUnavailable as e:
            raise ValueError(f"append_attention: qkv lives on {place}, but {e}") from e
    raise ValueError(f"append_attention: no op for tensors on {place} (CPU and CUDA GPUs only)")


def no_scales(place) -> paddle.Tensor:
    """The scale argument of a float cache: a 1-element float32 placeholder (the ops' arity is fixed;
    docs/op_contract.md says why it is not an optional input)."""
    return paddle.to_tensor(np.zeros(1, np.float32), place=place)


def no_sinks(place) -> paddle.Tensor:
    """The attention_sinks argument of a model without learned sinks: an empty float32 ``[0]``."""
    return paddle.to_tensor(np.zeros(0, np.float32), place=place)


def identity_head_slots(kv_num_heads: int, place) -> paddle.Tensor:
    """kv_head_slots of the per-head layout: KV head h in slot (table row) h."""
    return paddle.to_tensor(np.arange(kv_num_heads, dtype=np.int32), place=place)


def new_error_info(place) -> paddle.Tensor:
    """The CUDA op's 4 device ints (code, request, kv head, block index); one per engine, reused."""
    return paddle.to_tensor(np.zeros(4, np.int32), place=place)


def check_device_errors(error_info) -> None:
    """Raise ValueError for an error the CUDA kernels recorded (reads 4 ints back: one sync)."""
    info = [int(v) for v in (error_info.numpy() if hasattr(error_info, "numpy") else error_info)]
    if info[0] != 0:
        text = DEVICE_ERRORS.get(info[0], "unknown device error code {3}")
        raise ValueError("append_attention_gpu: " + text.format(info[1], info[2], info[3], info[0]))


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
    head_windows: paddle.Tensor,
    kv_head_slots: Optional[paddle.Tensor] = None,
    key_cache_scales: Optional[paddle.Tensor] = None,
    value_cache_scales: Optional[paddle.Tensor] = None,
    attention_sinks: Optional[paddle.Tensor] = None,
    *,
    num_heads: int,
    kv_num_heads: int,
    head_dim: int,
    visit_all_pages: bool = False,
    softcap: float = 0.0,
    dual_pass: bool = False,
    error_info: Optional[paddle.Tensor] = None,
) -> paddle.Tensor:
    """Rotate q/k, write the new K/V into the paged cache, attend.

    ``head_windows`` is int32 ``[2, kv_num_heads]``: row 0 each KV head's own
    window (0 = full attention), row 1 its sink (>= 0); the ``[kv_num_heads]``
    form of 0/1 flags is refused. ``visit_all_pages`` is the benchmark baseline
    that reads every page and masks instead of skipping (needs a table without
    -1 in the visible range); ``dual_pass`` (CUDA op, 1-D table, with
    visit_all_pages) is upstream's two-pass head-wise SWA, whose SWA pass slides
    every head with one window: every sliding head of ``head_windows`` must
    share one (window, sink) (dual_pass_window; device error 6). Bad shapes, or a -1 in a table entry the
    step needs (a scheduler bug), raise ``ValueError`` naming request, head and
    block index; the cache is left untouched in that case (CPU op). On the GPU
    that check costs a sync: pass a persistent ``error_info`` (new_error_info)
    to record errors on the device instead and call check_device_errors once
    per step; without it the call checks (and syncs) at once.
    """
    tensors, attrs = op_arguments(
        dict(qkv=qkv, key_cache=key_cache, value_cache=value_cache, seq_lens_encoder=seq_lens_encoder,
             seq_lens_decoder=seq_lens_decoder, seq_lens_this_time=seq_lens_this_time, cu_seqlens_q=cu_seqlens_q,
             block_tables=block_tables, rotary_cos=rotary_cos, rotary_sin=rotary_sin, head_windows=head_windows,
             kv_head_slots=kv_head_slots, key_cache_scales=key_cache_scales, value_cache_scales=value_cache_scales,
             attention_sinks=attention_sinks),
        num_heads=num_heads, kv_num_heads=kv_num_heads, head_dim=head_dim, visit_all_pages=visit_all_pages,
        softcap=softcap, dual_pass=dual_pass)
    op, on_gpu = select_op(qkv.place, dual_pass)
    check_now = on_gpu and error_info is None
    if check_now:
        error_info = new_error_info(qkv.place)
    outs = _call(op, *tensors, error_info, *attrs) if on_gpu else _call(op, *tensors, *attrs[:-1])
    if check_now:
        check_device_errors(error_info)
    return outs[0]


def validate_append_attention_inputs(*tensors: paddle.Tensor, rules: str, check_place: bool = True,
                                     num_heads: int, kv_num_heads: int, head_dim: int,
                                     visit_all_pages: bool = False, softcap: float = 0.0) -> None:
    """Runs only the input checks shared by the CPU op and the CUDA wrapper
    (custom_ops/cpu_ops/append_attention_checks.h) on CPU tensors, with the
    ``rules`` of the ``"cpu"`` op or the ``"gpu"`` wrapper (its dtypes; its place
    rule too unless ``check_place=False``). Raises ``ValueError`` like the op. ``tensors`` may stop
    before ``kv_head_slots``, the scales or ``attention_sinks`` (the defaults of op_arguments)."""
    least = TENSOR_ARGS.index("kv_head_slots")
    if len(tensors) < least:
        raise ValueError(f"validate_append_attention_inputs: expected at least {least} tensors")
    named = dict(zip(TENSOR_ARGS, tensors))
    tensors, _ = op_arguments(named, num_heads=num_heads, kv_num_heads=kv_num_heads, head_dim=head_dim)
    if rules not in ("cpu", "gpu"):
        raise ValueError(f"rules must be 'cpu' or 'gpu', got {rules!r}")
    attrs = (int(num_heads), int(kv_num_heads), int(head_dim), bool(visit_all_pages), float(softcap),
             rules == "gpu", bool(check_place))
    _call(load_cpu_ops().append_attention_validate, *tensors, *attrs)


def _call(op, *args):
    try:
        return op(*args)
    except OSError as e:  # how Paddle surfaces PD_CHECK/PD_THROW of a custom op
        if "append_attention" in str(e):
            raise ValueError(str(e).strip()) from e
        raise
