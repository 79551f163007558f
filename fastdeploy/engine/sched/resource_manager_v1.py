"""ResourceManagerV1: decides, every step, which requests run and how many tokens each.

One `schedule()` call:
1. the KV cache manager recycles the pages that left a sliding window (judged on the tokens already
   processed, before anything is allocated);
2. running requests (FCFS) get their next chunk or decode token under the token budget, their tables
   grown by the KV cache manager; if pages run out, the most recently admitted request is preempted
   (LIFO) and recomputed later (only on-demand admission ever gets there);
3. waiting requests are admitted while slots, budget, pages and the admission policy allow.

Every chunk, a recompute chunk of prompt + outputs included, is capped so its pages fit the whole cache:
a one-token step of an accepted request always does (add_request checks its peak), so the cache is never
idle while a request waits. Pages are the KV cache manager's (cache_manager/kv_cache_manager.py); when to
admit is the admission policy's (sched/admission.py); the scheduler asks both and branches on neither.

Prefix caching (on by default): a waiting request first looks up its longest valid cached prefix,
references those pages and starts its first chunk there. Every block a request finishes computing is
registered right after the step (update_from_output); releasing a request (finish, abort, preemption)
only drops its references, so a preempted request finds its own blocks again. Pages of a hit that only the
host or disk tier holds are loaded off the step (cache_manager/tier_loader.py): the request is admitted in
the loading state (`kv_loading`, like a decode server's remote prefill) and runs once its load has ended; a
failed load sends it back to the front of the queue, to compute what the load could not bring.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Optional

from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
from fastdeploy.engine.request import Request, RequestStatus
from fastdeploy.engine.sched.admission import OnDemandAdmission, ReserveAdmission
from fastdeploy.engine.sched.projected_admission import ProjectedAdmission
from fastdeploy.spec_decode import build_proposer

ADMISSION_POLICIES = {"reserve": ReserveAdmission, "on_demand": OnDemandAdmission, "projected": ProjectedAdmission}


@dataclass
class ScheduledRequest:
    request: Request
    start: int       # tokens already in the cache = position of the first token computed now
    num_tokens: int  # tokens computed this step, draft tokens included
    draft_token_ids: tuple = ()  # speculation: tokens after the request's last one, verified this step

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last token, so a new token is sampled."""
        return self.start + self.num_tokens - len(self.draft_token_ids) == self.request.num_tokens

    def token_ids(self) -> list:
        """The tokens this step computes: the request's own, then the drafts."""
        r, drafts = self.request, self.draft_token_ids
        return r.token_ids(self.start, self.start + self.num_tokens - len(drafts)) + list(drafts)


@dataclass
class ScheduledBatch:
    requests: list = field(default_factory=list)
    preempted: list = field(default_factory=list)
    loading: list = field(default_factory=list)  # admitted in the loading state (a remote prefill's KV or a tier hit)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.requests)

    def __len__(self) -> int:
        return len(self.requests)


