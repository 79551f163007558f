"""Every decoder layer of a step in one op call (custom_ops/cpu_ops/decoder_stack.cc), with the final
norm and the LM head on the sampled rows.

On the CPU, a model whose dense weights are all GGUF blocks runs each layer as norm + q/k/v, the
attention op, and o_proj + MLP: three Paddle op calls a layer and a Python loop, ~1.5 ms of a
one-request SmolLM2 decode step during which one core waits. Where the attention backend is the
CPU op, the layers' constant operands are bound once here and a step is one call with the hidden
rows, the step's lengths and block table, and the rows that sample; the op runs the same functions in
the same order, so the outputs keep the per-layer path's bits (tests/real_models/test_decoder_stack.py).
"""

from __future__ import annotations

import weakref

import paddle

from fastdeploy.model_executor.layers.attention.ops.append_attention import _call




class DecoderStack:
    """The binding of one model's layers to one attention backend's cache lanes."""

    def __init__(self, layers: list, head, backend, eps: float, act: int):
        """`layers`: per layer (input_norm, post_norm, qkv, o, gate_up, down), each weight its
        `block_operand` (q, scale, offset | None, n, group, kind); `head`: (final norm, the LM head's
        block_operand) or None; `backend` runs the CPU op."""
        from fastdeploy.model_executor.layers.blas_gemm import decoder_stack_ops

        bind, self._forward, release = decoder_stack_ops()
        none = paddle.zeros([0], dtype="float32")  # an absent offset (i8 weights have none)
        tensors, ints = [], []
        for layer_id, (input_norm, post_norm, qkv, o, gu, down) in enumerate(layers):
            att = backend.layer_operands(layer_id)
            tensors += [none if t is None else t for t in (input_norm, *qkv[:3], *o[:3], post_norm, *gu[:3], *down[:3])]
            tensors += [att["key_cache"], att["value_cache"], att["key_cache_scales"], att["value_cache_scales"],
                        att["rotary_cos"], att["rotary_sin"], att["head_windows"], att["kv_head_slots"]]
            num_heads, kv_heads, head_dim, visit_all, softcap = backend.cpu_attrs[layer_id]
            if softcap or att["attention_sinks"].shape[0]:  # the plain layers the stack binds have neither
                raise ValueError("DecoderStack: a layer with attention sinks or soft-capping is not a plain layer")
            ints += [qkv[3], qkv[4], qkv[5], o[4], o[5], gu[3], gu[4], gu[5], down[4], down[5],
                     num_heads, kv_heads, head_dim, int(visit_all)]
        head_tensors, head_ints = [none] * 4, []
        if head is not None:
            norm, (q, scale, offset, n, group, kind) = head
            head_tensors, head_ints = [norm, q, scale, none if offset is None else offset], [n, group, kind]
        self.has_head = head is not None
        self.handle = bind(tensors, head_tensors, [int(i) for i in ints], [int(i) for i in head_ints], float(eps),
                           int(act))
        self._no_rows = paddle.zeros([0], dtype="int64")
        self.backend = weakref.ref(backend)
        # The binding holds the weights and cache lanes; released with this object (not at interpreter
        # exit, when Paddle can no longer run an op: the process's memory goes anyway).
        weakref.finalize(self, release, self.handle).atexit = False

    def __call__(self, hidden: paddle.Tensor, meta, with_head: bool) -> tuple:
        """(the last layer's output plus its residual, what the per-layer loop ends with; the logits of
        the sampled rows where a head is bound, `with_head` and some row samples, else None)."""
        rows = meta.sample_rows if with_head and self.has_head and meta.sample_rows.shape[0] else None
        out, logits = _call(self._forward, self.handle, hidden, *self.backend().step_tensors(meta),
                            self._no_rows if rows is None else rows)
        return out, None if rows is None else logits
