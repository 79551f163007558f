"""The head-wise page model: page ids, the SWA retention rule and the page-need arithmetic.

A page is one slot's `block_size` tokens (cache_manager/slots.py: a slot is k (layer, KV head)
pairs of one attention type; for a model whose layers all look alike, slot h = KV head h in every
layer). Block `b` of a lane tensor `[num_blocks, G, block_size, head_dim]` holds pages
`b*G .. b*G + G-1`; page `p` lives at `lane[p // G, p % G]` and its *home* slot is `p % G`
(G = slots per block on the rank; H, the KV heads, for the per-head layout). Below, "head" in
`PageLayout` means slot: the free lists, tables and page counts are per slot.

Retention (docs/retention_rule.md): with `n` tokens processed, block `i` of a SWA head (window W, sink S) is dead
iff `i >= ceil(S / bs)` and `(i + 1) * bs <= n - W + 1` (every sliding type with its own W and S). Dead
blocks therefore form one contiguous range `[sink_blocks, first_window_block(n))`. Admission, allocation, capacity planning and
recycling all go through `PageLayout`, so they cannot disagree about how many pages a head holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from fastdeploy.cache_manager.slots import AttentionType


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def page_id(block: int, head: int, heads_per_rank: int) -> int:
    return block * heads_per_rank + head


def page_location(page: int, heads_per_rank: int) -> tuple:
    """(block, head slot) of a page in the `[num_blocks, H, ...]` cache tensor."""
    return divmod(page, heads_per_rank)


def sink_blocks(sink: int, block_size: int) -> int:
    """Blocks that hold at least one sink token; a SWA head keeps them for the request's life."""
    return cdiv(sink, block_size)


def first_window_block(num_processed: int, window: int, block_size: int) -> int:
    """Lowest block that may still hold a key visible to a future query (position >= num_processed)."""
    return max(0, num_processed - window + 1) // block_size


def tokens_to_kill_block(block: int, window: int, block_size: int) -> int:
    """Fewest processed tokens at which `block` lies below first_window_block (its inverse)."""
    return (block + 1) * block_size + window - 1


def dead_block_range(num_processed: int, window: int, sink: int, block_size: int) -> range:
    """Blocks of a SWA head that no future query can see."""
    start = sink_blocks(sink, block_size)
    return range(start, max(start, first_window_block(num_processed, window, block_size)))


def num_dead_blocks(num_processed: int, window: int, sink: int, block_size: int) -> int:
    return len(dead_block_range(num_processed, window, sink, block_size))


def table_length(num_tokens: int, block_size: int) -> int:
    """Entries a head's positional table needs to address tokens [0, num_tokens)."""
    return cdiv(num_tokens, block_size)


