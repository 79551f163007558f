"""APPEND_ATTN: the paged attention backend (default), one custom-op call per layer and step.

Under tensor parallelism this is one rank's backend, in that rank's worker process: it owns the
rank's `H / tp` KV heads (and their query heads, which arrive as the rank's qkv columns) and the
cache for them, addressed by rank-local page ids. The cache is the slot layout's k lanes
(cache_manager/slots.py), each `[num_blocks, G, block_size, head_dim]` for K and for V (quantized
pages, --kv-cache-quant-type: int8 / float8_e4m3fn codes, or int4 codes two per uint8 in
`[..., head_dim / 2]`, or k8v4's int8 keys beside int4 values, plus float32 scales
`[num_blocks, G, block_size]` for K and for V, one per token row of every page); a layer reads and
writes its lane
through its head -> slot map (one lane per layer, G = H / tp and slot h
= head h for a model whose layers all look alike). Every layer passes its own sliding heads,
window and sink (sliding layers of the model as much as head-wise SWA heads), one pair per KV head: the
op's head_windows [2, kv_heads] (row 0 windows, 0 = full; row 1 sinks), so a layer may mix full heads
and any number of sliding types.
"""

from __future__ import annotations

import paddle

from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.layers.attention.ops import append_attention
from fastdeploy.model_executor.layers.attention.ops.append_attention import _call, check_device_errors, \
    cpu_op_arguments, cpu_op_attrs, dual_pass_window, new_error_info, no_scales, no_sinks
from fastdeploy.model_executor.layers.attention.ops.cpu_op_loader import load_cpu_ops
from fastdeploy.model_executor.layers.attention.swa_spec import attention_type_table, row_attention_args
from fastdeploy.model_executor.tensor_parallel import local_kv_heads


