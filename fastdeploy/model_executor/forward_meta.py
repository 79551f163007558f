"""ForwardMeta: everything a model step needs besides weights and token ids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import paddle


@dataclass
class ForwardMeta:
    """Per-step batch description, upstream names.

    Request i computes tokens [seq_lens_decoder[i], seq_lens_decoder[i] + seq_lens_this_time[i]),
    which are rows [cu_seqlens_q[i], cu_seqlens_q[i+1]) of the step's token tensor. Exactly one
    of `block_tables` ([bsz, max_blocks], 1-D) and `block_tables_head_wise` ([bsz, H, max_blocks],
    page ids, -1 = recycled) is set. From the model runner, the batch-sized tensors are views of the
    fixed step buffers (worker/step_buffers.py): `bsz` is max_num_seqs and rows past the step's
    requests are idle (0 new tokens, -1 entries); `starts`/`lengths`/`slot_ids` list the live ones.
    """

    input_ids: paddle.Tensor           # int64 [token_num]
    seq_lens_encoder: paddle.Tensor    # int32 [bsz]
    seq_lens_decoder: paddle.Tensor    # int32 [bsz]
    seq_lens_this_time: paddle.Tensor  # int32 [bsz]
    cu_seqlens_q: paddle.Tensor        # int32 [bsz + 1]
    block_tables: Optional[paddle.Tensor]
    block_tables_head_wise: Optional[paddle.Tensor]
    sample_rows: paddle.Tensor         # int64 [num_sampled]: last row of each request that samples
    starts: list                       # python copies for the dense reference backend
    lengths: list
    slot_ids: list                     # the requests' persistent slots (dense reference storage)
    attn_backend: Any = None
