"""ForwardMeta: everything a model step needs besides weights and token ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import paddle


@dataclass
class ForwardMeta:
    """Per-step batch description, upstream names.

    Request i computes tokens [seq_lens_decoder[i], seq_lens_decoder[i] + seq_lens_this_time[i]),
    which are rows [cu_seqlens_q[i], cu_seqlens_q[i+1]) of the step's token tensor. `block_tables`
    is `[bsz, rows, max_blocks]`: one row of block ids in 1-D mode, one row of page ids per KV slot
    head-wise (-1 = recycled); the attention backend hands the kernels their form. From the model
    runner, the batch-sized tensors are views of the fixed step buffers (worker/step_buffers.py): `bsz`
    is max_num_seqs and rows not scheduled in the step are idle (0 new tokens); `starts`/`lengths`/
    `slot_ids` list the scheduled ones in row order.
    """

    input_ids: paddle.Tensor           # int64 [token_num]
    seq_lens_encoder: paddle.Tensor    # int32 [bsz]
    seq_lens_decoder: paddle.Tensor    # int32 [bsz]
    seq_lens_this_time: paddle.Tensor  # int32 [bsz]
    cu_seqlens_q: paddle.Tensor        # int32 [bsz + 1]
    block_tables: paddle.Tensor        # int32 [bsz, rows, max_blocks]
    sample_rows: paddle.Tensor         # int64 [num_sampled]: last row of each request that samples
    starts: list                       # python copies for the dense reference backend
    lengths: list
    slot_ids: list                     # the requests' persistent slots (dense reference storage)
    attn_backend: Any = None
