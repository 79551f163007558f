"""Admission policies: when a waiting request may start, and how long a prefill chunk may be.

The scheduler asks its policy the same questions whichever it is (FD_ADMISSION_POLICY /
--admission-policy), all answered with the one page-need arithmetic (the KV cache manager's PageLayout)
that drives recycling:
- projected (default, projected_admission.py): each running request claims the pages of its one-token
  steps over the steps it has left; a newcomer is admitted while the claims' sum fits every future
  step, and prefill chunks borrow the unclaimed rest. Never preempts.
- reserve (FD_RESERVE_OUTPUT_PAGES=1): the most pages a request can ever hold, prefill chunk included,
  reserved for its whole life. Never preempts.
- on_demand (FD_RESERVE_OUTPUT_PAGES=0): upstream's rule, the first chunk plus FD_ENC_DEC_BLOCK_NUM
  blocks of headroom; decodes that outgrow the cache preempt (the scheduler's LIFO rule).

Shared pages count once per request that holds them: sharing only lowers what is really held, so the
rules stay sound, and evictable cached pages count as free because allocation evicts them on demand.
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional


class AdmissionPolicy:
    """The interface, and what every policy does alike. `running` is the scheduler's running list
    (read, never changed); `kv` its KV cache manager."""

    max_running = 1 << 62  # running requests beyond which nobody is admitted

    def __init__(self, fd_config, kv, running: list):
        self.kv = kv
        self.layout = kv.layout
        self.capacity = kv.capacity
        self.running = running

    def new_step(self) -> None:
        """A step begins (before its chunk rule and its admissions)."""

    def admissions_with(self, chunk: int, waiting, seats: int) -> int:
        """How many of `waiting`, in order and at most `seats`, this step would admit were every prefill
        chunk at most `chunk` tokens (prefix hits not counted: the dry run assumes none). Changes nothing."""
        raise NotImplementedError

    def chunk_of(self, request, step_chunk: int) -> int:
        """The prefill chunk a running request may take this step."""
        return step_chunk

    def running_chunk(self, request, num_new: int, num_behind: int) -> int:
        """Shrink a running request's chunk (> 1 token) so its pages fit; `num_behind` requests run after it."""
        return max(1, self.layout.largest_chunk_within(request.num_computed_tokens, num_new, self.capacity))

    def admit(self, request, start: int, step_chunk: int) -> Optional[object]:
        """Before any page is taken: a claim (passed to first_chunk) if the request, resuming at `start`
        tokens (its prefix hit), may start now; None if it must wait."""
        return True

    def first_chunk(self, request, num_new: int, claim) -> int:
        """After its table holds the prefix hit: the first chunk it may take (0: it must wait after all)."""
        return num_new

    def admitted(self, request, step_chunk: int) -> None:
        """The request runs (its first chunk's pages are taken)."""

    def released(self, request) -> None:
        """The request stopped running (finished, aborted or preempted)."""

    def draft_limit(self) -> Optional[Callable]:
        """For this step's drafts: f(request, num_drafts) -> the drafts it may verify; None: no limit."""
        return None

    def check(self) -> None:
        """Raise AssertionError if the policy's bookkeeping is inconsistent (check_integrity)."""


class PeakReservations(AdmissionPolicy):
    """Reserve and on-demand keep, per running request, the most pages it can hold over its life; their
    sum per rank decides admission (reserve) or only the chunk rule's dry runs (on-demand)."""

    def __init__(self, fd_config, kv, running: list):
        super().__init__(fd_config, kv, running)
        self.reserved_per_rank = [0] * self.layout.tensor_parallel_size
        self.reserved: dict = {}  # request id -> its peak pages per rank
        self.chunks: dict = {}    # request id -> the step's prefill chunk when it was admitted

    def peak(self, request, chunk: int) -> list:
        return self.layout.peak_pages_per_rank(request.num_tokens, request.max_new_tokens, chunk)

    def fits_beside_reserved(self, peak: list, reserved: Optional[list] = None) -> bool:
        reserved = self.reserved_per_rank if reserved is None else reserved
        return all(r + p <= self.kv.pages_per_rank for r, p in zip(reserved, peak))

    def admissions_with(self, chunk: int, waiting, seats: int) -> int:
        """On-demand admission takes a request whenever its first chunk fits and preempts when decodes
        outgrow the cache, so a request it lets in may not stay: there, as under reservation, a request
        counts only if its whole-life peak fits beside the running ones' peaks, so a cut counts only where
        it makes room for a request that can run to its end without pushing another out."""
        reserved, count = self.reserved_per_rank, 0
        for request in itertools.islice(waiting, seats):
            peak = self.peak(request, chunk)
            if not self.fits_beside_reserved(peak, reserved):
                break
            reserved, count = [r + p for r, p in zip(reserved, peak)], count + 1
        return count

    def admitted(self, request, step_chunk: int) -> None:
        self.chunks[request.request_id] = step_chunk
        peak = self.reserved[request.request_id] = self.peak(request, step_chunk)
        self.reserved_per_rank = [r + p for r, p in zip(self.reserved_per_rank, peak)]

    def released(self, request) -> None:
        self.chunks.pop(request.request_id, None)
        peak = self.reserved.pop(request.request_id, None)
        if peak is not None:
            self.reserved_per_rank = [r - p for r, p in zip(self.reserved_per_rank, peak)]

    def check(self) -> None:
        sums = [0] * len(self.reserved_per_rank)
        for request in self.running:
            sums = [s + p for s, p in zip(sums, self.reserved.get(request.request_id, [0] * len(sums)))]
        if sums != self.reserved_per_rank or set(self.reserved) != {r.request_id for r in self.running} \
                or self.over_capacity(sums):
            raise AssertionError(f"reservations {self.reserved_per_rank} != sum {sums} or over capacity")

    def over_capacity(self, sums: list) -> bool:
        return False


class ReserveAdmission(PeakReservations):
    """Admit only while the new request's whole-life peak fits beside the running ones' peaks."""

    def chunk_of(self, request, step_chunk: int) -> int:
        return self.chunks[request.request_id]  # the chunk its reserved peak assumed

    def admit(self, request, start: int, step_chunk: int) -> Optional[object]:
        return True if self.fits_beside_reserved(self.peak(request, step_chunk)) else None

    def over_capacity(self, sums: list) -> bool:
        return any(s > self.kv.pages_per_rank for s in sums)


class OnDemandAdmission(PeakReservations):
    """Upstream's rule: the first chunk plus FD_ENC_DEC_BLOCK_NUM blocks of decode headroom must be free."""

    def __init__(self, fd_config, kv, running: list):
        super().__init__(fd_config, kv, running)
        self.headroom = fd_config.enc_dec_block_num * self.layout.block_size

    def first_chunk(self, request, num_new: int, claim) -> int:
        if not self.running:
            return num_new  # an idle cache always takes it (add_request checked its peak)
        need = self.layout.pages_per_rank(request.num_computed_tokens, num_new + self.headroom)
        held = self.kv.held_pages_per_rank(request.request_id)  # the prefix hit's pages
        free = self.kv.pages.free_pages_per_rank()
        return 0 if any(n - h > f for n, h, f in zip(need, held, free)) else num_new

