"""Fixed step-input buffers, sized at start-up and refilled every step (upstream's `share_inputs`).

Every int32 input of a step — seq lens, cu_seqlens_q, the sampled rows, the token ids and the 1-D
`[max_num_seqs, max_blocks]` or head-wise `[max_num_seqs, H, max_blocks]` table — lives at a fixed
offset of ONE flat int32 array. A step packs its StepInput into the host copy (numpy, no
allocation) and moves it with one host-to-device copy (`Tensor.copy_`) into the one device tensor;
the tensors the model sees are views of that tensor made once at start-up (the batch-sized ones)
or per step (the token-sized slices, which allocate no device memory). Rows past the step's batch
are idle: `seq_lens_this_time` 0 and table entries -1, which both ops skip. The CPU path uses the
same object: its "device" is the CPU and the copy is a memcpy.

`HostStepBuffer` (numpy only) is shared with the Paddle-free GPU check (benchmarks/gpu_check.py),
which copies the same packed array into a CuPy buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdeploy.worker.step_input import StepInput

FIELDS = ("seq_lens_encoder", "seq_lens_decoder", "seq_lens_this_time", "cu_seqlens_q", "sample_rows", "input_ids",
          "block_tables")


@dataclass(frozen=True)
class StepBufferLayout:
    max_num_seqs: int
    max_num_tokens: int        # max_num_batched_tokens: rows of the biggest step
    max_blocks_per_seq: int    # ceil(max_model_len / block_size)
    num_kv_heads: int          # this rank's head-wise table rows: its KV slots (cache_manager/slots.py)
    head_wise: bool

    @classmethod
    def from_config(cls, fd_config, num_kv_heads: int) -> "StepBufferLayout":
        model, cache, sched = fd_config.model_config, fd_config.cache_config, fd_config.scheduler_config
        return cls(max_num_seqs=sched.max_num_seqs, max_num_tokens=sched.max_num_batched_tokens,
                   max_blocks_per_seq=-(-model.max_model_len // cache.block_size), num_kv_heads=num_kv_heads,
                   head_wise=fd_config.head_wise_kv_cache)

    @property
    def table_shape(self) -> tuple:
        s, b = self.max_num_seqs, self.max_blocks_per_seq
        return (s, self.num_kv_heads, b) if self.head_wise else (s, b)

    def sizes(self) -> dict:
        s = self.max_num_seqs
        # Sampled rows: one per request, or every row of a speculating request's piece: at most one
        # per token of the step.
        return {"seq_lens_encoder": s, "seq_lens_decoder": s, "seq_lens_this_time": s, "cu_seqlens_q": s + 1,
                "sample_rows": self.max_num_tokens, "input_ids": self.max_num_tokens,
                "block_tables": int(np.prod(self.table_shape))}

    def offsets(self) -> dict:
        out, at = {}, 0
        for name, size in self.sizes().items():
            out[name] = (at, at + size)
            at += size
        return out

    @property
    def total(self) -> int:
        return sum(self.sizes().values())


class HostStepBuffer:
    """The packed host array and named numpy views of it; `pack` fills it from a StepInput in place."""

    def __init__(self, layout: StepBufferLayout):
        self.layout = layout
        self.array = np.zeros(layout.total, np.int32)
        self.views = {name: self.array[a:b] for name, (a, b) in layout.offsets().items()}
        self.table = self.views["block_tables"].reshape(layout.table_shape)
        self.num_tokens = self.num_sampled = self.bsz = 0

    def pack(self, step: StepInput) -> None:
        """Write `step` (a head-wise table holds this rank's heads: StepInput.for_rank); idle rows
        are reset."""
        lay, v = self.layout, self.views
        bsz, tokens, sampled = len(step.seq_lens_this_time), len(step.input_ids), len(step.sample_rows)
        table = step.block_tables_head_wise if lay.head_wise else step.block_tables
        if table is None:
            raise ValueError(f"step input has no {'head-wise' if lay.head_wise else '1-D'} block table, but the "
                             f"buffers were sized for one")
        if lay.head_wise and table.shape[1] != lay.num_kv_heads:
            raise ValueError(f"step table has {table.shape[1]} KV heads, the buffers hold {lay.num_kv_heads}")
        if bsz > lay.max_num_seqs or tokens > lay.max_num_tokens or table.shape[-1] > lay.max_blocks_per_seq:
            raise ValueError(f"step of {bsz} requests, {tokens} tokens and {table.shape[-1]} table columns exceeds "
                             f"the step buffers (max_num_seqs={lay.max_num_seqs}, max_num_batched_tokens="
                             f"{lay.max_num_tokens}, max_blocks_per_seq={lay.max_blocks_per_seq})")
        for name in ("seq_lens_encoder", "seq_lens_decoder", "seq_lens_this_time"):
            v[name][:bsz] = getattr(step, name)
            v[name][bsz:] = 0
        v["cu_seqlens_q"][:bsz + 1] = step.cu_seqlens_q
        v["cu_seqlens_q"][bsz + 1:] = tokens  # idle rows: empty ranges at the end
        v["sample_rows"][:sampled] = step.sample_rows
        v["input_ids"][:tokens] = step.input_ids
        self.table.fill(-1)
        self.table[(slice(0, bsz),) + (slice(None),) * (table.ndim - 2) + (slice(0, table.shape[-1]),)] = table
        self.bsz, self.num_tokens, self.num_sampled = bsz, tokens, sampled


class StepBuffers:
    """The device side: one int32 tensor on Paddle's current device, views named like ForwardMeta's
    fields. `fill(step)` = pack on the host + one copy; returns the views for this step."""

    def __init__(self, layout: StepBufferLayout):
        import paddle
        from paddle.utils.dlpack import from_dlpack

        self.host = HostStepBuffer(layout)
        # Zero-copy CPU tensor over the numpy array: the copy source, made once.
        self._staging = from_dlpack(self.host.array)
        self.device = paddle.zeros([layout.total], dtype="int32")
        offsets = layout.offsets()
        self._offset = {name: a for name, (a, _) in offsets.items()}
        self.fixed = {name: self.device._slice(*offsets[name]) for name in
                      ("seq_lens_encoder", "seq_lens_decoder", "seq_lens_this_time", "cu_seqlens_q")}
        a, b = offsets["block_tables"]
        self.fixed["block_tables"] = self.device._slice(a, b).reshape(list(layout.table_shape))
        # Token- and sample-sized views, made once per length: Paddle 3.3.1 leaves 56 bytes behind on
        # every `_slice` call, so a view per step would grow forever; this cache is bounded by
        # max_num_batched_tokens + max_num_seqs small tensor objects (no device memory).
        self._sized_views: dict = {}

    def fill(self, step: StepInput) -> dict:
        self.host.pack(step)
        self.device.copy_(self._staging, False)  # the step's one host-to-device copy
        return {**self.fixed, "input_ids": self._sized("input_ids", self.host.num_tokens),
                "sample_rows": self._sized("sample_rows", self.host.num_sampled)}

    def _sized(self, name: str, n: int):
        key = (name, n)
        view = self._sized_views.get(key)
        if view is None:
            start = self._offset[name]
            view = self._sized_views[key] = self.device._slice(start, start + n)
        return view

    def data_ptrs(self) -> dict:
        """Device addresses of the buffers (constant for the engine's life)."""
        return {"device": self.device.data_ptr(), **{k: t.data_ptr() for k, t in self.fixed.items()}}
