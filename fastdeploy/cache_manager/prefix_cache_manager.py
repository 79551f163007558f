"""PrefixCacheManager: the free lists of KV blocks (1-D mode) or per-head pages (head-wise mode).

1-D mode hands out whole blocks from one min-heap. Head-wise mode keeps one min-heap of pages per
KV head (a page's home head is `page % H`); a head allocates from its own list and, when that is
empty, borrows from the fullest other list on its rank, so pages freed by sliding-window heads serve
full heads of other requests. With tensor parallelism every rank has its own page space and lists.

Ownership is tracked per page (or block), so double frees and frees of someone else's page are
caught at the call, not as corrupted attention three steps later.

With prefix caching on (`cache_config.enable_prefix_caching`), full blocks a request has computed
are registered in a `PrefixCache` (prefix_tree.py) and may be referenced by several requests; a
cached page nobody references stays cached and is *evictable*. Every count of free pages the
scheduler sees (`num_free_pages`, `free_pages_per_rank`, `can_allocate_*`) includes evictable pages,
and allocation evicts (cheapest first, see prefix_tree.py) only when a rank's free lists run dry.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Iterable, Optional, Sequence

from fastdeploy.cache_manager.head_wise import PageLayout
from fastdeploy.cache_manager.prefix_tree import CACHED, BlockNode, PrefixCache
from fastdeploy.cache_manager.tier_loader import TierLoad, TierLoader

_ANONYMOUS = "<no request>"


class _Pool:
    """Free lists and owners of one rank's page (or block) space."""

    def __init__(self, num_ids: int, num_lists: int):
        self.num_lists = num_lists
        self.num_ids = num_ids
        self.owner: list = [None] * num_ids
        self.free_lists: list = [list(range(h, num_ids, num_lists)) for h in range(num_lists)]
        self.num_free = num_ids  # kept in step with the lists; schedule() reads it every step
        self.holders: dict = {}  # cached page -> requests referencing it (filled by PrefixCache)

    def take(self, home: int, count: int, owner: Hashable) -> list:
        """Pop `count` ids, lowest first, from the home list, then from the fullest other lists."""
        home_list = self.free_lists[home]
        if count == 1 and home_list:  # the decode step's case
            i = heapq.heappop(home_list)
            self.owner[i] = owner
            self.num_free -= 1
            return [i]
        if len(home_list) >= count:
            out = [heapq.heappop(home_list) for _ in range(count)]
        else:
            out = [heapq.heappop(home_list) for _ in range(len(home_list))]
            while len(out) < count:
                out.append(heapq.heappop(max(self.free_lists, key=len)))
        owners = self.owner
        for i in out:
            owners[i] = owner
        self.num_free -= count
        return out

    def take_from_every_list(self, count: int, owner: Hashable) -> list:
        """`count` ids for each home list in turn (borrowing as take() does); one list per home."""
        lists = self.free_lists
        if count == 1 and all(lists):  # the decode step's case: nobody needs to borrow
            owners, out = self.owner, []
            for free in lists:
                i = heapq.heappop(free)
                owners[i] = owner
                out.append([i])
            self.num_free -= len(lists)
            return out
        return [self.take(home, count, owner) for home in range(self.num_lists)]

    def release(self, ids: list) -> None:
        """Free ids already validated by check_owned()."""
        owners, lists, n = self.owner, self.free_lists, self.num_lists
        for i in ids:
            owners[i] = None
            heapq.heappush(lists[i % n], i)
        self.num_free += len(ids)

    def check_owned(self, ids: Sequence[int], owner: Hashable, what: str, rank: Optional[int] = None) -> None:
        """Raise ValueError unless every id is valid, listed once, and held by `owner`."""
        owners = self.owner
        if len(ids) > 1 and len(set(ids)) != len(ids):
            raise ValueError(f"{_label(what, rank)} {_first_duplicate(ids)} appears twice in one free call "
                             f"of request {owner!r}")
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_ids:
                raise ValueError(f"{_label(what, rank)} {i!r} freed by request {owner!r} is not a valid id "
                                 f"(0..{self.num_ids - 1})")
            holder = owners[i]
            if holder != owner:
                if holder is CACHED and owner in self.holders[i]:
                    continue
                if holder is CACHED:
                    raise ValueError(f"{_label(what, rank)} {i} freed by request {owner!r} is cached and not "
                                     f"referenced by that request")
                if holder is None:
                    raise ValueError(f"double free: {_label(what, rank)} {i} freed by request {owner!r} "
                                     f"is already free")
                raise ValueError(f"{_label(what, rank)} {i} freed by request {owner!r} belongs to request "
                                 f"{holder!r}")

    def check(self, label: str) -> None:
        """Raise if a free id is missing, listed twice, in the wrong list, or also owned."""
        listed = [0] * self.num_ids
        for home, free in enumerate(self.free_lists):
            for i in free:
                if i % self.num_lists != home:
                    raise AssertionError(f"{label}: id {i} sits in free list {home}, its home is {i % self.num_lists}")
                listed[i] += 1
        for i, holder in enumerate(self.owner):
            if holder is None and listed[i] != 1:
                raise AssertionError(f"{label}: free id {i} is listed {listed[i]} times")
            if holder is not None and listed[i]:
                raise AssertionError(f"{label}: id {i} is owned by {holder!r} and also free")
        listed_total = sum(len(f) for f in self.free_lists)
        if listed_total != self.num_free:
            raise AssertionError(f"{label}: free count {self.num_free} but {listed_total} ids are listed")
        # Every id is now either free and listed once or owned and unlisted: free + owned == total.


