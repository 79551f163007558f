"""ResourceManagerV1: decides, every step, which requests run, how many tokens each, and their pages.

One `schedule()` call:
1. SWA recycle step: pages that left a sliding-window head's window (judged on the tokens already
   processed) go back to the free lists and their table entries become -1;
2. running requests (FCFS) get their next chunk or decode token under the token budget, growing
   their tables; if pages run out, the most recently admitted request is preempted (LIFO) and
   recomputed later;
3. waiting requests are admitted while slots, budget and pages allow.

Admission reserves, by default, the most pages a request can ever hold (FD_RESERVE_OUTPUT_PAGES=1),
computed by the same `PageLayout` arithmetic that drives recycling; a running request then never
has to be preempted. With FD_RESERVE_OUTPUT_PAGES=0 admission follows upstream: the first chunk plus
FD_ENC_DEC_BLOCK_NUM blocks of headroom, and preemption when decodes outgrow the cache.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Optional

from fastdeploy.cache_manager.head_wise import first_window_block, sink_blocks, table_length
from fastdeploy.cache_manager.prefix_cache_manager import PrefixCacheManager
from fastdeploy.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    start: int       # tokens already in the cache = position of the first token computed now
    num_tokens: int  # tokens computed this step

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last token, so a new token is sampled."""
        return self.start + self.num_tokens == self.request.num_tokens


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
    def __init__(self, fd_config, cache_manager: Optional[PrefixCacheManager] = None):
        self.fd_config = fd_config
        self.cache_manager = cache_manager or PrefixCacheManager(
            fd_config, fd_config.parallel_config.tensor_parallel_size)
        self.layout = self.cache_manager.layout
        self.head_wise = fd_config.head_wise_kv_cache
        self.block_size = fd_config.cache_config.block_size
        self.max_num_seqs = fd_config.scheduler_config.max_num_seqs
        self.max_num_batched_tokens = fd_config.scheduler_config.max_num_batched_tokens
        self.max_model_len = fd_config.model_config.max_model_len
        self.reserve_output_pages = fd_config.reserve_output_pages
        self.pages_per_rank = fd_config.cache_config.num_gpu_blocks * self.layout.heads_per_rank
        self.waiting: collections.deque = collections.deque()
        self.running: list = []
        self.requests: dict = {}
        self._reserved_per_rank = [0] * self.layout.tensor_parallel_size
        self._recycling_heads = self.layout.recycling_heads
        self._sink_blocks = sink_blocks(self.layout.sink, self.block_size)
        self.num_preemptions_total = 0
        self.swa_pages_recycled_total = 0

    # -- requests in and out -------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; raise ValueError if it could never fit the KV cache."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens < 1:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.num_tokens + request.max_new_tokens > self.max_model_len:
            raise ValueError(f"request {request.request_id!r}: prompt ({request.num_prompt_tokens} tokens) plus "
                             f"max_tokens ({request.sampling_params.max_tokens}) exceeds max_model_len="
                             f"{self.max_model_len}")
        peak = self._peak_pages(request)
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
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        recycling = bool(self._recycling_heads)
        recycled = 0

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if recycling and request.num_computed_tokens >= request.next_recycle_at:
                recycled += self._recycle_request(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self._grow_tables(request, num_new):
                if recycling and self.recycle_out_of_window_pages():
                    continue  # pages of requests behind this one left their window: retry first
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
        self.swa_pages_recycled_total += recycled
        if recycling and i < len(self.running):
            self.recycle_out_of_window_pages()  # requests the budget skipped still shed their pages

        while self.waiting and not batch.preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_tokens, budget)
            if not self._admit(request, num_new):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.requests.append(ScheduledRequest(request, 0, num_new))
            budget -= num_new
        return batch

    def update_from_output(self, batch: ScheduledBatch, sampled_token_ids: list,
                           sampled_logprobs: Optional[list] = None) -> list:
        """Advance every scheduled request; append sampled tokens; finish stopped requests.

        `sampled_token_ids[i]` belongs to `batch.requests[i]` (None where it did not sample).
        Returns the requests that received a token this step, finished ones included.
        """
        progressed = []
        for i, scheduled in enumerate(batch.requests):
            request = scheduled.request
            if request.is_finished:  # aborted between schedule and update
                continue
            request.num_computed_tokens = scheduled.start + scheduled.num_tokens
            if not scheduled.samples:
                continue
            token = sampled_token_ids[i]
            if token is None:
                raise ValueError(f"request {request.request_id!r} finished its chunk but no token was sampled")
            request.append_output(int(token), sampled_logprobs[i] if sampled_logprobs else None)
            reason = request.stop_reason()
            if reason is not None:
                self.finish_request(request, reason)
            progressed.append(request)
        return progressed

    def recycle_out_of_window_pages(self) -> int:
        """Return every page that left a SWA head's window (processed-token basis); write -1.

        schedule() does this per request, just before that request's allocation, and runs the
        full pass before it would preempt anyone: no allocation ever waits on a dead page.
        """
        if not self._recycling_heads:
            return 0
        freed = 0
        for request in self.running:
            if request.num_computed_tokens >= request.next_recycle_at:
                freed += self._recycle_request(request)
        self.swa_pages_recycled_total += freed
        return freed

    def _recycle_request(self, request: Request) -> int:
        window, bs = self.layout.window, self.block_size
        start = request.recycled_upto
        end = first_window_block(request.num_computed_tokens, window, bs)
        tables = request.block_tables_head_wise
        heads = self._recycling_heads
        self.cache_manager.recycle_pages_of_heads(heads, [tables[h][start:end] for h in heads], request.request_id)
        for h in heads:
            tables[h][start:end] = [-1] * (end - start)
        request.recycled_upto = end
        # Block `end` dies once first_window_block passes it: n - W + 1 >= (end + 1) * bs.
        request.next_recycle_at = (end + 1) * bs + window - 1
        return (end - start) * len(self._recycling_heads)

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

    def _admit(self, request: Request, num_new: int) -> bool:
        if self.reserve_output_pages:
            peak = self._peak_pages(request)
            if any(r + p > self.pages_per_rank for r, p in zip(self._reserved_per_rank, peak)):
                return False
        elif self.running:
            # Upstream admission: the first chunk plus FD_ENC_DEC_BLOCK_NUM blocks of decode headroom.
            headroom = self.fd_config.enc_dec_block_num * self.block_size
            need = self.layout.pages_per_rank(0, num_new + headroom)
            if any(n > free for n, free in zip(need, self.cache_manager.free_pages_per_rank())):
                return False
        self._reset_tables(request)
        if not self._grow_tables(request, num_new):
            return False
        if self.reserve_output_pages:
            request.reserved_pages_per_rank = peak
            self._reserved_per_rank = [r + p for r, p in zip(self._reserved_per_rank, peak)]
        return True

    def _peak_pages(self, request: Request) -> list:
        return self.layout.peak_pages_per_rank(request.num_tokens, request.max_new_tokens,
                                               self.max_num_batched_tokens)

    def _reset_tables(self, request: Request) -> None:
        request.block_tables = []
        request.block_tables_head_wise = [[] for _ in range(self.layout.num_kv_heads)] if self.head_wise else None
        request.num_computed_tokens = 0
        request.table_tokens = 0
        request.recycled_upto = self._sink_blocks
        request.next_recycle_at = (self._sink_blocks + 1) * self.block_size + self.layout.window - 1

    def _release(self, request: Request) -> None:
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
        }

    def check_integrity(self) -> None:
        """Free lists consistent, and every owned page referenced by exactly its owner's table."""
        self.cache_manager.check_integrity()
        expected = [[None] * len(owners) for owners in self.cache_manager.owners()]
        hpr = self.layout.heads_per_rank
        for request in self.running:
            rid = request.request_id
            if self.head_wise:
                for h, row in enumerate(request.block_tables_head_wise):
                    for i, p in enumerate(row):
                        dead = h in self._recycling_heads and self._sink_blocks <= i < request.recycled_upto
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
        if expected != self.cache_manager.owners():
            raise AssertionError("pages owned in the cache manager differ from the pages in block tables")
        if self.reserve_output_pages:
            sums = [0] * len(self._reserved_per_rank)
            for request in self.running:
                sums = [s + p for s, p in zip(sums, request.reserved_pages_per_rank)]
            if sums != self._reserved_per_rank or any(s > self.pages_per_rank for s in sums):
                raise AssertionError(f"reservations {self._reserved_per_rank} != sum {sums} or over capacity")


def _claim(owners: list, page: int, rid: str) -> None:
    if owners[page] is not None:
        raise AssertionError(f"page {page} is in the tables of {owners[page]!r} and {rid!r}")
    owners[page] = rid
