"""Engine side of a model step: scheduled batch -> StepInput -> model ranks -> sampled tokens.

The ranks are either one in-process ModelRunner (tensor_parallel_size 1: no process hop, the fast
path the test suite uses) or a WorkerGroup of one process per rank. Slots (the dense reference
backend's per-request storage) and the samplers that need request state (seeded generators,
penalties, min_tokens, logprobs) stay here, beside the scheduler.
"""

from __future__ import annotations

import numpy as np

from fastdeploy.engine.prompt_logprobs import attach_prompt_rows, store_prompt_logprobs
from fastdeploy.engine.sched.resource_manager_v1 import ScheduledBatch
from fastdeploy.model_executor.guided_decoding.masks import StepMasks
from fastdeploy.model_executor.layers.sampler import has_penalties, is_greedy, sample_one
from fastdeploy.spec_decode.verify import AcceptedHistory, accept_drafts
from fastdeploy.worker.step_input import StepInput


class StepRunner:
    def __init__(self, fd_config):
        self.fd_config = fd_config
        self.head_wise = fd_config.head_wise_kv_cache
        self.num_slots = fd_config.slot_layout.num_slots  # head-wise table rows, all ranks
        self.eos_token_id = fd_config.model_config.eos_token_ids  # one id or several
        if fd_config.parallel_config.tensor_parallel_size == 1:
            from fastdeploy.worker.model_runner import ModelRunner  # imports Paddle

            self.ranks = ModelRunner(fd_config)
        else:
            from fastdeploy.engine.worker_group import WorkerGroup

            self.ranks = WorkerGroup(fd_config)
        self._free_slots = list(range(fd_config.scheduler_config.max_num_seqs - 1, -1, -1))
        self._slot_of: dict = {}

    # In-process views (tensor_parallel_size 1), for tests and tools that inspect the model.
    @property
    def model(self):
        return self.ranks.model

    @property
    def attn_backend(self):
        return self.ranks.attn_backend

    @property
    def worker_pids(self) -> list:
        """Process id of each rank's worker (empty when the single rank runs in-process)."""
        return list(getattr(self.ranks, "pids", []))

    def close(self) -> None:
        """Stop the worker processes, if any (idempotent)."""
        close = getattr(self.ranks, "close", None)
        if close is not None:
            close()

    def release(self, request_id: str) -> None:
        """Forget a request that finished, was aborted or preempted (its slot serves the next one)."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _slot(self, request_id: str) -> int:
        if request_id not in self._slot_of:
            self._slot_of[request_id] = self._free_slots.pop()
        return self._slot_of[request_id]

    def build_step_input(self, batch: ScheduledBatch) -> StepInput:
        scheduled = batch.requests
        bsz = len(scheduled)
        starts = [s.start for s in scheduled]
        lengths = [s.num_tokens for s in scheduled]
        cu = np.zeros(bsz + 1, np.int32)
        np.cumsum(lengths, out=cu[1:])
        ids = np.empty(int(cu[-1]), np.int64)
        for i, s in enumerate(scheduled):
            ids[cu[i]:cu[i + 1]] = s.token_ids()
        encoder = np.array([n if (n > 1 or st < s.request.num_prompt_tokens) else 0
                            for s, st, n in zip(scheduled, starts, lengths)], np.int32)
        # A sampling request's last row; with drafts, every row of its piece (spec_decode/verify.py).
        rows = [range(cu[i + 1] - 1 - len(s.draft_token_ids), cu[i + 1]) for i, s in enumerate(scheduled)
                if s.samples]
        sample_rows = np.fromiter((r for span in rows for r in span), np.int64)
        greedy = np.repeat([_argmax_is_enough(s.request) for s in scheduled if s.samples],
                           [len(span) for span in rows]).astype(bool)

        tables_1d = tables_hw = None
        if self.head_wise:
            width = max(len(s.request.block_tables_head_wise[0]) for s in scheduled)
            tables_hw = np.full((bsz, self.num_slots, width), -1, np.int32)
            for i, s in enumerate(scheduled):
                for h, row in enumerate(s.request.block_tables_head_wise):
                    tables_hw[i, h, :len(row)] = row
        else:
            width = max(len(s.request.block_tables) for s in scheduled)
            tables_1d = np.full((bsz, width), -1, np.int32)
            for i, s in enumerate(scheduled):
                tables_1d[i, :len(s.request.block_tables)] = s.request.block_tables

        step = StepInput(
            input_ids=ids, seq_lens_encoder=encoder, seq_lens_decoder=np.array(starts, np.int32),
            seq_lens_this_time=np.array(lengths, np.int32), cu_seqlens_q=cu, block_tables=tables_1d,
            block_tables_head_wise=tables_hw, sample_rows=sample_rows, greedy=greedy,
            slot_ids=[self._slot(s.request.request_id) for s in scheduled])
        attach_prompt_rows(step, scheduled)
        return step

    def execute(self, batch: ScheduledBatch) -> tuple:
        """Run one step; returns (token per scheduled request or None, logprobs per request or None,
        {index: error message} of requests whose sampling failed: they get no token). A request
        with drafts gets lists: its accepted drafts and the next token, with their logprobs."""
        step = self.build_step_input(batch)
        masks = StepMasks.start(batch)  # grammar masks, computed while the model runs
        out = self.ranks.execute_model(step)
        banned = masks.result() if masks is not None else {}
        store_prompt_logprobs(batch.requests, step, out.prompt_logprobs)
        tokens, logprobs = [None] * len(batch.requests), [None] * len(batch.requests)
        failures: dict = {}
        row = other = 0  # the request's first sampled row; its first row among the logits
        for i, scheduled in enumerate(batch.requests):
            if not scheduled.samples:
                continue
            request, drafts = scheduled.request, scheduled.draft_token_ids
            num_rows = len(drafts) + 1
            if step.greedy[row]:  # the common case, reduced on the worker
                greedy = out.greedy_tokens[row:row + num_rows]
                sample_row = lambda j, accepted: (int(greedy[j]), None)  # noqa: E731
            else:
                logits, rows_banned = out.logits[other:other + num_rows], banned.get(i)
                sample_row = lambda j, accepted: sample_one(  # noqa: E731
                    logits[j], AcceptedHistory(request, accepted), self.eos_token_id,
                    None if rows_banned is None else rows_banned[j])
                other += num_rows
            row += num_rows
            try:
                if drafts:
                    tokens[i], logprobs[i] = accept_drafts(drafts, sample_row)
                else:
                    tokens[i], logprobs[i] = sample_row(0, [])
                if request.grammar is not None:
                    request.grammar.accept(tokens[i] if drafts else [tokens[i]])
            except Exception as exc:  # one request's parameters must not stop the batch
                failures[i] = f"{type(exc).__name__}: {exc}"
        return tokens, logprobs, failures


def _argmax_is_enough(request) -> bool:
    params = request.sampling_params
    return (is_greedy(params) and params.logprobs is None and not params.logit_bias and not has_penalties(params)
            and len(request.output_token_ids) >= params.min_tokens and request.grammar is None)
