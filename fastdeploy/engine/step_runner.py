"""Engine side of a model step: scheduled batch -> StepInput -> model ranks -> sampled tokens.

The ranks are either one in-process ModelRunner (tensor_parallel_size 1: no process hop, the fast
path the test suite uses) or a WorkerGroup of one process per rank. The persistent batch (each running
request's batch row, which is also the dense reference backend's per-request storage) and the samplers
that need request state (seeded generators, penalties, min_tokens, logprobs) stay here, beside the
scheduler.
"""

from __future__ import annotations

import numpy as np

from fastdeploy.engine.persistent_batch import PersistentBatch
from fastdeploy.engine.prompt_logprobs import store_prompt_logprobs
from fastdeploy.engine.sched.resource_manager_v1 import ScheduledBatch
from fastdeploy.model_executor.guided_decoding.masks import StepMasks
from fastdeploy.model_executor.layers.sampler import sample_one
from fastdeploy.spec_decode.verify import AcceptedHistory, accept_drafts
from fastdeploy.worker.step_input import StepInput


class StepRunner:
    def __init__(self, fd_config, kv_cache_manager=None):
        self.fd_config = fd_config
        self.eos_token_id = fd_config.model_config.eos_token_ids  # one id or several
        if fd_config.parallel_config.tensor_parallel_size == 1:
            from fastdeploy.worker.model_runner import ModelRunner  # imports Paddle

            self.ranks = ModelRunner(fd_config)
        else:
            from fastdeploy.engine.worker_group import WorkerGroup

            self.ranks = WorkerGroup(fd_config)
        self.batch = PersistentBatch(fd_config, kv_cache_manager)

    # In-process views (tensor_parallel_size 1), for tests and tools that inspect the model.
    @property
    def model(self):
        return self.ranks.model

    @property
    def attn_backend(self):
        return self.ranks.attn_backend

    def kv_tensors(self) -> list:
        """The in-process rank's KV tensors (a KV transfer engine registers them; config allows TP=1 only)."""
        return self.ranks.attn_backend.kv_tensors()

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
        """Forget a request that finished, was aborted or preempted (its batch row serves the next one)."""
        self.batch.release(request_id)

    def build_step_input(self, batch: ScheduledBatch) -> StepInput:
        return self.batch.step_input(batch)[0]

    def execute(self, batch: ScheduledBatch) -> tuple:
        """Run one step; returns (token per scheduled request or None, logprobs per request or None,
        {index: error message} of requests whose sampling failed: they get no token). A request
        with drafts gets lists: its accepted drafts and the next token, with their logprobs."""
        step, order = self.batch.step_input(batch)
        masks = StepMasks.start(batch)  # grammar masks, computed while the model runs
        out = self.ranks.execute_model(step)
        banned = masks.result() if masks is not None else {}
        store_prompt_logprobs([batch.requests[i] for i in order], out.prompt_logprobs)
        tokens, logprobs = [None] * len(batch.requests), [None] * len(batch.requests)
        failures: dict = {}
        row = other = 0  # the request's first sampled row; its first row among the logits (batch-row order)
        for i in order:
            scheduled = batch.requests[i]
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