@dataclass(frozen=True)
class PageLayout:
    """How many pages each slot holds, for one engine configuration.

    `sliding` lists every sliding type with its global slots, ((AttentionType, slots), ...); the other
    slots attend fully. `recycle` is False for 1-D mode and for head-wise mode with
    FD_HEAD_WISE_SWA_RECYCLE=0: then sliding slots keep every page like full ones (the attention
    semantics do not change). Every sliding type recycles with its own window and sink (design §17).

    Page counts are per *column*: column 0 the slots that keep every page, column 1 + k the recycling
    slots of sliding type k (`pages_needed`, `rank_head_counts`); the columns do not depend on `recycle`.
    """

    block_size: int
    num_slots: int
    tensor_parallel_size: int
    sliding: tuple = ()
    recycle: bool = False

    def __post_init__(self):
        groups = tuple(sorted((kind, tuple(sorted(slots))) for kind, slots in self.sliding if slots))
        object.__setattr__(self, "sliding", groups)

    @classmethod
    def from_config(cls, fd_config) -> "PageLayout":
        slots = fd_config.slot_layout
        return cls(block_size=fd_config.cache_config.block_size, num_slots=slots.num_slots,
                   tensor_parallel_size=fd_config.parallel_config.tensor_parallel_size,
                   sliding=slots.sliding_groups(), recycle=fd_config.swa_recycle_active)

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.tensor_parallel_size

    @property
    def sliding_slots(self) -> tuple:
        """Every sliding type's slots, in order."""
        return tuple(sorted(s for _, slots in self.sliding for s in slots))

    @property
    def recycling_groups(self) -> tuple:
        """((AttentionType, its global slots), ...) of the types that recycle; () when nothing does.
        Computed once per engine: the KV cache manager and the prefix cache read it from here."""
        return self.sliding if self.recycle else ()

    @cached_property
    def type_of_slot(self) -> tuple:
        """Per global slot, the index of its recycling type in recycling_groups (None: keeps every page)."""
        kinds = [None] * self.num_slots
        for k, (_, slots) in enumerate(self.recycling_groups):
            for s in slots:
                kinds[s] = k
        return tuple(kinds)

    @cached_property
    def sink_blocks_per_type(self) -> tuple:
        """Blocks each recycling type keeps for a request's life (its sink's)."""
        return tuple(sink_blocks(kind.sink, self.block_size) for kind, _ in self.recycling_groups)

    def first_live_block(self, k: int, num_processed: int) -> int:
        """Recycling type k's lowest non-sink block a query at `num_processed` or later can see: the
        blocks [sink blocks, first_live_block) are dead (the retention rule)."""
        kind = self.recycling_groups[k][0]
        return max(self.sink_blocks_per_type[k], first_window_block(num_processed, kind.window, self.block_size))

    def recycle_point(self, k: int, block: int) -> int:
        """Fewest processed tokens at which `block` of recycling type k is dead."""
        return tokens_to_kill_block(block, self.recycling_groups[k][0].window, self.block_size)

    def rank_head_counts(self) -> list:
        """Per rank: (slots that keep every page, recycling slots of each sliding type...)."""
        return list(self._rank_head_counts)

    @cached_property
    def _rank_head_counts(self) -> tuple:  # read by every page-need call: computed once
        counts = [[self.slots_per_rank] + [0] * len(self.sliding) for _ in range(self.tensor_parallel_size)]
        for k, (_, slots) in enumerate(self.recycling_groups):
            for s in slots:
                counts[s // self.slots_per_rank][0] -= 1
                counts[s // self.slots_per_rank][1 + k] += 1
        return tuple(tuple(c) for c in counts)

    @cached_property
    def _rank_recycling(self) -> tuple:
        """Per rank: (all its slots, ((recycling type k, its slots there), ...) for the types it holds)."""
        return tuple((sum(c), tuple((k, r) for k, r in enumerate(c[1:]) if r)) for c in self._rank_head_counts)

    # -- the one page-need function ------------------------------------------------------------
    def dead_blocks_per_type(self, num_processed: int) -> tuple:
        """Dead (recyclable) blocks of each sliding type's slots after `num_processed` tokens (0 where
        nothing recycles)."""
        if not self.recycle:
            return (0,) * len(self.sliding)
        bs = self.block_size
        return tuple(num_dead_blocks(num_processed, kind.window, kind.sink, bs) for kind, _ in self.sliding)

    def pages_needed(self, num_processed: int, num_new: int) -> tuple:
        """Live pages (a slot keeping every page, a recycling slot of each type...) for a step computing
        tokens [n, n + num_new).

        Dead blocks are judged on the processed-token basis `n`: every query of the step has
        position >= n, so nothing it can see lies in a block dead at n.
        """
        full = table_length(num_processed + num_new, self.block_size)
        return (full,) + tuple(full - d for d in self.dead_blocks_per_type(num_processed))

    def pages_per_rank(self, num_processed: int, num_new: int) -> list:
        """Live pages a request needs on each rank for that step."""
        full = table_length(num_processed + num_new, self.block_size)
        dead = self.dead_blocks_per_type(num_processed)
        return [total * full - sum(r * dead[k] for k, r in rec) for total, rec in self._rank_recycling]

    def largest_chunk_within(self, num_processed: int, num_new: int, limit_per_rank: list) -> int:
        """Most tokens (at most `num_new`) a step starting at `n` may compute while
        `pages_per_rank(n, c)` stays within `limit_per_rank` on every rank; 0 if not even one fits.

        The need grows with c only through the table length F = ceil((n + c) / bs); the dead blocks
        are fixed by n. So on a rank with f keeping slots and r_k recycling slots of type k the bound is
        (f + sum r_k) * F - sum r_k * dead_k(n) <= limit, i.e. F <= (limit + sum r_k * dead_k(n)) // (f + sum r_k).
        """
        if num_new <= 0:
            return 0
        best = num_new
        dead = self.dead_blocks_per_type(num_processed)
        for (total, rec), limit in zip(self._rank_recycling, limit_per_rank):
            max_len = (limit + sum(r * dead[k] for k, r in rec)) // total
            best = min(best, max_len * self.block_size - num_processed)
        return max(0, best)

    def cut_chunk(self, budget: int) -> int:
        """The chunk a prefill is cut to when pages are short: the window in whole blocks (at least one
        block, at most the budget); the budget itself where nothing recycles (a cut frees nothing).

        With several sliding types the cut is the *widest* window's blocks: a chunk that long holds at
        most twice the widest window in any recycling slot, and no type's prefill is cut below what the
        widest one allows (cutting to a narrower window would shorten every chunk further for a
        transient saving on the narrow slots alone). The chunk rule (`chunk_for`) still takes the cut
        only where it lets more requests run; rank_ceilings always takes it (a shorter chunk starts later,
        past more dead blocks, so it never raises a peak).
        """
        if not self.recycling_groups:
            return budget
        widest = max(kind.window for kind, _ in self.recycling_groups)
        return min(budget, max(self.block_size, self.block_size * cdiv(widest, self.block_size)))

    def chunk_for(self, budget: int, running_with) -> int:
        """The one chunk rule: one request's prefill chunk fills the step's budget, unless cutting it to
        the window lets more requests run.

        A chunk of c tokens holds window + c tokens in every recycling head until its step ends, so where
        pages bind, long chunks turn the prefill transient, not the decode need, into what decides how many
        requests fit (Gemma 3, a 4k prompt in 2048-token chunks: 0.68 of 1-D's pages at the chunk's end,
        0.28 once decoding). Where pages are to spare, a cut only makes prefill slower (a GPU's cost per
        token falls with the chunk's length). `running_with(chunk)` counts the requests that run with that
        chunk (the scheduler: the waiting requests this step admits; the page tables: the steady state);
        the cut is taken only when it counts more.
        """
        cut = self.cut_chunk(budget)
        if cut < budget and (more := running_with(cut)) and more > running_with(budget):
            return cut
        return budget

    @cached_property
    def live_max_per_type(self) -> tuple:
        """Per sliding type: most pages one of its slots holds in any one-token step, the sink blocks plus
        the window's span (0 when nothing recycles).

        Past the window the count repeats with period block_size, so one period beyond it suffices.
        """
        if not self.recycle:
            return (0,) * len(self.sliding)
        bs = self.block_size
        out = []
        for kind, _ in self.sliding:
            horizon = kind.window + sink_blocks(kind.sink, bs) * bs + 2 * bs
            out.append(max(table_length(m + 1, bs) - num_dead_blocks(m, kind.window, kind.sink, bs)
                           for m in range(horizon)))
        return tuple(out)

    def recycling_bounds(self, last_position: int) -> tuple:
        """`y_k` of the linear bound on one-token steps of a request whose last step is at `last_position`,
        one per sliding type.

        For every position m <= last_position, on a rank with f keeping and r_k recycling slots of type k:
        block_size * sum(pages_per_rank(m, 1)) <= f * (m + block_size) + sum_k r_k * y_k. The bound is
        non-decreasing in m and exact up to rounding (ceil((m+1)/bs) <= (m+bs)/bs); the admission
        projection sums it over requests in closed form.
        """
        length = table_length(last_position + 1, self.block_size)
        return tuple(self.block_size * min(length, live) for live in self.live_max_per_type)

    def step_shapes(self, prompt_len: int, max_new_tokens: int, max_chunk: int):
        """(n, num_new) of the steps at which a request's page need can peak.

        Prefill chunks are at most `max_chunk` tokens; decode computes one token per step. The
        KV of the last sampled token is never written, so tokens [0, prompt + max_new - 1) are
        the most that get cached. Within each phase the need never shrinks over `block_size`
        positions (a head sheds at most one block per block_size tokens while growing one), so
        only each phase's last block_size end points can hold the peak.
        """
        bs = self.block_size
        for end in range(max(1, prompt_len - bs + 1), prompt_len + 1):
            start = max(0, end - max_chunk)
            yield start, end - start
        last = prompt_len + max_new_tokens - 1
        for n in range(max(prompt_len, last - bs), last):
            yield n, 1

    def peak_pages_per_rank(self, prompt_len: int, max_new_tokens: int, max_chunk: int) -> list:
        """Most live pages a request holds on each rank at any one step of its life (memoised: a blocked
        queue head is asked every step, and requests of one shape share the answer)."""
        return list(_peak_pages(self, prompt_len, max_new_tokens, max_chunk))


@lru_cache(maxsize=4096)
def _peak_pages(layout: PageLayout, prompt_len: int, max_new_tokens: int, max_chunk: int) -> tuple:
    peak = [0] * layout.tensor_parallel_size
    for n, num_new in layout.step_shapes(prompt_len, max_new_tokens, max_chunk):
        peak = [max(a, b) for a, b in zip(peak, layout.pages_per_rank(n, num_new))]
    return tuple(peak)


def predicted_concurrency(fd_config, input_len: int, output_len: int) -> dict:
    """Steady-state running requests for a fixed-length workload, recycling off vs on.

    A request is admitted only while the peaks of all running requests fit the pages of every
    rank (the scheduler's reservation rule), so the concurrency is `pages // peak`, capped by
    max_num_seqs. `ceiling` is the throughput gain recycling can buy when steps are memory-bound.
    """
    from dataclasses import replace

    on = PageLayout.from_config(fd_config)
    on = replace(on, recycle=bool(on.sliding))
    off = replace(on, recycle=False)
    pages_per_rank = fd_config.cache_config.num_gpu_blocks * on.slots_per_rank
    chunk = fd_config.scheduler_config.max_num_batched_tokens
    max_seqs = fd_config.scheduler_config.max_num_seqs

    def running(layout: PageLayout, max_chunk: int) -> int:
        return min(max_seqs, pages_per_rank // max(layout.peak_pages_per_rank(input_len, output_len, max_chunk)))

    def peak(layout: PageLayout) -> int:
        max_chunk = layout.chunk_for(chunk, lambda c: running(layout, c))
        return max(layout.peak_pages_per_rank(input_len, output_len, max_chunk))

    run_off, run_on = (min(max_seqs, pages_per_rank // peak(layout)) for layout in (off, on))
    return {
        "running_off": run_off,
        "running_on": run_on,
        "ceiling": (run_on / run_off) if run_off else float("inf"),
        "peak_pages_off": peak(off),
        "peak_pages_on": peak(on),
        "pages_per_rank": pages_per_rank,
    }


def rank_ceilings(fd_config, input_len: int, output_len: int) -> dict:
    """Memory ceiling of recycling per tensor-parallel rank, for one request shape.

    Rank r's ceiling is (peak pages of a request there without recycling) / (with it). Admission
    must fit on every rank, so the engine's ceiling is set by the fullest rank: a rank holding no
    SWA head caps it at 1.0 however many SWA heads the other ranks hold.
    """
    from dataclasses import replace

    on = PageLayout.from_config(fd_config)
    on = replace(on, recycle=bool(on.sliding))
    off = replace(on, recycle=False)
    chunk = fd_config.scheduler_config.max_num_batched_tokens
    # A ceiling is the gain where pages bind, and there the rule cuts whenever the cut lowers the peak.
    peak_off, peak_on = (layout.peak_pages_per_rank(input_len, output_len, layout.cut_chunk(chunk))
                         for layout in (off, on))
    return {
        "swa_heads_per_rank": [sum(counts[1:]) for counts in on.rank_head_counts()],
        "per_rank": [a / b for a, b in zip(peak_off, peak_on)],
        "ceiling": max(peak_off) / max(peak_on),
    }