class PrefixCacheManager:
    """The pages of the KV cache: free lists and prefix cache, in 1-D or head-wise mode (docs/memory_model.md).

    Pages are handed out and taken back in *rows*, one list of ids per slot: in head-wise mode a slot
    is a global KV slot (ids local to its rank), in 1-D mode there is one slot holding block ids. One
    call allocates (`allocate`) and one frees (`free`); the upstream-named methods below are that pair
    in each mode's shape (docs/memory_model.md, "Per-head free lists").
    """

    def __init__(self, fd_config, tensor_parallel_size: int = 1):
        if tensor_parallel_size != fd_config.parallel_config.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} differs from the config's "
                             f"{fd_config.parallel_config.tensor_parallel_size}")
        self.head_wise = fd_config.head_wise_kv_cache
        self.layout = PageLayout.from_config(fd_config)
        self.num_gpu_blocks = fd_config.cache_config.num_gpu_blocks
        self.tensor_parallel_size = tensor_parallel_size
        self.heads_per_rank = self.layout.slots_per_rank
        self.num_slots = fd_config.table_rows  # rows a request's pages come in
        if self.head_wise:
            pages = self.num_gpu_blocks * self.heads_per_rank
            self._pools = [_Pool(pages, self.heads_per_rank) for _ in range(tensor_parallel_size)]
            self.slot_rank = [s // self.heads_per_rank for s in range(self.num_slots)]
            table_layout = self.layout
        else:
            # Every rank holds the same block ids for its own heads: one pool, one slot, serves them all.
            self._pools = [_Pool(self.num_gpu_blocks, 1)]
            self.slot_rank = [0]
            table_layout = PageLayout(self.layout.block_size, 1, 1)
        self.prefix_cache: Optional[PrefixCache] = None
        self.loader: Optional[TierLoader] = None  # copies from the lower tiers, off the engine loop
        self.inline_load_seconds = 0.0  # see _copies_here
        self._seconds_per_page = 0.0  # the host tier's measured copy time per page (0: none measured yet)
        self._loads: list = []  # loads begun (load_prefix) and not yet ended (end_load), oldest first
        if fd_config.cache_config.enable_prefix_caching:
            self.prefix_cache = PrefixCache(self._pools, self.slot_rank, table_layout)

    # -- the one allocation and the one free ---------------------------------------------------
    def allocate(self, counts, req_id: Optional[Hashable] = None) -> Optional[list]:
        """Rows of new page ids, `counts` per slot (one int: the same count for every slot); None, with
        nothing taken, when a rank lacks room. Each slot takes from its home list first (lowest ids
        first), then borrows from the fullest other list of its rank."""
        owner = _owner(req_id)
        uniform, need = self._need(counts, owner)
        for rank, (pool, n) in enumerate(zip(self._pools, need)):
            if n > pool.num_free and n > self._available(rank):
                return None
        if self.prefix_cache is not None:
            for rank, n in enumerate(need):
                self._make_room(rank, n)
        if uniform:
            return [row for pool in self._pools for row in pool.take_from_every_list(counts, owner)]
        hpr = self.heads_per_rank
        return [self._pools[s // hpr].take(s % hpr, n, owner) for s, n in enumerate(counts)]

    def can_allocate(self, counts) -> bool:
        """Whether `allocate(counts)` would succeed now."""
        return all(n <= self._available(rank) for rank, n in enumerate(self._need(counts, _ANONYMOUS)[1]))

    def _need(self, counts, owner) -> tuple:
        """(whether `counts` is one int for every slot, the pages it takes on each rank)."""
        if isinstance(counts, int) and not isinstance(counts, bool):
            _check_count(counts, owner)
            return True, [counts * self.heads_per_rank] * len(self._pools) if self.head_wise else [counts]
        return False, self._need_per_rank(counts, owner)

    def free(self, rows: Sequence[Iterable[int]], req_id: Optional[Hashable] = None,
             slots: Optional[Sequence[int]] = None) -> None:
        """Give back a request's pages, one row of ids per slot (`slots`: which slots the rows are, default
        every slot in order): private pages to their free lists, cached ones only lose this reference.
        Every id is validated, per rank, before any is freed; a bad one raises ValueError naming it."""
        owner = _owner(req_id)
        if slots is None:
            rows = [list(r) for r in rows]
            if len(rows) != self.num_slots:
                raise ValueError(f"request {owner!r}: expected pages for {self._rows_name()}, got {len(rows)}")
            slots = range(self.num_slots)
        what = "page" if self.head_wise else "block"
        if len(self._pools) == 1:  # one page space: no per-rank split (the scheduler's every step)
            pages = rows[0] if len(rows) == 1 else [p for row in rows for p in row]
            self._pools[0].check_owned(pages, owner, what, 0 if self.head_wise else None)
            if pages:
                self._release(0, list(pages), owner)
            return
        per_rank: list = [[] for _ in self._pools]
        for s, pages in zip(slots, rows):
            per_rank[self.slot_rank[s]].extend(pages)
        for rank, (pool, pages) in enumerate(zip(self._pools, per_rank)):
            pool.check_owned(pages, owner, what, rank)
        for rank, pages in enumerate(per_rank):
            if pages:
                self._release(rank, pages, owner)

    # -- the same pair in each mode's shape (docs/memory_model.md, upstream's names) --------------------
    def can_allocate_gpu_blocks(self, num_blocks: int) -> bool:
        self._require_mode(False, "can_allocate_gpu_blocks")
        _check_count(num_blocks, _ANONYMOUS)
        return self.can_allocate(num_blocks)

    def allocate_gpu_blocks(self, num_blocks: int, req_id: Optional[Hashable] = None) -> list:
        self._require_mode(False, "allocate_gpu_blocks")
        _check_count(num_blocks, _owner(req_id))
        return self._allocated(self.allocate(num_blocks, req_id), [num_blocks], req_id)[0]

    def recycle_gpu_blocks(self, block_ids: Iterable[int], req_id: Optional[Hashable] = None) -> None:
        """Give back a request's blocks: private ones to the free list, cached ones stay cached."""
        self._require_mode(False, "recycle_gpu_blocks")
        self.free([list(block_ids)], req_id)

    def can_allocate_gpu_blocks_head_wise(self, num_blocks_per_head: Sequence[int]) -> bool:
        self._require_mode(True, "can_allocate_gpu_blocks_head_wise")
        return self.can_allocate(list(num_blocks_per_head))

    def allocate_gpu_blocks_head_wise(self, num_blocks_per_head: Sequence[int],
                                      req_id: Optional[Hashable] = None) -> list:
        """One list of rank-local page ids per global KV head; all-or-nothing."""
        self._require_mode(True, "allocate_gpu_blocks_head_wise")
        counts = list(num_blocks_per_head)
        return self._allocated(self.allocate(counts, req_id), counts, req_id)

    def recycle_gpu_blocks_head_wise(self, pages_per_head: Sequence[Iterable[int]],
                                     req_id: Optional[Hashable] = None) -> None:
        self._require_mode(True, "recycle_gpu_blocks_head_wise")
        self.free(pages_per_head, req_id)

    def _allocated(self, rows: Optional[list], counts: list, req_id) -> list:
        if rows is not None:
            return rows
        need = [counts[0]] if not self.head_wise else self._need_per_rank(counts, _owner(req_id))
        rank = next(r for r, n in enumerate(need) if n > self._available(r))
        where = "" if not self.head_wise else f" on rank {rank}"
        what = "pages" if self.head_wise else "blocks"
        raise ValueError(f"request {_owner(req_id)!r} asked for {need[rank]} {what}{where} but only "
                         f"{self._available(rank)} are free")

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can get now (free or cached-unreferenced), all heads and ranks.

        In 1-D mode: such blocks x KV heads.
        """
        if self.head_wise:
            return sum(self._available(rank) for rank in range(len(self._pools)))
        return self._available(0) * self.layout.num_slots

    @property
    def num_total_pages(self) -> int:
        return self.num_gpu_blocks * self.layout.num_slots

    @property
    def num_free_blocks(self) -> int:
        self._require_mode(False, "num_free_blocks")
        return self._available(0)

    def free_pages_per_head(self) -> list:
        """Free (or evictable) pages whose home is each global KV head (1-D mode: every head sees the free blocks)."""
        if not self.head_wise:
            return [self._available(0)] * self.layout.num_slots
        cache = self.prefix_cache
        return [len(free) + (cache.evictable_per_home[rank][h] if cache else 0)
                for rank, pool in enumerate(self._pools) for h, free in enumerate(pool.free_lists)]

    def free_pages_per_rank(self) -> list:
        if not self.head_wise:
            return [self._available(0) * self.heads_per_rank] * self.tensor_parallel_size
        return [self._available(rank) for rank in range(len(self._pools))]

    def check_integrity(self) -> None:
        """Raise AssertionError unless every id is free in exactly its home list or owned, per rank.

        "Owned" covers private pages and cached pages; with prefix caching the trie, reference sets,
        tombstones, eviction counters and heaps are verified too (free + cached + private == total).
        """
        for rank, pool in enumerate(self._pools):
            pool.check(f"rank {rank}" if self.head_wise else "1-D pool")
        if self.prefix_cache is not None:
            self.prefix_cache.check()

    def owners(self) -> list:
        """Per rank, the owner of every id (None = free, CACHED = in the prefix cache)."""
        return [list(pool.owner) for pool in self._pools]

    def references(self, rank: int, page: int) -> frozenset:
        """Requests that may reference a page: its private owner, or the holders of a cached page."""
        pool = self._pools[rank]
        holder = pool.owner[page]
        if holder is None:
            return frozenset()
        if holder is CACHED:
            return frozenset(pool.holders[page])
        return frozenset([holder])

    # -- prefix caching ------------------------------------------------------------------------
    @property
    def prefix_root(self) -> Optional[BlockNode]:
        return self.prefix_cache.root if self.prefix_cache else None

    def match_prefix(self, block_keys: Iterable[tuple]) -> list:
        """Longest valid cached path (list of BlockNode) for consecutive full-block token tuples; pages the
        host tier holds count (load_prefix brings them into the pool)."""
        return self.prefix_cache.match(block_keys, tiers=True) if self.prefix_cache else []

    def attach_host_tier(self, tier, inline_load_seconds: float = 0.0) -> None:
        """Put a host tier (host_tier.HostTier) below the pool: evicted pages a hit can read go there."""
        if self.prefix_cache is None:
            raise ValueError("a host tier needs the prefix cache (drop --no-enable-prefix-caching)")
        if self.tensor_parallel_size != 1:
            raise ValueError("the host tier serves tensor_parallel_size 1")
        tier.cache, self.prefix_cache.lower = self.prefix_cache, tier
        self.loader = TierLoader(tier)
        # Host-memory copies estimated at most this long run at once in the engine loop (0: every load waits).
        self.inline_load_seconds = float(inline_load_seconds)
        if tier.files is not None:
            tier.restore()  # the disk tier's pages from an earlier run become the trie's nodes again

    @property
    def host_tier(self):
        return self.prefix_cache.lower if self.prefix_cache is not None else None

    def _copies_here(self, load: TierLoad) -> bool:
        """Whether `load` is copied at once in the engine loop, with no loading state: host-memory entries only
        (a file read may take long or fail), whose copy the speed of earlier copies made here puts under the budget
        (inline_load_seconds, FD_TIER_LOAD_INLINE_MS). On a CPU a hit's copy takes milliseconds where waiting
        for it costs the request one whole step (tens to hundreds of milliseconds)."""
        if self.inline_load_seconds <= 0 or any(path is not None for path in load.paths):
            return False
        return len(load.entries) * self._seconds_per_page <= self.inline_load_seconds

    def load_prefix(self, path: list) -> tuple:
        """Start making a matched path a hit whose pages are all in the pool; returns (hit, load).

        The pages only the lower tiers hold get new pool pages, which join the prefix cache at once (cached,
        referenced by the load until it ends, so never evicted); their bytes are copied in by the loader's
        thread (`load`, None when nothing is left to copy: nothing was needed, or the copy was short enough to
        run here, _copies_here) and the hit may be read once end_load ran. The
        path's own pool pages are pinned meanwhile. If the pool cannot take them, the part of the path the
        pool holds alone is the hit (the rest is recomputed). The hit is None while the path reads a page
        another load is still writing: the request waits for that load (it is not read before the copy)."""
        cache = self.prefix_cache
        if cache is None or cache.lower is None:
            return path, None
        if cache.reads_loading(path):
            return None, None
        needs = cache.load_needs(path)
        if not needs:
            return path, None
        tier = cache.lower
        entries = [node.host[s] for node, s in needs]
        load = TierLoad(entries, [None] * len(entries))
        pinned = cache.reference(path, load)
        tier.pin(entries)
        counts = [0] * self.num_slots
        for _, s in needs:
            counts[s] += 1
        rows = self.allocate(counts, load)  # may evict into the tier (never a pinned entry)
        if rows is None:
            tier.unpin(entries)
            for rank, pages in enumerate(pinned):
                cache.unref(rank, pages, load)
            return path[:cache.pool_depth(path)], None
        for k, ((node, s), entry) in enumerate(zip(needs, entries)):
            page = rows[s].pop()
            load.paths[k] = tier.claim(entry)  # the entry leaves the trie; the load holds it until it ends
            cache.adopt(node, s, page, load)   # the slot's page is the pool's now, referenced by the load
            cache.loading[page] = load
            load.pages.append(page)
        for rank, pages in enumerate(pinned):
            cache.unref(rank, pages, load)
        self._loads.append(load)
        if self._copies_here(load):
            self.loader.copy_here(load)
            if load.ok:  # the copy's speed in the engine loop, for the next estimate (the loader's thread shares
                # the cores with the steps it overlaps: its copies are slower and would say little about this one)
                measured = load.copy_seconds / len(load.entries)
                self._seconds_per_page = 0.5 * (self._seconds_per_page + measured) if self._seconds_per_page \
                    else measured
            self.end_load(load)  # a page it could not write leaves the cache: the hit ends before it
            return (path if load.ok else path[:cache.pool_depth(path)]), None
        self.loader.submit(load)
        return path, load

    def finished_loads(self, wait: float = 0.0) -> list:
        """Loads the loader's thread has finished (each once, oldest first), to be ended by end_load; `wait`:
        seconds to wait for the oldest one in flight first."""
        return self.loader.finished(wait) if self.loader is not None else []

    @property
    def loads_in_flight(self) -> list:
        """Loads begun and not yet ended: their pages are referenced by them and read by nobody."""
        return list(self._loads)

    def end_load(self, load: TierLoad) -> None:
        """A finished load's pages become plain cached pages (the load's references go); pages it could not
        write (a corrupt file) leave the prefix cache, so nothing reads them. Every request that referenced
        them must have let go first (the scheduler releases the request that waited for a failed load)."""
        cache = self.prefix_cache
        self._loads.remove(load)
        cache.lower.end_load(load)
        for page in load.pages:
            del cache.loading[page]
        cache.unref(0, load.pages, load)
        for i in load.unwritten():
            cache.forget(0, load.pages[i])

    def close_loads(self) -> list:
        """Let the loads in flight finish and stop the loader's thread; returns the loads to be ended."""
        return self.loader.close() if self.loader is not None else []

    def persist_prefix_cache(self) -> int:
        """A clean shutdown with a disk tier: every cached page a hit can read and no request holds goes to
        disk (the pool's through the host tier), so the next start finds it; returns the files written."""
        cache = self.prefix_cache
        tier = cache.lower if cache is not None else None
        if tier is None or tier.files is None:
            return 0
        before = tier.disk_stored_total
        for rank in range(len(cache.pools)):
            cache.evict(rank, cache.num_evictable[rank])
        tier.persist()
        return tier.disk_stored_total - before

    def acquire_prefix(self, path: list, req_id: Hashable) -> list:
        """Reference a matched path; per slot (KV head, or the one 1-D slot) its page ids, -1 where dead."""
        return self.prefix_cache.acquire(path, req_id)

    def register_block(self, parent: BlockNode, key: tuple, pages: list, req_id: Hashable) -> Optional[BlockNode]:
        """Cache a fully computed block (pages per slot) under `parent`; returns the next parent or None."""
        return self.prefix_cache.register(parent, key, pages, req_id)

    def fill_block(self, node: BlockNode, pages: list, req_id: Hashable) -> None:
        """A request's private copies of a cached block's pages (per slot, -1 where none) fill the slots the
        cached copy has lost (PrefixCache.fill); the request keeps its reference to them until it frees them."""
        self.prefix_cache.fill(node, pages, req_id)

    def clear_prefix_cache(self) -> int:
        """Evict every unreferenced cached page into the free lists; returns the number evicted."""
        return self.prefix_cache.clear() if self.prefix_cache else 0

    def prefix_cache_stats(self) -> dict:
        cache = self.prefix_cache
        if cache is None:
            return {"prefix_cache_cached_pages": 0, "prefix_cache_evictable_pages": 0,
                    "prefix_cache_evictions_total": 0, "prefix_cache_cached_blocks": 0}
        scale = 1 if self.head_wise else self.layout.num_slots  # 1-D: a block is one page per head
        stats = {"prefix_cache_cached_pages": cache.num_cached_pages * scale,
                 "prefix_cache_evictable_pages": sum(cache.num_evictable) * scale,
                 "prefix_cache_evictions_total": cache.evictions_total * scale,
                 "prefix_cache_cached_blocks": cache.num_nodes}
        if cache.lower is not None:
            counts = ("host_cache_pages", "host_cache_pages_total", "host_cache_loading_pages",
                      "host_cache_stored_pages_total", "host_cache_evicted_pages_total",
                      "host_cache_loaded_pages_total", "disk_cache_pages", "disk_cache_pages_total",
                      "disk_cache_stored_pages_total", "disk_cache_evicted_pages_total",
                      "disk_cache_loaded_pages_total", "disk_cache_restored_pages")
            stats.update({k: v * scale if k in counts else v for k, v in cache.lower.stats().items()})
        return stats

    # -- helpers -------------------------------------------------------------------------------
    def _available(self, rank: int) -> int:
        """Free plus evictable ids of a rank's pool."""
        free = self._pools[rank].num_free
        return free + self.prefix_cache.num_evictable[rank] if self.prefix_cache is not None else free

    def _make_room(self, rank: int, count: int) -> bool:
        """Evict until `count` ids are on the rank's free lists; False (nothing evicted) if impossible."""
        short = count - self._pools[rank].num_free
        if short <= 0:
            return True
        return self.prefix_cache is not None and self.prefix_cache.evict(rank, short)

    def _release(self, rank: int, ids: list, owner: Hashable) -> None:
        """Free validated ids: private ones to their free lists, cached ones lose this owner's reference."""
        pool = self._pools[rank]
        if self.prefix_cache is None:
            pool.release(ids)
            return
        owners = pool.owner
        cached = [i for i in ids if owners[i] is CACHED]
        if cached:
            self.prefix_cache.unref(rank, cached, owner)
            ids = [i for i in ids if owners[i] is not CACHED]
        pool.release(ids)

    def _require_mode(self, head_wise: bool, method: str) -> None:
        if head_wise != self.head_wise:
            mode = "head-wise (FD_HEAD_WISE_KV_CACHE=1)" if self.head_wise else "1-D (FD_HEAD_WISE_KV_CACHE=0)"
            raise ValueError(f"{method} called on a cache manager in {mode} mode")

    def _rows_name(self) -> str:
        return f"{self.num_slots} KV heads" if self.head_wise else "1 row (1-D mode)"

    def _need_per_rank(self, counts: Sequence[int], owner: Hashable) -> list:
        if len(counts) != self.num_slots:
            raise ValueError(f"request {owner!r}: expected a page count for each of {self._rows_name()}, got "
                             f"{len(counts)}")
        need = [0] * len(self._pools)
        for s, n in enumerate(counts):
            _check_count(n, owner)
            need[self.slot_rank[s]] += n
        return need


def _label(what: str, rank: Optional[int]) -> str:
    return what if rank is None else f"{what} (rank {rank})"


def _first_duplicate(ids: Sequence) -> object:
    seen = set()
    for i in ids:
        if i in seen:
            return i
        seen.add(i)
    return None


def _owner(req_id: Optional[Hashable]) -> Hashable:
    return _ANONYMOUS if req_id is None else req_id


def _check_count(n: int, owner: Hashable) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"request {owner!r}: block count must be a non-negative integer, got {n!r}")
