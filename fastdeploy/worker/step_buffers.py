"""Fixed step-input buffers, sized at start-up and refilled every step (upstream's `share_inputs`).

Every int32 input of a step — seq lens, cu_seqlens_q, the sampled rows, the token ids and the block
table `[max_num_seqs, rows, max_blocks]` (rows: 1 in 1-D mode, this rank's slots head-wise) — lives at
a fixed offset of ONE flat int32 array. The table is persistent: a request keeps its batch row while it
runs and a step writes only the entries that changed (StepInput.table_updates); released rows are -1.
A step packs its StepInput into the host array (numpy, no allocation) and, on a GPU, moves it with one
host-to-device copy (`Tensor.copy_`) into the one device tensor; on the CPU the tensor the model reads
*is* the host array (no copy). The tensors the model sees are views made once at start-up (the
batch-sized ones) or once per length (the token-sized slices, which allocate no device memory). Batch
rows not scheduled in a step are idle: `seq_lens_this_time` 0, which both ops skip.

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
    table_rows: int            # rows of a request's table on this rank: 1 in 1-D mode, its KV slots head-wise

    @classmethod
    def from_config(cls, fd_config, table_rows: int) -> "StepBufferLayout":
        model, cache, sched = fd_config.model_config, fd_config.cache_config, fd_config.scheduler_config
        return cls(max_num_seqs=sched.max_num_seqs, max_num_tokens=sched.max_num_batched_tokens,
                   max_blocks_per_seq=-(-model.max_model_len // cache.block_size), table_rows=table_rows)

    @property
    def table_shape(self) -> tuple:
        return self.max_num_seqs, self.table_rows, self.max_blocks_per_seq

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
        self.table.fill(-1)
        self.num_tokens = self.num_sampled = self.bsz = 0

    def pack(self, step: StepInput) -> None:
        """Write `step` (its table updates those of this rank: StepInput.for_rank); idle rows are reset."""
        lay, v = self.layout, self.views
        bsz, tokens, sampled = len(step.seq_lens_this_time), len(step.input_ids), len(step.sample_rows)
        if bsz > lay.max_num_seqs or tokens > lay.max_num_tokens:
            raise ValueError(f"step of {bsz} batch rows and {tokens} tokens exceeds the step buffers "
                             f"(max_num_seqs={lay.max_num_seqs}, max_num_batched_tokens={lay.max_num_tokens})")
        for update in step.table_updates:
            self.apply(update)
        for name in ("seq_lens_encoder", "seq_lens_decoder", "seq_lens_this_time"):
            v[name][:bsz] = getattr(step, name)
            v[name][bsz:self.bsz] = 0  # rows the last step used and this one does not
        v["cu_seqlens_q"][:bsz + 1] = step.cu_seqlens_q
        v["cu_seqlens_q"][bsz + 1:] = tokens  # idle rows: empty ranges at the end
        v["sample_rows"][:sampled] = step.sample_rows
        v["input_ids"][:tokens] = step.input_ids
        self.bsz, self.num_tokens, self.num_sampled = bsz, tokens, sampled

    def apply(self, update) -> None:
        """One TableUpdate: a rectangle of new ids, or -1 (numpy writes; no loop over rows)."""
        lay = self.layout
        end = lay.max_blocks_per_seq if update.width is None else update.col + update.width
        if not 0 <= update.row < lay.max_num_seqs or not 0 <= update.col <= end <= lay.max_blocks_per_seq:
            raise ValueError(f"table update of batch row {update.row}, columns [{update.col}, {end}) is outside "
                             f"the step buffers (max_num_seqs={lay.max_num_seqs}, max_blocks_per_seq="
                             f"{lay.max_blocks_per_seq})")
        rows = slice(None) if update.slots is None else update.slots
        if update.ids is None:
            self.table[update.row, rows, update.col:end] = -1
            return
        shape = (lay.table_rows if update.slots is None else len(update.slots), end - update.col)
        if update.ids.shape != shape:
            raise ValueError(f"table update of batch row {update.row} brings ids of shape {update.ids.shape} for "
                             f"entries of shape {shape} (this rank's table has {lay.table_rows} row(s))")
        self.table[update.row, rows, update.col:end] = update.ids


class StepBuffers:
    """The device side: one int32 tensor on Paddle's current device, views named like ForwardMeta's
    fields. `fill(step)` = pack on the host + one copy; returns the views for this step."""

    def __init__(self, layout: StepBufferLayout):
        import paddle
        from paddle.utils.dlpack import from_dlpack

        self.host = HostStepBuffer(layout)
        # Zero-copy CPU tensor over the numpy array: the copy source on a GPU, the buffer itself on a CPU.
        self._staging = from_dlpack(self.host.array)
        self._copy = not paddle.get_device().startswith("cpu")
        self.device = paddle.zeros([layout.total], dtype="int32") if self._copy else self._staging
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
        if self._copy:
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