class ResourceManagerV1:
    def __init__(self, fd_config, kv_cache_manager: Optional[KVCacheManager] = None, proposer=None):
        self.fd_config = fd_config
        self.kv_cache_manager = kv = kv_cache_manager or KVCacheManager(fd_config)
        self.layout = kv.layout
        self.block_size = kv.block_size
        self.pages_per_rank = kv.pages_per_rank
        self.max_num_seqs = fd_config.scheduler_config.max_num_seqs
        self.max_num_batched_tokens = fd_config.scheduler_config.max_num_batched_tokens
        # One request's tokens per step: the budget, or the window where pages are short (_step_chunk).
        self.cut_chunk = self.layout.cut_chunk(self.max_num_batched_tokens)
        self.max_chunk = self.max_num_batched_tokens  # this step's, set by schedule()
        self.cut_chunk_steps_total = 0  # steps whose prefill chunks were cut to let a waiting request run
        self.max_model_len = fd_config.model_config.max_model_len
        self.waiting: collections.deque = collections.deque()
        self.running: list = []
        self.requests: dict = {}
        self.admission = ADMISSION_POLICIES[fd_config.admission_policy](fd_config, kv, self.running)
        self.num_preemptions_total = 0
        self.recomputed_tokens_total = 0  # tokens computed again after a preemption dropped them
        self.prefix_cache_hit_tokens_total = 0
        self.prefix_cache_query_tokens_total = 0
        self.prefix_cache_query_requests_total = 0  # admissions looked up / with a hit (upstream's hit_req_rate)
        self.prefix_cache_hit_requests_total = 0
        self.prefix_cache_host_hit_tokens_total = 0  # of the hit tokens, those loaded from the host tier
        # Requests admitted in the loading state for a load from the lower tiers: request id -> (the load, the
        # prefix-cache counts its admission added, when it started waiting).
        self._tier_loads: dict = {}
        self.host_cache_load_wait_seconds_total = 0.0  # time requests spent in that state
        # Speculative decoding (spec_decode/): `proposer.propose(request, k)` drafts tokens; tests may
        # pass their own proposer to force acceptance patterns through the real scheduler.
        self.speculative_config = getattr(fd_config, "speculative_config", None)
        self.proposer = proposer if proposer is not None or self.speculative_config is None \
            else build_proposer(self.speculative_config)
        self.spec_decode_num_draft_tokens_total = 0     # draft tokens verified
        self.spec_decode_num_accepted_tokens_total = 0  # of those, accepted
        self.spec_decode_num_drafts_total = 0           # verification steps (a request with >= 1 draft)
        self.spec_decode_num_emitted_tokens_total = 0   # tokens those steps produced (accepted + 1 each)

    @property
    def cache_manager(self):
        """The pages under the KV cache manager (free lists, prefix cache): upstream's PrefixCacheManager."""
        return self.kv_cache_manager.pages

    # -- requests in and out -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; raise ValueError if it could never fit the KV cache."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens < 1:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.sampling_params.max_tokens is None:
            raise ValueError(f"request {request.request_id!r}: max_tokens must be set (the engine fills it in "
                             f"from max_model_len)")
        if request.num_tokens + request.max_new_tokens > self.max_model_len:
            raise ValueError(f"request {request.request_id!r}: prompt ({request.num_prompt_tokens} tokens) plus "
                             f"max_tokens ({request.sampling_params.max_tokens}) exceeds max_model_len="
                             f"{self.max_model_len}")
        # The chunk rule cuts chunks when pages are short: the peak a request can be held to.
        peak = self.layout.peak_pages_per_rank(request.num_tokens, request.max_new_tokens, self.cut_chunk)
        if max(peak) > self.pages_per_rank:
            raise ValueError(f"request {request.request_id!r} needs up to {max(peak)} KV pages per rank but the "
                             f"cache has {self.pages_per_rank}; lower max_tokens or give the cache more blocks")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str, keep_pages: bool = False) -> Optional[Request]:
        """Stop a request and free its pages at once (keep_pages: park them, for a transfer still writing
        them, until the caller frees them); a no-op for unknown or finished ids."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self._tier_loads.pop(request_id, None)  # its load goes on and ends alone (it holds its own pages)
        if request in self.running:
            self.running.remove(request)
            if keep_pages:
                self.kv_cache_manager.park(request_id)
                self.admission.released(request)
                request.num_computed_tokens = 0
            else:
                self._release(request)
        else:
            self.waiting.remove(request)
            self.kv_cache_manager.free(request_id)  # drops its prefix lookup
        request.status = RequestStatus.ABORTED
        request.finish_reason = "abort"
        return request

    def finish_request(self, request: Request, reason: str) -> None:
        if request.request_id not in self.requests:
            return
        del self.requests[request.request_id]
        self.running.remove(request)
        if request.hands_off_kv:  # a prefill server's request: its pages wait for the decode server's read
            self.kv_cache_manager.park(request.request_id)
            self.admission.released(request)  # num_computed_tokens stays: the prompt's KV is what it hands off
        else:
            self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    # -- the loading state: a decode server's remote prefills, hits on the lower tiers -----------
    def kv_loaded(self, request: Request) -> None:
        """The load wrote the KV the request was admitted with (a remote prefill's first
        `remote_kv.num_tokens` tokens, or its prefix hit's pages from a lower tier): it runs."""
        request.kv_loading, request.remote_kv = False, None

    def kv_load_failed(self, request: Request, recompute: bool) -> None:
        """The load failed: the pages go back and the request computes its prompt here (recompute,
        first in line) or leaves the scheduler (the caller fails it)."""
        request.kv_loading, request.remote_kv = False, None
        self.running.remove(request)
        self._release(request)
        if recompute:
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        else:
            del self.requests[request.request_id]
            request.status = RequestStatus.FINISHED
            request.finish_reason = "abort"

    def _end_tier_loads(self, wait: float = 0.0, loads: Optional[list] = None) -> None:
        """End the loads from the lower tiers the loader's thread has finished: a request that waited for one
        runs from its hit, or, if a page could not be loaded (a corrupt file), is released first -- so the
        pages the load never wrote leave the prefix cache with nobody holding them -- and goes back to the
        front of the queue: it looks its prefix up again and computes what is no longer cached."""
        kv = self.kv_cache_manager
        for load in kv.finished_loads(wait) if loads is None else loads:
            waiting = self._tier_loads.get(load.request_id)
            request = self.requests.get(load.request_id) if waiting and waiting[0] is load else None
            if request is not None:
                del self._tier_loads[load.request_id]
                self.host_cache_load_wait_seconds_total += time.perf_counter() - waiting[2]
                if not load.ok:
                    self._uncount_hit(*waiting[1])  # its next admission counts the hit it really gets
                    self.kv_load_failed(request, recompute=True)
            kv.end_load(load)
            if request is not None and load.ok:
                self.kv_loaded(request)

    def _uncount_hit(self, query_tokens: int, hit_tokens: int, from_host: int) -> None:
        self.prefix_cache_query_tokens_total -= query_tokens
        self.prefix_cache_hit_tokens_total -= hit_tokens
        self.prefix_cache_query_requests_total -= 1
        self.prefix_cache_hit_requests_total -= hit_tokens > 0
        self.prefix_cache_host_hit_tokens_total -= from_host

    @property
    def tier_loads_pending(self) -> bool:
        """Loads from the lower tiers not yet ended: a step (which ends them) should come soon."""
        return self.kv_cache_manager.loads_pending

    def wait_for_tier_loads(self, timeout: float) -> None:
        """Nothing could run this step: wait (at most `timeout` seconds) for the oldest load to finish, and end
        what finished, instead of spinning."""
        if self.kv_cache_manager.loads_pending:
            self._end_tier_loads(wait=timeout)

    def close_tier_loads(self) -> None:
        """Shutdown: let the loads in flight finish, stop the loader's thread and end them (their pages stay
        cached, or leave the cache if they could not be written)."""
        self._end_tier_loads(loads=self.kv_cache_manager.close_loads())

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_runnable_requests(self) -> bool:
        """Requests a step could run: waiting ones, or running ones not waiting for a KV transfer."""
        return bool(self.waiting) or any(not r.kv_loading for r in self.running)

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        kv, policy = self.kv_cache_manager, self.admission
        if kv.loads_pending:  # hits whose pages finished loading run this step; failed ones queue again
            self._end_tier_loads()
        kv.recycle()  # processed-token basis, before any allocation
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        policy.new_step()
        self.max_chunk = self._step_chunk()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.kv_loading:  # its pages are held; nothing runs until the transfer is done
                i += 1
                continue
            start = request.num_computed_tokens
            num_new = min(request.num_tokens - start, budget, policy.chunk_of(request, self.max_chunk))
            if num_new > 1:  # a prefill or recompute chunk; one token always fits (add_request checked it)
                num_new = policy.running_chunk(request, num_new, len(self.running) - i - 1)
            while not kv.grow(request.request_id, start + num_new):
                victim = next(r for r in reversed(self.running) if not r.kv_loading)  # a transfer writes the others
                self.running.remove(victim)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is request:
                    break
            else:
                batch.requests.append(ScheduledRequest(request, start, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request preempted itself: nothing behind it is left running

        while self.waiting and not batch.preempted and budget > 0 \
                and len(self.running) < min(self.max_num_seqs, policy.max_running):
            request = self.waiting[0]
            num_new = self._admit(request, budget)
            if num_new is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if request.kv_loading:
                batch.loading.append(request)
                continue
            batch.requests.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
            budget -= num_new
        if self.proposer is not None and budget > 0 and not batch.preempted \
                and self.speculative_config.speculates_with(len(self.running)):
            self._add_drafts(batch, budget)
        return batch

    def _step_chunk(self) -> int:
        """This step's prefill chunk (the chunk rule, PageLayout.chunk_for): the budget, cut to the window
        only when the cut admits more of the waiting requests now (the policy's dry runs change nothing)."""
        budget = self.max_num_batched_tokens
        if self.cut_chunk == budget or not self.waiting or len(self.running) >= self.max_num_seqs:
            return budget
        seats = min(self.max_num_seqs - len(self.running), len(self.waiting))
        chunk = self.layout.chunk_for(budget, lambda c: self.admission.admissions_with(c, self.waiting, seats))
        self.cut_chunk_steps_total += chunk < budget
        return chunk

    def _admit(self, request: Request, budget: int) -> Optional[int]:
        """Give a waiting request its cached prefix and first chunk; the chunk's size, or None if it must wait."""
        kv, policy = self.kv_cache_manager, self.admission
        # A request scoring its prompt computes every position (engine/prompt_logprobs.py): no lookup, and it
        # counts neither as a query nor as a miss of the prefix cache.
        # A decode server's remote prefill: its first tokens' KV comes from the prefill server, into pages
        # taken here (the live ones only) and filled while it waits (batch.loading; no lookup either).
        remote = request.remote_kv
        queried = kv.prefix_caching and request.sampling_params.prompt_logprobs is None and remote is None
        hit = kv.match_prefix(request) if queried else ()
        # Pages of the hit only a lower tier holds get pool pages now; `load` copies them in off the step.
        hit, from_host, load = kv.load_prefix(request, hit)
        if hit is None:  # the hit reads pages another request's load is still writing: wait for it
            return None
        start = remote.num_tokens if remote is not None else len(hit) * self.block_size
        claim = policy.admit(request, start, self.max_chunk)
        if claim is None:
            return None
        num_new = min(request.num_tokens - start, budget, self.max_chunk)
        if num_new > 1:  # a chunk needs no more than the whole cache, whatever it recomputes
            num_new = max(1, self.layout.largest_chunk_within(start, num_new, kv.capacity))
        request.num_computed_tokens = kv.start(request.request_id, hit) if remote is None \
            else kv.start_remote(request.request_id, start)
        if request.num_computed_tokens is None:  # the live pages of the remote KV do not fit now
            request.num_computed_tokens = 0
            return None
        num_new = policy.first_chunk(request, num_new, claim)
        if not num_new or not kv.grow(request.request_id, start + num_new):
            kv.free(request.request_id)  # drops the references the hit took
            request.num_computed_tokens = 0
            return None
        if queried:
            self.prefix_cache_query_tokens_total += request.num_tokens
            self.prefix_cache_hit_tokens_total += start
            self.prefix_cache_query_requests_total += 1
            self.prefix_cache_hit_requests_total += start > 0
            self.prefix_cache_host_hit_tokens_total += from_host
            request.num_cached_tokens = start
        policy.admitted(request, self.max_chunk)
        request.kv_loading = remote is not None or load is not None
        if load is not None:  # it waits in the loading state until the load ends (_end_tier_loads)
            load.request_id = request.request_id
            counted = (request.num_tokens, start, from_host)  # a load comes only with a looked-up hit
            self._tier_loads[request.request_id] = (load, counted, time.perf_counter())
        return num_new

    # -- speculative decoding ------------------------------------------------------------------
    def _add_drafts(self, batch: ScheduledBatch, budget: int) -> None:
        """Give decoding requests draft tokens from what the step has left (docs/scheduler.md).

        Drafts come last, after every running request's own token and every admission, and take
        only the budget and free pages nothing else needs; they never preempt and never count in
        admission. Under a grammar a draft is cut at its first token the grammar forbids. A rejected
        draft's pages return in update_from_output, so what a request holds after the step is the need
        of its accepted tokens alone; the admission policy may cap a request's drafts (projected: while
        the curves still fit with its curve moved as far as its drafts could take it).
        """
        k_max = self.speculative_config.num_speculative_tokens
        limit = self.admission.draft_limit()
        for scheduled in batch.requests:
            request = scheduled.request
            if budget <= 0:
                break
            if scheduled.num_tokens != 1 or not scheduled.samples:
                continue  # a prefill chunk, or a chunk that does not reach the last token
            k = min(k_max, request.max_new_tokens - 1, budget)  # never past max_tokens
            drafts = self.proposer.propose(request, k)[:k] if k > 0 else []
            if drafts and request.grammar is not None:  # a draft the grammar forbids could never be accepted
                drafts = request.grammar.valid_drafts(drafts)
            if drafts and limit is not None:
                drafts = drafts[:limit(request, len(drafts))]
            num = self._grow_for_drafts(request, len(drafts)) if drafts else 0
            if num:
                scheduled.draft_token_ids = tuple(drafts[:num])
                scheduled.num_tokens += num
                budget -= num

    def _grow_for_drafts(self, request: Request, num_drafts: int) -> int:
        """Most of `num_drafts` drafts the request's table can address: all of them if free pages
        allow, else those that fit the pages it already holds."""
        kv = self.kv_cache_manager
        end = request.num_computed_tokens + 1
        room = kv.addressable_tokens(request.request_id) - end
        if num_drafts <= room or kv.grow(request.request_id, end + num_drafts):
            return num_drafts
        return max(0, room)

    def _count_verification(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_decode_num_drafts_total += 1
        self.spec_decode_num_draft_tokens_total += num_drafts
        self.spec_decode_num_accepted_tokens_total += num_accepted
        self.spec_decode_num_emitted_tokens_total += num_accepted + 1

    # -- after the step ------------------------------------------------------------------------
    def update_from_output(self, batch: ScheduledBatch, sampled_token_ids: list,
                           sampled_logprobs: Optional[list] = None) -> list:
        """Advance every scheduled request; append sampled tokens; finish stopped requests.

        `sampled_token_ids[i]` belongs to `batch.requests[i]` (None where it did not sample): one
        token, or for a request with drafts the list the verification produced (its accepted drafts,
        then the model's own next token), with `sampled_logprobs[i]` a list alike. Tokens are
        appended one by one and the request stops at the first that ends it (EOS, stop token,
        max_tokens). Returns the requests that received a token this step, finished ones included.
        """
        kv, progressed = self.kv_cache_manager, []
        for i, scheduled in enumerate(batch.requests):
            request = scheduled.request
            if request.is_finished:  # aborted between schedule and update
                continue
            drafts = scheduled.draft_token_ids
            tokens = sampled_token_ids[i]
            logprobs = sampled_logprobs[i] if sampled_logprobs else None
            if drafts:
                tokens, logprobs = self._verified(request, drafts, tokens, logprobs)
            else:
                tokens, logprobs = [tokens], [logprobs]
            # KV is kept for the accepted drafts only: the window of a sliding head, recycling and
            # prefix caching all count accepted tokens; pages written only for rejected ones go back.
            request.num_computed_tokens = scheduled.start + scheduled.num_tokens - len(drafts) + len(tokens) - 1
            if drafts:
                self._count_verification(len(drafts), len(tokens) - 1)
                kv.rollback(request.request_id, request.num_computed_tokens)
            if scheduled.start < request.computed_high_water:  # recomputing what a preemption dropped
                self.recomputed_tokens_total += min(request.num_computed_tokens,
                                                    request.computed_high_water) - scheduled.start
            kv.computed(request)
            if not scheduled.samples:
                continue
            if tokens[0] is None:
                raise ValueError(f"request {request.request_id!r} finished its chunk but no token was sampled")
            for token, lp in zip(tokens, logprobs):
                request.append_output(int(token), lp)
                reason = request.stop_reason()
                if reason is not None:
                    self.finish_request(request, reason)
                    break
            progressed.append(request)
        return progressed

    @staticmethod
    def _verified(request: Request, drafts: tuple, tokens, logprobs) -> tuple:
        """(tokens, logprobs) lists of a verification step, checked: accepted drafts, then one more."""
        if not isinstance(tokens, (list, tuple)):
            raise ValueError(f"request {request.request_id!r} verified drafts but got {tokens!r}, not the list of "
                             f"its verified tokens")
        logprobs = [None] * len(tokens) if logprobs is None else list(logprobs)
        if not 1 <= len(tokens) <= len(drafts) + 1 or list(tokens[:-1]) != list(drafts[:len(tokens) - 1]):
            raise ValueError(f"request {request.request_id!r}: verified tokens {tokens} do not start with the "
                             f"accepted drafts of {list(drafts)}")
        return tokens, logprobs

    def _release(self, request: Request) -> None:
        self.kv_cache_manager.free(request.request_id)
        self.admission.released(request)
        request.num_computed_tokens = 0

    def _preempt(self, request: Request) -> None:
        """Free everything and queue the request first in line; it recomputes prompt + outputs."""
        request.computed_high_water = max(request.computed_high_water, request.num_computed_tokens)
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    # -- observability -------------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            **self.kv_cache_manager.stats(),
            "num_requests_running": len(self.running),
            "num_requests_waiting": len(self.waiting),
            "num_preemptions_total": self.num_preemptions_total,
            "recomputed_tokens_total": self.recomputed_tokens_total,
            "prefix_cache_hit_tokens_total": self.prefix_cache_hit_tokens_total,
            "prefix_cache_query_tokens_total": self.prefix_cache_query_tokens_total,
            "prefix_cache_hit_requests_total": self.prefix_cache_hit_requests_total,
            "prefix_cache_query_requests_total": self.prefix_cache_query_requests_total,
            "prefix_cache_host_hit_tokens_total": self.prefix_cache_host_hit_tokens_total,
            **({"host_cache_load_wait_seconds_total": self.host_cache_load_wait_seconds_total,
                "host_cache_loading_requests": len(self._tier_loads)}
               if self.cache_manager.host_tier is not None else {}),
            **self._spec_decode_stats(),
        }

    def _spec_decode_stats(self) -> dict:
        if self.speculative_config is None:
            return {}
        drafted, accepted = self.spec_decode_num_draft_tokens_total, self.spec_decode_num_accepted_tokens_total
        steps = self.spec_decode_num_drafts_total
        return {
            "spec_decode_num_draft_tokens_total": drafted,
            "spec_decode_num_accepted_tokens_total": accepted,
            "spec_decode_num_drafts_total": steps,
            "spec_decode_num_emitted_tokens_total": self.spec_decode_num_emitted_tokens_total,
            "spec_decode_draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            # tokens a verification step yields on average (1 + accepted drafts per step)
            "spec_decode_mean_accepted_length": self.spec_decode_num_emitted_tokens_total / steps if steps else 0.0,
        }

    def check_integrity(self) -> None:
        """Pages (the KV cache manager's check: tables, free lists, prefix cache, references) and the
        admission policy's bookkeeping consistent."""
        self.kv_cache_manager.check_integrity(self.running, self.waiting)
        self.admission.check()
