"""LLMEngine: the step loop — recycle + schedule, run the model, update requests, emit outputs."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Optional, Union

import numpy as np

from fastdeploy.disaggregation.transfer_config import parse_kv_transfer_params
from fastdeploy.engine.activity_log import ActivityLog
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.request import CompletionOutput, Request, RequestOutput, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1
from fastdeploy.engine.stop_strings import find_stop, releasable
from fastdeploy.input.tokenizer_loader import load_tokenizer
from fastdeploy.log_format import restyle_paddle_handlers
from fastdeploy.model_executor.guided_decoding.backend import LLGuidanceBackend
from fastdeploy.model_executor.layers.sampler import min_tokens_bans

logger = logging.getLogger("fastdeploy.engine")

TIER_LOAD_WAIT_S = 0.05  # a step with nothing to run waits this long at most for a load from the lower tiers


class LLMEngine:
    """Single-threaded engine: one caller drives add_request / abort_request / step."""

    def __init__(self, fd_config):
        from fastdeploy.engine.step_runner import StepRunner  # imports Paddle (TP=1) or starts the workers

        restyle_paddle_handlers()  # Paddle's import may have given the root logger its own format

        self.fd_config = fd_config
        self.model_config = fd_config.model_config
        self.tokenizer = load_tokenizer(self.model_config)
        self.scheduler = ResourceManagerV1(fd_config)
        self.runner = StepRunner(fd_config, self.scheduler.kv_cache_manager)
        self.guided = None  # guided decoding's grammar engine (llguidance), unless turned off
        if fd_config.guided_decoding_backend != "off":
            self.guided = LLGuidanceBackend(self.tokenizer, self.model_config.vocab_size,
                                            self.model_config.eos_token_ids)
        self._seeds = np.random.default_rng()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.engine_steps_total = 0  # steps that ran the model: the denominator of per-step cost
        self._activity = ActivityLog(fd_config.env.FD_LOG_INTERVAL, logger)
        # Prefill/decode disaggregation (--splitwise-role, --kv-transfer-config): the transfer engine.
        self.connector = None
        if fd_config.kv_transfer_config is not None:
            from fastdeploy.disaggregation.nixl_connector import NixlConnector

            self.connector = NixlConnector(fd_config.kv_transfer_config, fd_config, self.scheduler.kv_cache_manager,
                                           self.runner.kv_tensors())
        # The prefix cache's host tier (--swap-space): evicted pages a hit can read are copied there; below it
        # the disk tier (--kvcache-storage-backend file), whose files outlive the process.
        if fd_config.cache_config.swap_space_bytes:
            tier = self._lower_tiers()
            self.scheduler.cache_manager.attach_host_tier(tier, fd_config.env.FD_TIER_LOAD_INLINE_MS / 1e3)
            if tier.files is not None:
                logger.info("disk tier: %d pages of an earlier run restored from %s (at most %d pages of %d bytes)",
                            tier.disk_restored_total, tier.files.dir, tier.disk_capacity, tier.entry_bytes)
        # KV-cache events (--kv-events-config): where prefix hits are valid here, for KV-aware routers.
        self.kv_events = self.kv_event_publisher = None
        if fd_config.kv_events_config is not None:
            from fastdeploy.cache_manager.kv_events import HitEndEvents
            from fastdeploy.engine.kv_events_publisher import make_publisher

            self.kv_events = HitEndEvents(self.scheduler.kv_cache_manager.pages.prefix_cache,
                                          fd_config.kv_events_config.stored_blocks)
            self.kv_event_publisher = make_publisher(fd_config.kv_events_config)
        for level, message in fd_config.startup_log(self.scheduler.cache_manager.num_total_pages):
            logger.log(level, message)

    def _lower_tiers(self):
        from fastdeploy.cache_manager.disk_tier import PageFiles, cache_identity, model_fingerprint
        from fastdeploy.cache_manager.host_tier import HostTier

        cache, kv = self.fd_config.cache_config, self.scheduler.kv_cache_manager
        tier = HostTier.for_bytes(cache.swap_space_bytes, self.runner.kv_tensors(),
                                  kv.pages_per_rank // kv.pages_per_entry, dtype=cache.swap_space_dtype,
                                  head_dim=self.model_config.head_dim)
        if cache.kvcache_storage_backend == "file":
            mc = self.model_config
            identity = cache_identity(model=model_fingerprint(mc.model), seed=mc.seed, preset=mc.preset,
                                      architectures=mc.architectures, head_wise_swa=mc.head_wise_swa,
                                      kv_head_orders=mc.kv_head_orders, layout=kv.layout, dtype=cache.cache_dtype,
                                      quant=cache.kv_cache_quant_type, units=tier.units,
                                      tier_dtype=cache.swap_space_dtype)
            tier.attach_disk(PageFiles(cache.kvcache_storage_path, identity, tier.entry_bytes),
                             int(cache.kvcache_storage_space * (1 << 30)))
        return tier

    def close(self) -> None:
        """Write the prefix cache's pages to the disk tier (with one), stop the tensor-parallel worker
        processes (a no-op with one rank) and the transfer engine's side channel; idempotent."""
        if not getattr(self, "_persisted", False):
            self._persisted = True
            self.scheduler.close_tier_loads()  # loads in flight finish first: their pages are then plain cached pages
            written = self.scheduler.cache_manager.persist_prefix_cache()
            if written:
                logger.info("disk tier: %d pages written for the next start", written)
            tier = self.scheduler.cache_manager.host_tier
            if tier is not None and tier.files is not None:
                tier.files.close()
        if self.connector is not None:
            self.connector.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
        self.runner.close()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLMEngine":
        return cls(engine_args.create_engine_config())

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Union[str, list], sampling_params: SamplingParams,
                    kv_transfer_params: Optional[dict] = None) -> None:
        """Queue a request; raise ValueError with a user-facing message if it cannot run.
        `kv_transfer_params`: its part in a prefill/decode pair (disaggregation/transfer_config.py)."""
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams")
        sampling_params.validate()
        token_ids = self._tokenize(prompt)
        self._check_token_ids("logit_bias", sampling_params.logit_bias or ())
        self._check_token_ids("stop_token_ids", sampling_params.stop_token_ids or ())
        if sampling_params.min_tokens and len(min_tokens_bans(sampling_params, self.model_config.eos_token_ids)) \
                >= self.model_config.vocab_size:
            raise ValueError("min_tokens leaves nothing to sample: EOS and stop_token_ids cover the whole "
                             "vocabulary")
        n, max_len = len(token_ids), self.model_config.max_model_len
        if n >= max_len:
            raise ValueError(f"This model's maximum context length is {max_len} tokens, but the prompt has {n} "
                             f"tokens, leaving no room for the completion (max_model_len is {max_len})")
        if sampling_params.max_tokens is None:  # the OpenAI rule: fill the rest of the context
            sampling_params = replace(sampling_params, max_tokens=max_len - n)
        elif n + sampling_params.max_tokens > max_len:
            raise ValueError(f"This model's maximum context length is {max_len} tokens. However, you requested "
                             f"{n + sampling_params.max_tokens} tokens ({n} in the prompt, "
                             f"{sampling_params.max_tokens} for the completion): the total exceeds "
                             f"max_model_len={max_len}. Reduce the prompt or max_tokens.")
        request = Request(request_id, token_ids, sampling_params, eos_token_id=self.model_config.eos_token_ids)
        if self.connector is not None:
            self.connector.accept(request, kv_transfer_params)
        else:
            parse_kv_transfer_params(kv_transfer_params, None, n)  # refuses any transfer, by name
        if sampling_params.guided_decoding is not None:
            if self.guided is None:
                raise ValueError("guided decoding is off on this server (--guided-decoding-backend off)")
            request.grammar = self.guided.grammar_state(sampling_params)  # ValueError if it cannot compile
        seed = sampling_params.seed
        request.generator = np.random.default_rng(seed if seed is not None else self._seeds.integers(2 ** 63))
        self.scheduler.add_request(request)
        self.prompt_tokens_total += len(token_ids)

    def _tokenize(self, prompt: Union[str, list]) -> list:
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode_prompt(prompt) if prompt else []
            if not token_ids:
                raise ValueError("prompt is empty")
            return token_ids
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        self._check_token_ids("prompt", prompt)
        return [int(t) for t in prompt]

    def _check_token_ids(self, field: str, token_ids) -> None:
        vocab = self.model_config.vocab_size
        for t in token_ids:
            if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"{field}: token id {t!r} is outside the vocabulary [0, {vocab})")

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its KV pages now (a decode request whose prompt KV is being read: when
        the read ends, never while it writes them); unknown or finished ids are ignored."""
        request = self.scheduler.requests.get(request_id)
        reading = request is not None and request.remote_kv is not None and request.kv_loading \
            and self.connector.forget(request_id)
        if self.scheduler.abort_request(request_id, keep_pages=reading) is not None:
            self.runner.release(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_runnable_requests(self) -> bool:
        """Whether a step may run the model now (requests waiting for their KV's transfer cannot)."""
        return self.scheduler.has_runnable_requests()

    @property
    def transfers_pending(self) -> bool:
        """KV transfers, parked pages or loads from the lower tiers to watch: the caller steps (which polls
        them) often."""
        return self.connector is not None and self.connector.busy or self.scheduler.tier_loads_pending

    def _transfers(self) -> list:
        """Advance the KV transfers: decode requests whose prompt KV arrived run from the next schedule;
        a failed one is recomputed here or fails with its reason (kv_load_failure_policy)."""
        outputs = []
        recompute = self.fd_config.kv_transfer_config.kv_load_failure_policy == "recompute"
        for outcome in self.connector.poll():
            request = outcome.request
            if self.scheduler.requests.get(request.request_id) is not request:  # aborted while it was read
                self.scheduler.kv_cache_manager.free(request.request_id)
            elif outcome.error is None:
                self.scheduler.kv_loaded(request)
            else:
                self.scheduler.kv_load_failed(request, recompute)
                if not recompute:
                    out = self._output(request, "")
                    out.error = f"loading the prompt's KV from the prefill server failed: {outcome.error}"
                    outputs.append(out)
        return outputs

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list:
        outputs = self._step()
        if self.kv_events is not None:  # what this step stored in / evicted from the prefix cache
            self.kv_event_publisher.publish(self.kv_events.collect())
        return outputs

    def _step(self) -> list:
        outputs = self._transfers() if self.connector is not None else []
        batch = self.scheduler.schedule()
        for request in batch.preempted:
            self.runner.release(request.request_id)
        for request in batch.loading:
            if request.remote_kv is not None:  # a tier hit's load is already running (tier_loader.py)
                self.connector.start_load(request)
        if not batch.requests:
            if self.scheduler.tier_loads_pending:  # only loads can make progress: wait for one, do not spin
                self.scheduler.wait_for_tier_loads(TIER_LOAD_WAIT_S)
            return outputs
        self._activity.step_started()
        tokens, logprobs, failures = self.runner.execute(batch)
        self.engine_steps_total += 1
        outputs += [self._fail(batch.requests[i].request, error) for i, error in failures.items()]
        before = {s.request.request_id: len(s.request.output_token_ids) for s in batch.requests}
        progressed = self.scheduler.update_from_output(batch, tokens, logprobs)
        new_tokens = 0
        for request in progressed:
            if request.sampling_params.stop:  # may end the output inside the step's accepted drafts
                num_new = len(request.output_token_ids) - before[request.request_id]
                text = self._stop_strings_token_by_token(request, num_new)
            else:
                text = self.tokenizer.decode_incremental(request.output_token_ids, request.detokenize_state)
            new_tokens += len(request.output_token_ids) - before[request.request_id]
            output = self._output(request, text)
            if request.is_finished:
                self.runner.release(request.request_id)
                if request.hands_off_kv:  # its pages are parked for the decode server
                    output.kv_transfer_params = self._hand_off(request)
            outputs.append(output)
        self.generation_tokens_total += new_tokens
        self._activity.step_finished(new_tokens, self.get_stats, busy=self.has_unfinished_requests())
        return outputs

    def _hand_off(self, request: Request) -> dict:
        """The kv_transfer_params of a finished prefill request; if they cannot be made, its pages are
        freed and the decode server is told to compute the prompt itself (one request never stops the
        engine)."""
        try:
            return self.connector.hand_off(request)
        except Exception:
            logger.exception("request %s: handing its KV to the decode server failed; the decode server "
                             "will compute the prompt", request.request_id)
            self.scheduler.kv_cache_manager.free(request.request_id)
            return {"do_remote_prefill": False, "do_remote_decode": False}

    def _fail(self, request: Request, error: str) -> RequestOutput:
        """End a request whose step failed (its pages are freed); the rest of the batch goes on."""
        logger.error("request %s failed and was aborted: %s", request.request_id, error)
        self.scheduler.abort_request(request.request_id)
        self.runner.release(request.request_id)
        text = self.tokenizer.decode_incremental(request.output_token_ids, request.detokenize_state)
        return self._output(request, text)

    def _stop_strings_token_by_token(self, request: Request, num_new: int) -> str:
        """The new tokens of a step, checked for stop strings one at a time as plain decoding would: a
        stop string that ends inside the run of accepted drafts ends the output at that token."""
        outputs, logprobs = request.output_token_ids, request.output_logprobs
        held = outputs[len(outputs) - num_new:]
        held_logprobs = logprobs[len(logprobs) - num_new:] if len(logprobs) >= num_new else []
        del outputs[len(outputs) - num_new:]
        del logprobs[len(logprobs) - len(held_logprobs):]
        text = ""
        for k, token in enumerate(held):
            outputs.append(token)
            logprobs.extend(held_logprobs[k:k + 1])
            text, stopped = self._apply_stop_strings(
                request, self.tokenizer.decode_incremental(outputs, request.detokenize_state))
            if stopped:
                break
        return text

    def _apply_stop_strings(self, request: Request, text: str) -> tuple:
        """(text, stopped): finish the request at its first stop string (cut from the text); else the
        text a client may see now. Like vLLM, a stop string counts once it ends in the min_tokens-th
        token or later, and it wins over a length finish in the same step."""
        params = request.sampling_params
        if len(request.output_token_ids) >= params.min_tokens:
            cut = find_stop(text, params.stop, request.stop_checked)
            if cut is not None:
                if request.is_finished:
                    request.finish_reason = "stop"
                else:
                    self.scheduler.finish_request(request, "stop")
                return text[:cut], True
        # A half decoded character (U+FFFD at the end) is checked again once whole, and held back with
        # the tail that may grow into a stop string: it may complete one ("caf" + half of "é", stop "fé").
        complete = text.rstrip("\ufffd")
        request.stop_checked = len(complete)
        return (text if request.is_finished else releasable(complete, params.stop)), False

    def _output(self, request: Request, text: str) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            outputs=CompletionOutput(
                token_ids=list(request.output_token_ids),
                text=text,
                logprobs=list(request.output_logprobs) if request.sampling_params.logprobs is not None else None,
                finish_reason=request.finish_reason,
            ),
            finished=request.is_finished,
            prompt_logprobs=None if request.sampling_params.prompt_logprobs is None
            else request.prompt_logprobs or [None] * request.num_prompt_tokens,
            metrics={"arrival_time": request.arrival_time, "first_token_time": request.first_token_time,
                     "num_preemptions": request.num_preemptions, "num_cached_tokens": request.num_cached_tokens},
        )

    # -- observability -------------------------------------------------------------------------
    def get_stats(self) -> dict:
        stats = self.scheduler.stats()
        stats.update(prompt_tokens_total=self.prompt_tokens_total,
                     generation_tokens_total=self.generation_tokens_total,
                     engine_steps_total=self.engine_steps_total,
                     max_num_seqs=self.fd_config.scheduler_config.max_num_seqs,
                     # upstream's "block" gauges count what a table entry holds: a page head-wise, a block in 1-D mode
                     kv_pages_per_block=self.scheduler.kv_cache_manager.pages_per_entry)
        # Per tensor-parallel rank: each rank's page pool is that worker's own memory.
        tp = self.fd_config.parallel_config.tensor_parallel_size
        if self.connector is not None:
            stats.update(self.connector.stats())
        if self.kv_events is not None:
            stats.update(kv_events_published_total=self.kv_event_publisher.events_published_total,
                         kv_events_batches_dropped_total=self.kv_event_publisher.batches_dropped_total,
                         kv_events_stored_blocks=len(self.kv_events.stored))
        stats.update(kv_pages_total_per_rank=[self.scheduler.pages_per_rank] * tp,
                     kv_pages_free_per_rank=self.scheduler.cache_manager.free_pages_per_rank(),
                     tp_worker_pids=self.runner.worker_pids)
        return stats
