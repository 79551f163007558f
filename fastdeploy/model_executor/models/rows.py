"""Row alignment of every GEMM: what keeps a request's tokens independent of its batch mates.

CPU GEMM kernels give a row bit-identical results only when the row count is a multiple of
ROW_ALIGN; otherwise the remainder rows take another code path. Padding every step's rows to it
makes a request's tokens independent of which other requests share its batch, so recycling
ON and OFF (different batch mixes) produce identical greedy tokens.
"""

from __future__ import annotations

import paddle

ROW_ALIGN = 8


def aligned(rows: int) -> int:
    return -(-rows // ROW_ALIGN) * ROW_ALIGN


def pad_rows(x: paddle.Tensor, rows: int) -> paddle.Tensor:
    extra = rows - x.shape[0]
    if extra == 0:
        return x
    return paddle.concat([x, paddle.zeros([extra] + list(x.shape[1:]), dtype=x.dtype)], axis=0)
