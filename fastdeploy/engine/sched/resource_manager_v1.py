"""ResourceManagerV1: decides, every step, which requests run, how many tokens each, and their pages.

One `schedule()` call:
1. SWA recycle step: pages that left a sliding-window head's window (judged on the tokens already
   processed, each sliding type by its own window and sink) go back to the free lists and their table
   entries become -1;
2. running requests (FCFS) get their next chunk or decode token under the token budget, growing
   their tables; if pages run out, the most recently admitted request is preempted (LIFO) and
   recomputed later (only on-demand admission ever gets there);
3. waiting requests are admitted while slots, budget and pages allow.

Every chunk, a recompute chunk of prompt + outputs included, is capped so `PageLayout.pages_needed`
fits the whole cache: a one-token step of an accepted request always does (add_request checks its
peak), so the cache is never idle while a request waits.

Admission policies (FD_ADMISSION_POLICY / --admission-policy), all computed with the same
`PageLayout` arithmetic that drives recycling:
- projected (default): each running request holds a claim on the pages of its one-token steps over
  the steps it has left; a newcomer is admitted while the claims' sum fits every future step, and
  prefill chunks borrow the unclaimed rest (engine/sched/projected_admission.py). Never preempts.
- reserve (FD_RESERVE_OUTPUT_PAGES=1): the most pages a request can ever hold, prefill chunk
  included, reserved for its whole life. Never preempts.
- on_demand (FD_RESERVE_OUTPUT_PAGES=0): upstream's rule, the first chunk plus FD_ENC_DEC_BLOCK_NUM
  blocks of headroom, and preemption when decodes outgrow the cache.

Prefix caching (on by default): a waiting request first looks up its longest valid cached prefix
(whole blocks, at most (num_tokens - 1) // block_size so at least one token is computed and no
shared block is ever written), references those pages, and starts its first chunk there; its SWA
rows get -1 for the blocks already dead at that point. Every block a request finishes computing is
registered in the cache right after the step (update_from_output); releasing a request (finish,
abort, preemption) only drops its references, so a preempted request finds its own blocks again.
Reserve and projected admission count shared pages once per request that holds them: sharing only
lowers what is really held, so the rules stay sound, and evictable cached pages count as free
because allocation evicts them on demand.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Optional

from fastdeploy.cache_manager.head_wise import (
    dead_block_range,
    first_window_block,
    sink_blocks,
    table_length,
    tokens_to_kill_block,
)
from fastdeploy.cache_manager.prefix_cache_manager import PrefixCacheManager
from fastdeploy.engine.request import Request, RequestStatus
from fastdeploy.engine.sched.projected_admission import PageCurves
from fastdeploy.spec_decode import build_proposer


_NEVER = 1 << 62  # next_recycle_at of a request with nothing to recycle


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

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.requests)

    def __len__(self) -> int:
        return len(self.requests)


class ResourceManagerV1:
    def __init__(self, fd_config, cache_manager: Optional[PrefixCacheManager] = None, proposer=None):
        self.fd_config = fd_config
        self.cache_manager = cache_manager or PrefixCacheManager(
            fd_config, fd_config.parallel_config.tensor_parallel_size)
        self.layout = self.cache_manager.layout
        self.head_wise = fd_config.head_wise_kv_cache
        self.block_size = fd_config.cache_config.block_size
        self.max_num_seqs = fd_config.scheduler_config.max_num_seqs
        self.max_num_batched_tokens = fd_config.scheduler_config.max_num_batched_tokens
        # One request's tokens per step: the budget, or the window where pages are short (_step_chunk).
        self.cut_chunk = self.layout.cut_chunk(self.max_num_batched_tokens)
        self.max_chunk = self.max_num_batched_tokens  # this step's, set by schedule()
        self.cut_chunk_steps_total = 0  # steps whose prefill chunks were cut to let a waiting request run
        self.max_model_len = fd_config.model_config.max_model_len
        self.admission_policy = fd_config.admission_policy
        self.reserve_output_pages = self.admission_policy == "reserve"
        self.projected = self.admission_policy == "projected"
        self.pages_per_rank = fd_config.cache_config.num_gpu_blocks * self.layout.heads_per_rank
        self._capacity = [self.pages_per_rank] * self.layout.tensor_parallel_size
        self.waiting: collections.deque = collections.deque()
        self.running: list = []
        self.projection = PageCurves(self.layout, self._capacity, self.running) if self.projected else None
        self.requests: dict = {}
        self._reserved_per_rank = [0] * self.layout.tensor_parallel_size  # the running requests' peaks
        self._recycling_heads = self.layout.recycling_heads
        # Every recycling sliding type with its slots, and each slot's type index (docs/retention_rule.md:
        # each type's dead range uses its own window and sink).
        self._recycling_groups = self.layout.recycling_groups
        self._type_of_slot = {h: k for k, (_, slots) in enumerate(self._recycling_groups) for h in slots}
        # Running requests whose processed tokens reached next_recycle_at, noted where their
        # progress is recorded so the recycle pass need not scan every running request.
        self._recycle_due: list = []
        self._sink_blocks = [sink_blocks(kind.sink, self.block_size) for kind, _ in self._recycling_groups]
        self.num_preemptions_total = 0
        self.recomputed_tokens_total = 0  # tokens computed again after a preemption dropped them
        self.swa_pages_recycled_total = 0
        self.prefix_caching = self.cache_manager.prefix_cache is not None
        self.prefix_cache_hit_tokens_total = 0
        self.prefix_cache_query_tokens_total = 0
        self.prefix_cache_query_requests_total = 0  # admissions looked up / with a hit (upstream's hit_req_rate)
        self.prefix_cache_hit_requests_total = 0
        # Speculative decoding (spec_decode/): `proposer.propose(request, k)` drafts tokens; tests may
        # pass their own proposer to force acceptance patterns through the real scheduler.
        self.speculative_config = getattr(fd_config, "speculative_config", None)
        self.proposer = proposer if proposer is not None or self.speculative_config is None \
            else build_proposer(self.speculative_config)
        self.spec_decode_num_draft_tokens_total = 0     # draft tokens verified
        self.spec_decode_num_accepted_tokens_total = 0  # of those, accepted
        self.spec_decode_num_drafts_total = 0           # verification steps (a request with >= 1 draft)
        self.spec_decode_num_emitted_tokens_total = 0   # tokens those steps produced (accepted + 1 each)

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
        peak = self._peak_pages(request, self.cut_chunk)  # the rule cuts chunks when pages are short
        if max(peak) > self.pages_per_rank:
            raise ValueError(f"request {request.request_id!r} needs up to {max(peak)} KV pages per rank but the "
                             f"cache has {self.pages_per_rank}; lower max_tokens or give the cache more blocks")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Optional[Request]:
        """Stop a request and free its pages at once; a no-op for unknown or finished ids."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
            self._release(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.ABORTED
        request.finish_reason = "abort"
        return request

    def finish_request(self, request: Request, reason: str) -> None:
        if request.request_id not in self.requests:
            return
        del self.requests[request.request_id]
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        self.recycle_out_of_window_pages()  # processed-token basis, before any allocation
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        if self.projection:
            self.projection.new_step()
        self.max_chunk = self._step_chunk()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget, self._chunk_of(request))
            if num_new > 1:  # a prefill or recompute chunk; one token always fits (add_request checked it)
                num_new = self._fit_chunk(request, num_new, len(self.running) - i - 1)
            while not self._grow_tables(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is request:
                    break
            else:
                batch.requests.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
                budget -= num_new
                i += 1
                continue
            break  # the request preempted itself: nothing behind it is left running

        while self.waiting and not batch.preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            if self.projected and len(self.running) >= self.max_num_batched_tokens:
                break  # every running request must get a token each step (the projection counts on it)
            request = self.waiting[0]
            num_new = self._admit(request, budget)
            if num_new is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.requests.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
            budget -= num_new
        if self.proposer is not None and budget > 0 and not batch.preempted \
                and self.speculative_config.speculates_with(len(self.running)):
            self._add_drafts(batch, budget)
        return batch

    # -- the chunk rule (PageLayout.chunk_for) -------------------------------------------------
    def _step_chunk(self) -> int:
        """This step's prefill chunk: the budget, cut to the window only when the cut admits more of the
        waiting requests now (the dry runs below mirror admission; they change nothing)."""
        budget = self.max_num_batched_tokens
        if self.cut_chunk == budget or not self.waiting or len(self.running) >= self.max_num_seqs:
            return budget
        chunk = self.layout.chunk_for(budget, self._admissions_with)
        self.cut_chunk_steps_total += chunk < budget
        return chunk

    def _chunk_of(self, request: Request) -> int:
        """A running request's chunk: this step's, or under reservation the one its reserved peak assumed."""
        return request.admitted_chunk if self.reserve_output_pages else self.max_chunk

    def _admissions_with(self, chunk: int) -> int:
        """How many waiting requests, in order, this step would admit were every prefill chunk at most
        `chunk` tokens (prefix hits not counted: the dry run assumes none).

        On-demand admission takes a request whenever its first chunk fits and preempts when decodes
        outgrow the cache, so a request it lets in may not stay: there, as under reservation, a request
        counts only if its whole-life peak fits beside the running ones' peaks, so a cut counts only where
        it makes room for a request that can run to its end without pushing another out."""
        seats = min(self.max_num_seqs - len(self.running), len(self.waiting))
        if self.projected:
            return self.projection.admissions_with(chunk, self.max_num_batched_tokens, self.waiting, seats)
        reserved, count = self._reserved_per_rank, 0
        for request in itertools.islice(self.waiting, seats):
            peak = self._peak_pages(request, chunk)
            if any(r + p > self.pages_per_rank for r, p in zip(reserved, peak)):
                break
            reserved, count = [r + p for r, p in zip(reserved, peak)], count + 1
        return count

    # -- speculative decoding ------------------------------------------------------------------
    def _add_drafts(self, batch: ScheduledBatch, budget: int) -> None:
        """Give decoding requests draft tokens from what the step has left (docs/scheduler.md).

        Drafts come last, after every running request's own token and every admission, and take
        only the budget and free pages nothing else needs; they never preempt and never count in
        admission. Under a grammar a draft is cut at its first token the grammar forbids. A rejected
        draft's pages return in update_from_output, so what a request holds
        after the step is the need of its accepted tokens alone. With projected admission a request
        drafts only while the curves still fit with its curve moved as far as its drafts could take it.
        """
        k_max = self.speculative_config.num_speculative_tokens
        curves = self.projection.running_curves() if self.projected else None
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
            if drafts and curves is not None:
                num = self.projection.drafts_within(curves, self.running.index(request), len(drafts))
                drafts = drafts[:num]
            num = self._grow_for_drafts(request, len(drafts)) if drafts else 0
            if num:
                scheduled.draft_token_ids = tuple(drafts[:num])
                scheduled.num_tokens += num
                budget -= num

    def _grow_for_drafts(self, request: Request, num_drafts: int) -> int:
        """Most of `num_drafts` drafts the request's table can address: all of them if free pages
        allow, else those that fit the pages it already holds."""
        end = request.num_computed_tokens + 1
        room = request.table_tokens - end
        if num_drafts <= room or self._grow_tables(request, 1 + num_drafts):
            return num_drafts
        return max(0, room)

    def _settle_drafts(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Count a verification step and return the pages only its rejected drafts were written to."""
        self.spec_decode_num_drafts_total += 1
        self.spec_decode_num_draft_tokens_total += num_drafts
        self.spec_decode_num_accepted_tokens_total += num_accepted
        self.spec_decode_num_emitted_tokens_total += num_accepted + 1
        keep = table_length(request.num_computed_tokens, self.block_size)
        if request.table_tokens <= keep * self.block_size:
            return
        if self.head_wise:
            tails = [row[keep:] for row in request.block_tables_head_wise]
            self.cache_manager.recycle_gpu_blocks_head_wise(tails, request.request_id)
            for row in request.block_tables_head_wise:
                del row[keep:]
        else:
            self.cache_manager.recycle_gpu_blocks(request.block_tables[keep:], request.request_id)
            del request.block_tables[keep:]
        request.table_tokens = keep * self.block_size

    def _fit_chunk(self, request: Request, num_new: int, num_behind: int) -> int:
        """Shrink a running request's chunk so its pages fit: the whole cache (every policy, so a
        recompute chunk can always run on an idle cache), and for projected admission the pages no
        running request has reserved, keeping one token of budget for each request behind it."""
        n = request.num_computed_tokens
        if not self.projected:
            return max(1, self.layout.largest_chunk_within(n, num_new, self._capacity))
        # A guard for the curves' premise (one token per running request per step): while admission
        # keeps the running list in order no request runs behind a prefilling one, so num_behind is 0
        # here (the proof is in docs/mutation_testing.md), but a change to admission must not starve one.
        num_new = max(1, num_new - num_behind)
        if num_new == 1:
            return 1
        own = self.projection.claim(self.projection.curve(request, n))
        return self.projection.take_transient(n, num_new, own)

    def update_from_output(self, batch: ScheduledBatch, sampled_token_ids: list,
                           sampled_logprobs: Optional[list] = None) -> list:
        """Advance every scheduled request; append sampled tokens; finish stopped requests.

        `sampled_token_ids[i]` belongs to `batch.requests[i]` (None where it did not sample): one
        token, or for a request with drafts the list the verification produced (its accepted drafts,
        then the model's own next token), with `sampled_logprobs[i]` a list alike. Tokens are
        appended one by one and the request stops at the first that ends it (EOS, stop token,
        max_tokens). Returns the requests that received a token this step, finished ones included.
        """
        progressed, bs = [], self.block_size
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
            # prefix caching below all count accepted tokens.
            request.num_computed_tokens = scheduled.start + scheduled.num_tokens - len(drafts) + len(tokens) - 1
            if drafts:
                self._settle_drafts(request, len(drafts), len(tokens) - 1)
            if scheduled.start < request.computed_high_water:  # recomputing what a preemption dropped
                self.recomputed_tokens_total += min(request.num_computed_tokens,
                                                    request.computed_high_water) - scheduled.start
            if request.num_computed_tokens >= request.next_recycle_at and self._recycling_heads:
                self._recycle_due.append(request)
            if self.prefix_caching and request.num_computed_tokens >= (request.num_registered_blocks + 1) * bs:
                self._register_blocks(request)  # a block was completed: cache it
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

    def recycle_out_of_window_pages(self) -> int:
        """Return every page that left a SWA head's window (processed-token basis); write -1."""
        due, self._recycle_due = self._recycle_due, []
        freed = 0
        for request in due:
            # Finished, aborted or preempted since its progress was noted: its pages are gone.
            if request.status is RequestStatus.RUNNING and request.num_computed_tokens >= request.next_recycle_at:
                freed += self._recycle_request(request)
        self.swa_pages_recycled_total += freed
        return freed

    def _recycle_request(self, request: Request) -> int:
        """Return every sliding type's newly dead blocks, each type by its own window."""
        tables, n, freed = request.block_tables_head_wise, request.num_computed_tokens, 0
        ups = list(request.recycled_upto_by_type)
        for k, (kind, heads) in enumerate(self._recycling_groups):
            start = ups[k]
            end = first_window_block(n, kind.window, self.block_size)
            if end <= start:
                continue
            self.cache_manager.recycle_pages_of_heads(heads, [tables[h][start:end] for h in heads],
                                                      request.request_id)
            for h in heads:
                tables[h][start:end] = [-1] * (end - start)
            ups[k] = end
            freed += (end - start) * len(heads)
        self._set_recycled_upto(request, ups)
        return freed

    def _set_recycled_upto(self, request: Request, blocks: list) -> None:
        """Each recycling type's first live non-sink block, and the processed-token count at which the
        next block of any type dies."""
        request.recycled_upto_by_type = list(blocks)
        request.next_recycle_at = min((tokens_to_kill_block(b, kind.window, self.block_size)
                                       for b, (kind, _) in zip(blocks, self._recycling_groups)), default=_NEVER)

    # -- pages ---------------------------------------------------------------------------------
    def _grow_tables(self, request: Request, num_new: int) -> bool:
        """Extend the request's positional tables to cover its next `num_new` tokens, if pages allow."""
        end = request.num_computed_tokens + num_new
        if end <= request.table_tokens:
            return True
        missing = table_length(end, self.block_size) - request.table_tokens // self.block_size
        if self.head_wise:
            pages = self.cache_manager.try_allocate_pages_every_head(missing, request.request_id)
            if pages is None:
                return False
            for row, new in zip(request.block_tables_head_wise, pages):
                row.extend(new)
        else:
            if not self.cache_manager.can_allocate_gpu_blocks(missing):
                return False
            request.block_tables.extend(self.cache_manager.allocate_gpu_blocks(missing, request.request_id))
        request.table_tokens += missing * self.block_size
        return True

    def _admit(self, request: Request, budget: int) -> Optional[int]:
        """Give a waiting request its cached prefix and first chunk; the chunk's size, or None if it must wait."""
        if self.reserve_output_pages:  # checked first: it does not depend on the prefix hit
            peak = self._peak_pages(request, self.max_chunk)
            if any(r + p > self.pages_per_rank for r, p in zip(self._reserved_per_rank, peak)):
                return None
        # A request scoring its prompt computes every position (engine/prompt_logprobs.py): no lookup, and it
        # counts neither as a query nor as a miss of the prefix cache.
        queried = self.prefix_caching and request.sampling_params.prompt_logprobs is None
        hit = self._match_prefix(request) if queried else ()
        start = len(hit) * self.block_size
        own = None
        if self.projected:
            own = self.projection.admit(request, start, self.max_chunk)
            if own is None:
                return None
        num_new = min(request.num_tokens - start, budget, self.max_chunk)
        if num_new > 1:  # a chunk needs no more than the whole cache, whatever it recomputes
            num_new = max(1, self.layout.largest_chunk_within(start, num_new, self._capacity))
        self._reset_tables(request)
        if hit:
            self._take_prefix(request, hit)
        if self.admission_policy == "on_demand" and self.running:
            # Upstream admission: the first chunk plus FD_ENC_DEC_BLOCK_NUM blocks of decode headroom.
            headroom = self.fd_config.enc_dec_block_num * self.block_size
            need = self.layout.pages_per_rank(request.num_computed_tokens, num_new + headroom)
            held = self._held_pages_per_rank(request) if hit else [0] * len(need)
            if any(n - h > free for n, h, free in zip(need, held, self.cache_manager.free_pages_per_rank())):
                self._release(request)  # drops the references the hit took
                return None
        if own is not None and num_new > 1:
            num_new = self.projection.take_transient(start, num_new, own)
        if not self._grow_tables(request, num_new):
            self._release(request)
            return None
        if queried:
            self.prefix_cache_query_tokens_total += request.num_tokens
            self.prefix_cache_hit_tokens_total += request.num_computed_tokens
            self.prefix_cache_query_requests_total += 1
            self.prefix_cache_hit_requests_total += request.num_computed_tokens > 0
            request.num_cached_tokens = request.num_computed_tokens
        request.admitted_chunk = self.max_chunk
        if not self.projected:  # reservation admits by it; on-demand's chunk rule reads the sum (above)
            peak = self._peak_pages(request, self.max_chunk)
            request.reserved_pages_per_rank = peak
            self._reserved_per_rank = [r + p for r, p in zip(self._reserved_per_rank, peak)]
        return num_new

    def _peak_pages(self, request: Request, chunk: int) -> list:
        # Memoised: a blocked queue head is re-checked every step and only changes when preempted.
        key = (request.num_tokens, request.max_new_tokens, chunk)
        peak = request.peak_memo.get(key)
        if peak is None:
            if len(request.peak_memo) > 4:  # lengths changed (a preemption): older entries are stale
                request.peak_memo.clear()
            peak = request.peak_memo[key] = self.layout.peak_pages_per_rank(*key)
        return peak

    def _reset_tables(self, request: Request) -> None:
        request.block_tables = []
        request.block_tables_head_wise = [[] for _ in range(self.layout.num_kv_heads)] if self.head_wise else None
        request.num_computed_tokens = 0
        request.table_tokens = 0
        self._set_recycled_upto(request, self._sink_blocks)
        request.cache_parent = self.cache_manager.prefix_root
        request.num_registered_blocks = 0

    # -- prefix caching ------------------------------------------------------------------------
    def _block_keys(self, request: Request):
        """Token tuples of the blocks a hit may cover: never the block holding the last token."""
        bs = self.block_size
        for i in range((request.num_tokens - 1) // bs):
            yield tuple(request.token_ids(i * bs, (i + 1) * bs))

    def _match_prefix(self, request: Request) -> list:
        """The request's valid cached prefix, memoised until the cache changes (a blocked queue head
        is looked up every step)."""
        version = self.cache_manager.prefix_cache.version
        memo = request.prefix_match
        if memo is None or memo[0] != version or memo[1] != request.num_tokens:
            memo = (version, request.num_tokens, self.cache_manager.match_prefix(self._block_keys(request)))
            request.prefix_match = memo
        return memo[2]

    def _take_prefix(self, request: Request, hit: list) -> None:
        """Reference the hit's pages and resume the request after it, SWA rows already recycled."""
        rows = self.cache_manager.acquire_prefix(hit, request.request_id)
        n = len(hit)
        cached = n * self.block_size
        if self.head_wise:
            request.block_tables_head_wise = rows
        else:
            request.block_tables = rows[0]
        request.num_computed_tokens = request.table_tokens = cached
        request.cache_parent, request.num_registered_blocks = hit[-1], n
        request.prefix_match = None
        if self._recycling_heads:
            self._set_recycled_upto(request, [dead_block_range(cached, kind.window, kind.sink, self.block_size).stop
                                              for kind, _ in self._recycling_groups])

    def _register_blocks(self, request: Request) -> None:
        """Cache every block the request has fully computed since the last call."""
        bs, parent = self.block_size, request.cache_parent
        full = request.num_computed_tokens // bs
        rid = request.request_id
        for i in range(request.num_registered_blocks, full):
            if parent is None:
                break  # the chain above left the cache: nothing deeper can be found by a lookup
            key = tuple(request.token_ids(i * bs, (i + 1) * bs))
            pages = [row[i] for row in request.block_tables_head_wise] if self.head_wise else [request.block_tables[i]]
            parent = self.cache_manager.register_block(parent, key, pages, rid)
        request.cache_parent, request.num_registered_blocks = parent, full

    def _held_pages_per_rank(self, request: Request) -> list:
        hpr = self.layout.heads_per_rank
        if not self.head_wise:
            return [len(request.block_tables) * hpr] * self.layout.tensor_parallel_size
        held = [0] * self.layout.tensor_parallel_size
        for h, row in enumerate(request.block_tables_head_wise):
            held[h // hpr] += sum(1 for p in row if p != -1)
        return held

    def _release(self, request: Request) -> None:
        if request in self._recycle_due:  # a short list; keeps no finished request alive when idle
            self._recycle_due.remove(request)
        if self.head_wise:
            tables = request.block_tables_head_wise or []
            live = [[p for p in row if p != -1] for row in tables]
            if any(live):
                self.cache_manager.recycle_gpu_blocks_head_wise(live, request.request_id)
        elif request.block_tables:
            self.cache_manager.recycle_gpu_blocks(request.block_tables, request.request_id)
        self._reset_tables(request)
        if request.reserved_pages_per_rank:
            self._reserved_per_rank = [r - p for r, p in zip(self._reserved_per_rank,
                                                             request.reserved_pages_per_rank)]
            request.reserved_pages_per_rank = []

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
        cm = self.cache_manager
        return {
            "kv_pages_total": cm.num_total_pages,
            "kv_pages_free": cm.num_free_pages,
            "kv_pages_free_per_head": cm.free_pages_per_head(),
            "num_requests_running": len(self.running),
            "num_requests_waiting": len(self.waiting),
            "swa_pages_recycled_total": self.swa_pages_recycled_total,
            "num_preemptions_total": self.num_preemptions_total,
            "recomputed_tokens_total": self.recomputed_tokens_total,
            "prefix_cache_hit_tokens_total": self.prefix_cache_hit_tokens_total,
            "prefix_cache_query_tokens_total": self.prefix_cache_query_tokens_total,
            "prefix_cache_hit_requests_total": self.prefix_cache_hit_requests_total,
            "prefix_cache_query_requests_total": self.prefix_cache_query_requests_total,
            **cm.prefix_cache_stats(),
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
        """Free lists and prefix cache consistent; every page referenced by exactly the requests
        whose tables hold it (its private owner, or the reference set of a cached page)."""
        cm = self.cache_manager
        cm.check_integrity()
        expected = [[None] * len(owners) for owners in cm.owners()]
        hpr = self.layout.heads_per_rank
        for request in self.running:
            rid = request.request_id
            ups = request.recycled_upto_by_type
            for (kind, _), upto in zip(self._recycling_groups, ups):
                limit = dead_block_range(request.num_computed_tokens, kind.window, kind.sink, self.block_size).stop
                if upto > limit:  # never recycle a block a future query can see
                    which = f" ({kind} slots)" if len(ups) > 1 else ""
                    raise AssertionError(f"{rid}: recycled up to block {upto}{which}, "
                                         f"but only blocks below {limit} are dead")
            if self.head_wise:
                for h, row in enumerate(request.block_tables_head_wise):
                    k = self._type_of_slot.get(h)
                    for i, p in enumerate(row):
                        dead = k is not None and self._sink_blocks[k] <= i < ups[k]
                        if (p == -1) != dead:
                            raise AssertionError(f"{rid}: head {h} entry {i} is {p}, dead={dead}")
                        if p != -1:
                            _claim(expected[h // hpr], p, rid)
            else:
                for b in request.block_tables:
                    _claim(expected[0], b, rid)
            need = table_length(request.num_computed_tokens, self.block_size)
            have = len(request.block_tables_head_wise[0]) if self.head_wise else len(request.block_tables)
            if have < need:
                raise AssertionError(f"{rid}: {request.num_computed_tokens} tokens cached but only {have} entries")
        for request in self.waiting:
            if request.block_tables or any(request.block_tables_head_wise or []):
                raise AssertionError(f"{request.request_id}: waiting but holds pages")
        for rank, refs in enumerate(expected):
            for page, ref in enumerate(refs):
                want = frozenset() if ref is None else frozenset(ref if isinstance(ref, set) else [ref])
                if cm.references(rank, page) != want:
                    raise AssertionError(f"rank {rank} page {page}: the cache manager records references "
                                         f"{set(cm.references(rank, page))}, block tables hold it for {set(want)}")
        if self.projected and not self.projection.fit(self.projection.running_curves()):
            raise AssertionError("projected admission: the running requests' page curves overflow the cache "
                                 "at some future step")
        if not self.projected:  # on-demand sums the running peaks too (its chunk rule), unbounded
            sums = [0] * len(self._reserved_per_rank)
            for request in self.running:
                sums = [s + p for s, p in zip(sums, request.reserved_pages_per_rank)]
            over = self.reserve_output_pages and any(s > self.pages_per_rank for s in sums)
            if sums != self._reserved_per_rank or over:
                raise AssertionError(f"reservations {self._reserved_per_rank} != sum {sums} or over capacity")


def _claim(owners: list, page: int, rid: str) -> None:
    """Record that `rid`'s table holds `page`; a page in two tables must be a shared cached page,
    which the reference-set comparison in check_integrity() then verifies."""
    held = owners[page]
    if held is None:
        owners[page] = rid
    elif isinstance(held, set):
        if rid in held:
            raise AssertionError(f"page {page} appears twice in the tables of {rid!r}")
        held.add(rid)
    else:
        if held == rid:
            raise AssertionError(f"page {page} appears twice in the tables of {rid!r}")
        owners[page] = {held, rid}
