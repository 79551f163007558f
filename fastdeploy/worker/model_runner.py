"""ModelRunner: a scheduled batch -> tensors -> ForwardMeta -> model -> sampled tokens."""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy.engine.sched.resource_manager_v1 import ScheduledBatch
from fastdeploy.model_executor.forward_meta import ForwardMeta
from fastdeploy.model_executor.host_tensor import host_tensor
from fastdeploy.model_executor.layers.attention import get_attention_backend
from fastdeploy.model_executor.layers.rotary_embedding import rope_tables
from fastdeploy.model_executor.layers.sampler import has_penalties, is_greedy, sample_one
from fastdeploy.model_executor.models.ernie4_5 import Ernie4_5ForCausalLM


class ModelRunner:
    def __init__(self, fd_config):
        paddle.set_device("cpu")
        self.fd_config = fd_config
        model = fd_config.model_config
        self.head_wise = fd_config.head_wise_kv_cache
        self.num_kv_heads = model.num_key_value_heads
        self.eos_token_id = model.eos_token_ids
        self.model = Ernie4_5ForCausalLM.load(model)
        cos, sin = rope_tables(model.head_dim, model.max_model_len, model.rope_theta)
        self.attn_backend = get_attention_backend(fd_config, cos, sin)
        self._free_slots = list(range(fd_config.scheduler_config.max_num_seqs - 1, -1, -1))
        self._slot_of: dict = {}

    def release(self, request_id: str) -> None:
        """Forget a request that finished, was aborted or preempted (its slot serves the next one)."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _slot(self, request_id: str) -> int:
        if request_id not in self._slot_of:
            self._slot_of[request_id] = self._free_slots.pop()
        return self._slot_of[request_id]

    def build_forward_meta(self, batch: ScheduledBatch) -> ForwardMeta:
        scheduled = batch.requests
        bsz = len(scheduled)
        starts = [s.start for s in scheduled]
        lengths = [s.num_tokens for s in scheduled]
        cu = np.zeros(bsz + 1, np.int32)
        np.cumsum(lengths, out=cu[1:])
        ids = np.empty(int(cu[-1]), np.int64)
        for i, s in enumerate(scheduled):
            ids[cu[i]:cu[i + 1]] = s.request.token_ids(s.start, s.start + s.num_tokens)
        encoder = np.array([n if (n > 1 or st < s.request.num_prompt_tokens) else 0
                            for s, st, n in zip(scheduled, starts, lengths)], np.int32)
        sample_rows = np.array([cu[i + 1] - 1 for i, s in enumerate(scheduled) if s.samples], np.int64)

        tables_1d = tables_hw = None
        if self.head_wise:
            width = max(len(s.request.block_tables_head_wise[0]) for s in scheduled)
            table = np.full((bsz, self.num_kv_heads, width), -1, np.int32)
            for i, s in enumerate(scheduled):
                for h, row in enumerate(s.request.block_tables_head_wise):
                    table[i, h, :len(row)] = row
            tables_hw = host_tensor(table)
        else:
            width = max(len(s.request.block_tables) for s in scheduled)
            table = np.full((bsz, width), -1, np.int32)
            for i, s in enumerate(scheduled):
                table[i, :len(s.request.block_tables)] = s.request.block_tables
            tables_1d = host_tensor(table)

        return ForwardMeta(
            input_ids=host_tensor(ids),
            seq_lens_encoder=host_tensor(encoder),
            seq_lens_decoder=host_tensor(np.array(starts, np.int32)),
            seq_lens_this_time=host_tensor(np.array(lengths, np.int32)),
            cu_seqlens_q=host_tensor(cu), block_tables=tables_1d, block_tables_head_wise=tables_hw,
            sample_rows=host_tensor(sample_rows), starts=starts, lengths=lengths,
            slot_ids=[self._slot(s.request.request_id) for s in scheduled], attn_backend=self.attn_backend)

    def execute(self, batch: ScheduledBatch) -> tuple:
        """Run one step; returns (token per scheduled request or None, logprobs per request or None,
        {index: error message} of requests whose sampling failed: they get no token)."""
        meta = self.build_forward_meta(batch)
        logits = self.model.forward(meta).numpy()
        tokens, logprobs = [None] * len(batch.requests), [None] * len(batch.requests)
        failures: dict = {}
        sampling = [i for i, s in enumerate(batch.requests) if s.samples]
        greedy = np.argmax(logits, axis=-1) if len(sampling) else ()
        for row, i in enumerate(sampling):
            request = batch.requests[i].request
            params = request.sampling_params
            if is_greedy(params) and params.logprobs is None and not params.logit_bias and \
                    not has_penalties(params) and len(request.output_token_ids) >= params.min_tokens:
                tokens[i] = int(greedy[row])  # the common case, batched above
            else:
                try:
                    tokens[i], logprobs[i] = sample_one(logits[row], request, self.eos_token_id)
                except Exception as exc:  # one request's parameters must not stop the batch
                    failures[i] = f"{type(exc).__name__}: {exc}"
        return tokens, logprobs, failures