class AppendAttentionBackend:
    """Owns one rank's paged KV cache: per lane, K and V of shape `[num_blocks, G, block_size, head_dim]`
    (int4 values: `head_dim / 2` bytes)."""

    def __init__(self, fd_config, rotary: list, tp_rank: int = 0, attention_sinks=None):
        """`rotary`: (cos, sin) per layer; `attention_sinks`: per layer the learned sink logits of this rank's
        query heads (float32 [heads], gpt-oss) or None (no sinks, every layer when the list is None)."""
        model, cache = fd_config.model_config, fd_config.cache_config
        tp = fd_config.parallel_config.tensor_parallel_size
        self.num_heads, self.kv_num_heads = model.num_attention_heads // tp, model.num_key_value_heads // tp
        self.head_dim = model.head_dim
        slots = fd_config.slot_layout
        cells = [cache.num_gpu_blocks, slots.slots_per_rank, cache.block_size]  # (block, slot, row) of a page

        def lanes(lane: str) -> list:  # K and V may differ in dtype and row width (k8v4: int8 keys, int4 values)
            shape = cells + [cache.row_elements(model.head_dim, lane)]
            return [paddle.zeros(shape, dtype=cache.page_dtype(lane)) for _ in range(slots.num_lanes)]

        self.lane_keys, self.lane_values = lanes("key"), lanes("value")
        # A page's scales sit at its own (block, slot) cell: whatever moves the page moves them.
        if cache.quantized:
            self.lane_key_scales = [paddle.zeros(cells, "float32") for _ in range(slots.num_lanes)]
            self.lane_value_scales = [paddle.zeros(cells, "float32") for _ in range(slots.num_lanes)]
        else:  # float pages: the op's 1-element placeholders
            place = self.lane_keys[0].place
            self.lane_key_scales = [no_scales(place)] * slots.num_lanes
            self.lane_value_scales = [no_scales(place)] * slots.num_lanes
        # Per layer: its lane (layers of one lane share the tensors, in disjoint slots).
        self.key_caches = [self.lane_keys[lane] for lane in slots.lane_of_layer]
        self.value_caches = [self.lane_values[lane] for lane in slots.lane_of_layer]
        self.key_scales = [self.lane_key_scales[lane] for lane in slots.lane_of_layer]
        self.value_scales = [self.lane_value_scales[lane] for lane in slots.lane_of_layer]
        self.rotary = rotary  # (cos, sin) per layer
        # What the scores go through besides the windows: the layer's sinks, the model's soft-cap (0: none).
        place = self.key_caches[0].place
        self.layer_sinks = [no_sinks(place) if s is None else s
                            for s in (attention_sinks or [None] * model.num_hidden_layers)]
        self.softcap = float(model.attn_logit_softcapping)
        heads = local_kv_heads(model.num_key_value_heads, tp_rank, tp)
        types = attention_type_table(model)
        # FD_HEAD_WISE_ATTN=dual_pass: upstream's two passes over the 1-D table (config checks it is
        # the GPU, 1-D mode); the masked passes read every page, as upstream's do.
        self.dual_pass = getattr(fd_config, "head_wise_attn", "SINGLE_PASS") == "DUAL_PASS"
        # Per layer: (head_windows [2, kv_heads] of this rank's heads: their windows and sinks; each
        # head's slot in the lane).
        self.layer_args = []
        for layer in range(model.num_hidden_layers):
            windows, sinks = row_attention_args([types[layer][h] for h in heads])
            if self.dual_pass:
                try:  # its SWA pass has one window: refused here, before the first step, not on the device
                    dual_pass_window([windows, sinks])
                except ValueError as e:
                    raise ValueError(f"FD_HEAD_WISE_ATTN=dual_pass: layer {layer}: {e}") from e
            self.layer_args.append((paddle.to_tensor([windows, sinks], dtype="int32"),
                                    paddle.to_tensor(slots.layer_head_slots(layer, heads), dtype="int32")))
        # The step's table is [bsz, rows, max_blocks]; the kernels take a 1-D table's one row as [bsz, max_blocks].
        self.one_row_table = not fd_config.head_wise_kv_cache
        self._kernel_table = (None, None)  # (the step buffers' table, its kernel form): made once
        self.on_gpu = getattr(fd_config, "device", "cpu") == "gpu"
        self.error_info = None
        if self.on_gpu:
            from fastdeploy.model_executor.layers.attention.ops.gpu_op_loader import load_gpu_ops

            load_gpu_ops()  # build (first use only) before the engine reports ready
            self.error_info = new_error_info(self.key_caches[0].place)  # one per engine; read once per step
        # CPU: the op is bound once (built on first use, before the engine reports ready, not inside
        # the first step) and called with the arguments every layer passes; the generic entry's
        # per-call checks and place dispatch cost ~30 us a layer, ~1 ms of a 30 ms decode step.
        self.cpu_op = None if self.on_gpu else self._bind_cpu_op()
        self.cpu_attrs = [cpu_op_attrs(dict(num_heads=self.num_heads, kv_num_heads=self.kv_num_heads,
                                            head_dim=self.head_dim, visit_all_pages=self.dual_pass,
                                            softcap=self.softcap))
                          for _ in self.layer_args]
        self._layer_operands = [self._operands_of(layer) for layer in range(len(self.layer_args))]

    def kv_tensors(self) -> list:
        """Every tensor a page lives in (K and V of each lane, and their scales for quantized pages): a page
        or block is the same byte range of each, which a KV transfer engine registers and moves."""
        tensors = self.lane_keys + self.lane_values
        if self.lane_key_scales[0].numel() > 1:  # quantized pages (float pages pass 1-element placeholders)
            tensors += self.lane_key_scales + self.lane_value_scales
        return tensors

    def _bind_cpu_op(self):
        return load_cpu_ops().append_attention_cpu

    def step_tensors(self, meta: ForwardMeta) -> tuple:
        """The step's tensors every layer's call passes: (seq_lens_encoder, seq_lens_decoder,
        seq_lens_this_time, cu_seqlens_q, the block table in the kernels' form)."""
        return meta.seq_lens_encoder, meta.seq_lens_decoder, meta.seq_lens_this_time, meta.cu_seqlens_q, \
            self.kernel_table(meta.block_tables)

    def kernel_table(self, table: paddle.Tensor) -> paddle.Tensor:
        """The kernels' form of a step's `[bsz, rows, max_blocks]` table (docs/op_contract.md): head-wise as
        it is, a 1-D table's one row as `[bsz, max_blocks]` (a view, made once for the fixed buffers)."""
        if not self.one_row_table:
            return table
        held, view = self._kernel_table
        if held is not table:
            view = table.reshape([table.shape[0], table.shape[2]])
            self._kernel_table = (table, view)
        return view

    def layer_operands(self, layer_id: int) -> dict:
        """The CPU op's tensors of layer `layer_id` that do not change between steps: its cache lane,
        scales, rotary tables, heads' windows and slots (its attributes: cpu_attrs[layer_id]). Built
        once: forward merges them into every call."""
        return self._layer_operands[layer_id]

    def _operands_of(self, layer_id: int) -> dict:
        head_windows, head_slots = self.layer_args[layer_id]
        cos, sin = self.rotary[layer_id]
        return dict(key_cache=self.key_caches[layer_id], value_cache=self.value_caches[layer_id],
                    rotary_cos=cos, rotary_sin=sin, head_windows=head_windows, kv_head_slots=head_slots,
                    key_cache_scales=self.key_scales[layer_id], value_cache_scales=self.value_scales[layer_id],
                    attention_sinks=self.layer_sinks[layer_id])

    def runs_cpu_op(self) -> bool:
        """True where forward is the CPU op's call (not the CUDA op, not a subclass's own kernels, not a
        wrapper set on this object, e.g. a benchmark's timer): a caller may then run the op itself on
        layer_operands (the whole decoder stack in one call)."""
        return (self.cpu_op is not None and type(self).forward is AppendAttentionBackend.forward
                and "forward" not in vars(self))

    def forward(self, layer_id: int, qkv: paddle.Tensor, meta: ForwardMeta) -> paddle.Tensor:
        if self.cpu_op is not None:
            encoder, decoder, this_time, cu_seqlens_q, table = self.step_tensors(meta)
            tensors = dict(qkv=qkv, seq_lens_encoder=encoder, seq_lens_decoder=decoder, seq_lens_this_time=this_time,
                           cu_seqlens_q=cu_seqlens_q, block_tables=table, **self.layer_operands(layer_id))
            return _call(self.cpu_op, *cpu_op_arguments(tensors, self.cpu_attrs[layer_id]))[0]
        table = self.kernel_table(meta.block_tables)
        head_windows, head_slots = self.layer_args[layer_id]
        cos, sin = self.rotary[layer_id]
        return append_attention(
            qkv, self.key_caches[layer_id], self.value_caches[layer_id], meta.seq_lens_encoder,
            meta.seq_lens_decoder, meta.seq_lens_this_time, meta.cu_seqlens_q, table, cos, sin,
            head_windows, head_slots, self.key_scales[layer_id], self.value_scales[layer_id],
            self.layer_sinks[layer_id], num_heads=self.num_heads, kv_num_heads=self.kv_num_heads,
            head_dim=self.head_dim, visit_all_pages=self.dual_pass, softcap=self.softcap, dual_pass=self.dual_pass,
            error_info=self.error_info)

    def end_step(self) -> None:
        """After the step's last layer: surface a device-side error the CUDA kernels recorded (the
        logits copy syncs here anyway). The CPU op raises inside the call instead."""
        if self.error_info is not None:
            check_device_errors(self.error_info)
