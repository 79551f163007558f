"""The persistent batch (vLLM's persistent input batch): each running request keeps one batch row.

A request takes the lowest free row when it is first scheduled and keeps it until it finishes, is
aborted or preempted. The workers keep the block table of every row between steps; a step sends only
the entries the KV cache manager changed since the request's last step (its PageTable updates) and a
reset for each row given back, so no step rebuilds or re-sends a table. A step lays its requests out in
row order (rows not scheduled now are idle: 0 tokens), so the table needs no reordering either.
"""

from __future__ import annotations

import heapq

import numpy as np

from fastdeploy.engine.prompt_logprobs import attach_prompt_rows
from fastdeploy.model_executor.layers.sampler import has_penalties, is_greedy
from fastdeploy.worker.step_input import StepInput, TableUpdate


class PersistentBatch:
    def __init__(self, fd_config, kv_cache_manager):
        self.kv_cache_manager = kv_cache_manager  # the scheduler's: the source of every table change
        self._free_rows = list(range(fd_config.scheduler_config.max_num_seqs))  # a heap: the lowest row first
        self._row_of: dict = {}
        self._released: list = []  # resets of the rows given back, sent with the next step

    def release(self, request_id: str) -> None:
        """Forget a request that finished, was aborted or preempted: its row serves the next one, its
        table entries reset to -1 with the next step."""
        row = self._row_of.pop(request_id, None)
        if row is not None:
            heapq.heappush(self._free_rows, row)
            self._released.append(TableUpdate(row, None, 0, None))

    def row(self, request_id: str) -> int:
        if request_id not in self._row_of:
            self._row_of[request_id] = heapq.heappop(self._free_rows)  # keeps the rows in use low: a small bsz
        return self._row_of[request_id]

    def step_input(self, batch) -> tuple:
        """(StepInput, the scheduled indices in row order) of a scheduled batch."""
        scheduled, kv = batch.requests, self.kv_cache_manager
        rows = [self.row(s.request.request_id) for s in scheduled]
        order = sorted(range(len(scheduled)), key=rows.__getitem__)
        bsz = rows[order[-1]] + 1 if order else 0
        starts, lengths, encoder = (np.zeros(bsz, np.int32) for _ in range(3))
        for row, s in zip(rows, scheduled):
            starts[row], lengths[row] = s.start, s.num_tokens
            encoder[row] = s.num_tokens if (s.num_tokens > 1 or s.start < s.request.num_prompt_tokens) else 0
        cu = np.zeros(bsz + 1, np.int32)
        np.cumsum(lengths, out=cu[1:])
        ids = np.empty(int(cu[-1]), np.int64)
        for i in order:
            ids[cu[rows[i]]:cu[rows[i] + 1]] = scheduled[i].token_ids()
        # A sampling request's last row; with drafts, every row of its piece (spec_decode/verify.py).
        spans = [range(cu[rows[i] + 1] - 1 - len(scheduled[i].draft_token_ids), cu[rows[i] + 1]) for i in order
                 if scheduled[i].samples]
        sample_rows = np.fromiter((r for span in spans for r in span), np.int64)
        greedy = np.repeat([_argmax_is_enough(scheduled[i].request) for i in order if scheduled[i].samples],
                           [len(span) for span in spans]).astype(bool)
        updates, self._released = self._released, []
        for row, s in zip(rows, scheduled):
            updates += [_table_update(row, *u) for u in kv.take_updates(s.request.request_id)]
        step = StepInput(
            input_ids=ids, seq_lens_encoder=encoder, seq_lens_decoder=starts, seq_lens_this_time=lengths,
            cu_seqlens_q=cu, table_updates=updates, sample_rows=sample_rows,
            greedy=greedy, slot_ids=[rows[i] for i in order])
        attach_prompt_rows(step, [scheduled[i] for i in order], [int(cu[rows[i]]) for i in order])
        return step, order


def _table_update(row: int, slots, col: int, width: int, ids) -> TableUpdate:
    """A KV cache manager's table change (PageTable.updates) placed in batch row `row`."""
    return TableUpdate(row, None if slots is None else np.asarray(slots, np.int64), col, width,
                       None if ids is None else np.asarray(ids, np.int32).reshape(-1, width))


def _argmax_is_enough(request) -> bool:
    params = request.sampling_params
    return (is_greedy(params) and params.logprobs is None and not params.logit_bias and not has_penalties(params)
            and len(request.output_token_ids) >= params.min_tokens and request.grammar is None)
