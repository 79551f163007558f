"""KVCacheManager: the one owner of every request's pages (the role of vLLM v1's KVCacheManager).

The scheduler asks it a handful of questions by request id and never sees a table. Each request has
one `PageTable`: rows x positional entries, one row in 1-D mode (block ids) and one per slot in
head-wise mode (page ids, local to the slot's rank), -1 where a page was recycled. The manager grows
tables for new tokens, applies the retention rule (docs/retention_rule.md: pages that left a sliding
slot's window, sink kept, go back at the start of the next step, each sliding type by its own window
and sink), serves and registers prefix hits, rolls back the pages of rejected drafts and releases
tables. The pages themselves (free lists, prefix cache, ownership) belong to PrefixCacheManager.

Every change to a table is also recorded as a rectangle of entries (`take_updates`), which the step
runner forwards to the workers' persistent block table, so no step rebuilds a table.
"""

from __future__ import annotations

from typing import Optional, Sequence

from fastdeploy.cache_manager.head_wise import first_window_block, table_length
from fastdeploy.cache_manager.prefix_cache_manager import PrefixCacheManager

_NEVER = 1 << 62  # next_recycle_at of a table with nothing to recycle


class PageTable:
    """One request's pages and its place in the prefix cache.

    `updates` lists the changes since the step runner last took them: (slots, first column, width,
    rows), `slots` None for every row, `rows` the new ids per row or None for -1 over `width` columns.
    """

    __slots__ = ("rows", "tokens", "num_computed", "recycled_upto", "next_recycle_at", "cache_parent",
                 "num_registered", "cache_path", "updates")

    def __init__(self, num_rows: int, recycled_upto: list, cache_parent):
        self.rows: list = [[] for _ in range(num_rows)]
        self.tokens = 0                       # tokens the table addresses: entries x block_size
        self.num_computed = 0                 # tokens whose KV is written (accepted ones only)
        self.recycled_upto = recycled_upto    # per recycling type: [its sink blocks, this) are recycled
        self.next_recycle_at = _NEVER         # processed tokens at which the next block of any type dies
        self.cache_parent = cache_parent      # trie node of the last block registered or matched
        self.num_registered = 0               # leading blocks registered in the prefix cache
        self.cache_path: list = []            # trie node of each leading block matched or registered
        self.updates: list = []

    @property
    def num_entries(self) -> int:
        return len(self.rows[0])


class KVCacheManager:
    """Every request's page table, by request id, over one PrefixCacheManager's pages."""

    def __init__(self, fd_config, pages: Optional[PrefixCacheManager] = None):
        self.pages = pages or PrefixCacheManager(fd_config, fd_config.parallel_config.tensor_parallel_size)
        self.layout = self.pages.layout  # the page-need arithmetic (head_wise.PageLayout), per slot
        self.block_size = self.layout.block_size
        self.num_rows = self.pages.num_slots  # rows of a table: 1 in 1-D mode, one per slot head-wise
        self.pages_per_entry = self.layout.num_slots // self.num_rows  # a page head-wise, a block's pages in 1-D
        self.pages_per_rank = fd_config.cache_config.num_gpu_blocks * self.layout.slots_per_rank
        self.capacity = [self.pages_per_rank] * self.layout.tensor_parallel_size
        # Head-wise tables recycle (1-D rows are blocks of every head: nothing to cut).
        self._groups = self.layout.recycling_groups if self.pages.head_wise else ()
        self._sink_blocks = list(self.layout.sink_blocks_per_type) if self._groups else []
        self._tables: dict = {}
        self._due: list = []  # request ids whose progress reached next_recycle_at since the last recycle()
        self._matches: dict = {}  # request id -> (request, cache version, tokens, the last lookup's path)
        self._parked: set = set()  # finished requests whose pages wait for a decode server's read (park)
        self.prefix_caching = self.pages.prefix_cache is not None
        self.swa_pages_recycled_total = 0

    # -- a request's life ----------------------------------------------------------------------
    def start(self, request_id, hit: Sequence = ()) -> int:
        """A new, empty table for the request, holding the prefix hit's pages (match_prefix) if any, its
        sliding rows already -1 where blocks are dead at the hit's end; returns the tokens cached."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds a page table")
        self._matches.pop(request_id, None)
        table = PageTable(self.num_rows, list(self._sink_blocks), self.pages.prefix_root)
        self._tables[request_id] = table
        if hit:
            rows = self.pages.acquire_prefix(hit, request_id)
            cached = len(hit) * self.block_size
            table.rows, table.tokens, table.num_computed = rows, cached, cached
            table.cache_parent, table.num_registered, table.cache_path = hit[-1], len(hit), list(hit)
            table.recycled_upto = [self.layout.first_live_block(k, cached) for k in range(len(self._groups))]
            table.updates.append((None, 0, len(hit), [list(row) for row in rows]))  # rows grow in place later
        self._schedule_recycling(table)
        return table.tokens

    def start_remote(self, request_id, num_tokens: int) -> Optional[int]:
        """A new table addressing tokens [0, num_tokens) whose KV another server computed and a transfer
        will write (disaggregation): only the pages a query at `num_tokens` or later can read are taken,
        the dead entries of sliding rows are -1 from the start. None, with nothing taken, if pages lack."""
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds a page table")
        self._matches.pop(request_id, None)
        entries = table_length(num_tokens, self.block_size)
        dead = [(0, 0)] * self.num_rows  # per row: its dead entries [lo, hi)
        upto = list(self._sink_blocks)
        for k, (_, slots) in enumerate(self._groups):
            upto[k] = max(upto[k], min(entries, self.layout.first_live_block(k, num_tokens)))
            for s in slots:
                dead[s] = (self._sink_blocks[k], upto[k])
        counts = [entries - max(0, hi - lo) for lo, hi in dead]
        new = self.pages.allocate(counts if self.num_rows > 1 else entries, request_id)
        if new is None:
            return None
        table = PageTable(self.num_rows, upto, None)  # no cache parent: its blocks are not registered
        for row, ids, (lo, hi) in zip(table.rows, new, dead):
            row.extend(ids[:lo] + [-1] * max(0, hi - lo) + ids[lo:])
        table.tokens = entries * self.block_size
        table.num_computed = num_tokens
        table.updates.append((None, 0, entries, [list(row) for row in table.rows]))
        self._tables[request_id] = table
        self._schedule_recycling(table)
        return num_tokens

    def grow(self, request_id, num_tokens: int) -> bool:
        """Extend the table to address tokens [0, num_tokens), if pages allow (nothing taken otherwise)."""
        table = self._tables[request_id]
        if num_tokens <= table.tokens:
            return True
        bs = self.block_size
        missing = table_length(num_tokens, bs) - table.tokens // bs
        new = self.pages.allocate(missing, request_id)
        if new is None:
            return False
        col = table.tokens // bs
        for row, ids in zip(table.rows, new):
            row.extend(ids)
        table.updates.append((None, col, missing, new))
        table.tokens += missing * bs
        return True

    def computed(self, request) -> None:
        """Record the request's progress after a step (`num_computed_tokens`, accepted tokens only):
        blocks it completed enter the prefix cache; recycling is noted as due when a block died."""
        table = self._tables[request.request_id]
        n = table.num_computed = request.num_computed_tokens
        if n >= table.next_recycle_at:
            self._due.append(request.request_id)
        if self.prefix_caching and n >= (table.num_registered + 1) * self.block_size:
            self._register_blocks(request, table)

    def rollback(self, request_id, num_tokens: int) -> None:
        """Return the pages past the entries that tokens [0, num_tokens) need: those only rejected draft
        tokens were written to (docs/scheduler.md, speculative decoding)."""
        table = self._tables[request_id]
        bs = self.block_size
        keep = table_length(num_tokens, bs)
        if table.tokens <= keep * bs:
            return
        self.pages.free([row[keep:] for row in table.rows], request_id)
        width = table.tokens // bs - keep
        for row in table.rows:
            del row[keep:]
        table.updates.append((None, keep, width, None))
        table.tokens = keep * bs

    def park(self, request_id) -> None:
        """Keep a finished request's pages, unchanged, until `free` (disaggregation: a decode server reads
        them): nothing of it recycles any more, and check_integrity accepts its table without a request."""
        table = self._tables[request_id]
        table.next_recycle_at = _NEVER
        self._parked.add(request_id)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def free(self, request_id) -> None:
        """Release the request's table (finished, aborted, preempted, parked and read, or an admission
        undone): private pages to the free lists, cached ones lose its reference. A no-op for a request
        without one."""
        self._matches.pop(request_id, None)
        self._parked.discard(request_id)
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        self._fill_cached_gaps(request_id, table, range(self.num_rows), 0, len(table.cache_path))
        rows = [[p for p in row if p != -1] for row in table.rows] if self._groups else table.rows
        if any(rows):
            self.pages.free(rows, request_id)

    def recycle(self) -> int:
        """Return every page that left a sliding slot's window (processed-token basis) and write -1 in
        its entry; runs at the start of a step, before anything is allocated. Returns the pages freed."""
        due, self._due = self._due, []
        freed = 0
        for request_id in due:
            table = self._tables.get(request_id)  # gone if finished, aborted or preempted since
            if table is not None and table.num_computed >= table.next_recycle_at:
                freed += self._recycle_table(request_id, table)
        self.swa_pages_recycled_total += freed
        return freed

    def _recycle_table(self, request_id, table: PageTable) -> int:
        """Each recycling type's newly dead blocks, by its own window and sink."""
        n, bs, freed = table.num_computed, self.block_size, 0
        rows, ups = table.rows, table.recycled_upto
        for k, (kind, slots) in enumerate(self._groups):
            start, end = ups[k], first_window_block(n, kind.window, bs)
            if end <= start:
                continue
            self._fill_cached_gaps(request_id, table, slots, start, end)
            self.pages.free([rows[s][start:end] for s in slots], request_id, slots)
            hole = [-1] * (end - start)
            for s in slots:
                rows[s][start:end] = hole
            table.updates.append((slots, start, end - start, None))
            ups[k] = end
            freed += (end - start) * len(slots)
        self._schedule_recycling(table)
        return freed

    def _schedule_recycling(self, table: PageTable) -> None:
        """The processed-token count at which the next block of any recycling type dies."""
        table.next_recycle_at = min((self.layout.recycle_point(k, b) for k, b in enumerate(table.recycled_upto)),
                                    default=_NEVER)

    # -- what a table holds --------------------------------------------------------------------
    def holds(self, request_id) -> bool:
        return request_id in self._tables

    def addressable_tokens(self, request_id) -> int:
        """Tokens the request's table can address now (entries x block_size)."""
        return self._tables[request_id].tokens

    def table(self, request_id) -> list:
        """The request's rows of entries (1 row in 1-D mode, one per slot head-wise; -1 = recycled), as
        the kernels see them. Read-only: change pages through the calls above."""
        return self._tables[request_id].rows

    def recycled_upto(self, request_id) -> list:
        """Per recycling type (layout.recycling_groups): its slots' blocks [sink blocks, this) are recycled."""
        return list(self._tables[request_id].recycled_upto)

    def held_pages_per_slot(self, request_id) -> list:
        """Pages the request holds in each slot (layout.num_slots entries; in 1-D mode every slot holds
        each block of the one row)."""
        table = self._tables.get(request_id)
        if table is None:
            return [0] * self.layout.num_slots
        if self.num_rows == 1:
            return [table.num_entries] * self.layout.num_slots
        return [len(row) - row.count(-1) for row in table.rows]

    def held_pages_per_rank(self, request_id) -> list:
        per_rank = [0] * self.layout.tensor_parallel_size
        spr = self.layout.slots_per_rank
        for s, n in enumerate(self.held_pages_per_slot(request_id)):
            per_rank[s // spr] += n
        return per_rank

    def live_pages(self, request_id, num_tokens: Optional[int] = None) -> list:
        """Per row, the (block index, page id) entries of tokens [0, num_tokens) (default: the tokens
        computed) that a query at position num_tokens or later can still read: a sliding slot's sink
        blocks and the blocks of its window (with FD_HEAD_WISE_SWA_RECYCLE=0 the dead ones are still
        held, but no query reads them), every entry of a slot that attends fully. In 1-D mode a block
        holds every head: the whole row."""
        table = self._tables[request_id]
        bs = self.block_size
        n = table.num_computed if num_tokens is None else num_tokens
        if n > table.num_computed:
            raise ValueError(f"request {request_id!r} has computed {table.num_computed} tokens, not {n}")
        entries = table_length(n, bs)
        if self.num_rows == 1:
            return [list(enumerate(table.rows[0][:entries]))]
        out = []
        kinds = {s: kind for kind, slots in self.layout.sliding for s in slots}
        for s, row in enumerate(table.rows):
            kind = kinds.get(s)
            if kind is None:
                out.append(list(enumerate(row[:entries])))
                continue
            sink = -(-kind.sink // bs)
            lo = max(sink, first_window_block(n, kind.window, bs))
            out.append([(i, p) for i, p in enumerate(row[:entries]) if (i < sink or i >= lo) and p != -1])
        return out

    def take_updates(self, request_id) -> list:
        """The table's changes since the last call, oldest first (PageTable.updates)."""
        table = self._tables[request_id]
        updates, table.updates = table.updates, []
        return updates

    # -- prefix caching ------------------------------------------------------------------------
    def match_prefix(self, request) -> list:
        """The request's longest valid cached prefix (whole blocks, never the block of its last token, so
        at least one token is computed and no shared block is ever written), memoised until the cache
        changes: a blocked queue head is looked up every step."""
        version = self.pages.prefix_cache.version
        memo = self._matches.get(request.request_id)
        if memo is None or memo[0] is not request or memo[1] != version or memo[2] != request.num_tokens:
            bs = self.block_size
            keys = (tuple(request.token_ids(i * bs, (i + 1) * bs)) for i in range((request.num_tokens - 1) // bs))
            memo = (request, version, request.num_tokens, self.pages.match_prefix(keys))
            self._matches[request.request_id] = memo
        return memo[3]

    def load_prefix(self, request, hit: list) -> tuple:
        """(the hit with all its pages in the pool, how many of its tokens come from the lower tiers, the load
        copying them or None): pages of a matched prefix that only the host or disk tier holds get pool pages
        now and are copied in off the engine loop (PrefixCacheManager.load_prefix); the request may read its
        hit once the load has ended (finished_loads, end_load). The hit is shorter if the pool has no room for
        them, and None while it reads pages another load is still writing (the request must wait)."""
        cache = self.pages.prefix_cache
        if not hit or cache is None or cache.lower is None:
            return hit, 0, None
        in_pool = cache.pool_depth(hit)
        hit, load = self.pages.load_prefix(hit)
        if hit is None:
            return None, 0, None
        return hit, max(0, len(hit) - in_pool) * self.block_size, load

    def finished_loads(self, wait: float = 0.0) -> list:
        """Loads from the lower tiers whose copies are done, to be ended (end_load); see PrefixCacheManager."""
        return self.pages.finished_loads(wait)

    @property
    def loads_pending(self) -> bool:
        """Loads submitted and not yet handed back by finished_loads."""
        return bool(self.pages.loads_in_flight)

    def end_load(self, load) -> None:
        self.pages.end_load(load)

    def close_loads(self) -> list:
        return self.pages.close_loads()

    def _register_blocks(self, request, table: PageTable) -> None:
        """Cache every block the request has fully computed since the last call."""
        bs, parent = self.block_size, table.cache_parent
        full = table.num_computed // bs
        for i in range(table.num_registered, full):
            if parent is None:
                break  # the chain above left the cache: nothing deeper can be found by a lookup
            key = tuple(request.token_ids(i * bs, (i + 1) * bs))
            parent = self.pages.register_block(parent, key, [row[i] for row in table.rows], request.request_id)
            if parent is not None:
                table.cache_path.append(parent)
        table.cache_parent, table.num_registered = parent, full

    def _fill_cached_gaps(self, request_id, table: PageTable, slots, start: int, end: int) -> None:
        """Before the request lets go of its pages of blocks [start, end) in `slots`: where the cached copy of
        one of its blocks has lost a slot's page while the request held a private duplicate (registration
        keeps the first copy), the duplicate fills the gap (PrefixCache.fill says when that matters)."""
        path, rows = table.cache_path, table.rows
        for i in range(start, min(end, len(path))):
            node = path[i]
            if not any(node.gaps):
                continue
            pages, fills = [-1] * self.num_rows, False
            for s in slots:
                p = rows[s][i]
                if p >= 0 and node.pages[s] < 0:  # a tombstone next to a page it holds: the page is private
                    pages[s], fills = p, True
            if fills:
                self.pages.fill_block(node, pages, request_id)

    # -- observability -------------------------------------------------------------------------
    def stats(self) -> dict:
        pages = self.pages
        return {"kv_pages_total": pages.num_total_pages, "kv_pages_free": pages.num_free_pages,
                "kv_pages_free_per_head": pages.free_pages_per_head(),
                "swa_pages_recycled_total": self.swa_pages_recycled_total, **pages.prefix_cache_stats()}

    def check_integrity(self, running: Sequence, waiting: Sequence = ()) -> None:
        """Free lists and prefix cache consistent; exactly the running requests hold tables; every entry
        -1 exactly where its block is recycled and nothing recycled that a future query can see; every
        page referenced by exactly the requests whose tables hold it (its private owner, or the
        reference set of a cached page)."""
        pages = self.pages
        pages.check_integrity()
        expected = [[None] * len(owners) for owners in pages.owners()]
        spr, bs = self.layout.slots_per_rank, self.block_size
        type_of_slot = self.layout.type_of_slot if self._groups else ()
        for request in waiting:
            if request.request_id in self._tables:
                raise AssertionError(f"{request.request_id}: waiting but holds pages")
        running_ids = {r.request_id for r in running}
        for rid in self._tables:
            if rid not in running_ids and rid not in self._parked:
                raise AssertionError(f"{rid}: holds a page table but is neither running nor parked")
            if rid in self._parked and rid in running_ids:
                raise AssertionError(f"{rid}: parked but still running")
        for load in pages.loads_in_flight:  # a load from the lower tiers references the pages it writes
            for p in load.pages:
                _claim(expected[0], p, load)
        for rid in self._parked:  # its pages are held as they were when it finished
            for s, row in enumerate(self._tables[rid].rows):
                for p in row:
                    if p != -1:
                        _claim(expected[s // spr if self.num_rows > 1 else 0], p, rid)
        for request in running:
            rid = request.request_id
            table = self._tables.get(rid)
            if table is None:
                raise AssertionError(f"{rid}: running without a page table")
            n = request.num_computed_tokens
            if table.num_computed != n:
                raise AssertionError(f"{rid}: the table records {table.num_computed} computed tokens, the "
                                     f"request {n}")
            ups = table.recycled_upto
            for k, ((kind, _), upto) in enumerate(zip(self._groups, ups)):
                limit = self.layout.first_live_block(k, n)
                if upto > limit:  # never recycle a block a future query can see
                    which = f" ({kind} slots)" if len(ups) > 1 else ""
                    raise AssertionError(f"{rid}: recycled up to block {upto}{which}, "
                                         f"but only blocks below {limit} are dead")
            for s, row in enumerate(table.rows):
                k = type_of_slot[s] if self._groups else None
                for i, p in enumerate(row):
                    dead = k is not None and self._sink_blocks[k] <= i < ups[k]
                    if (p == -1) != dead:
                        raise AssertionError(f"{rid}: head {s} entry {i} is {p}, dead={dead}")
                    if p != -1:
                        _claim(expected[s // spr if self.num_rows > 1 else 0], p, rid)
            need = table_length(n, bs)
            if table.num_entries < need:
                raise AssertionError(f"{rid}: {n} tokens cached but only {table.num_entries} entries")
            if table.tokens != table.num_entries * bs:
                raise AssertionError(f"{rid}: the table addresses {table.tokens} tokens with "
                                     f"{table.num_entries} entries")
        for rank, refs in enumerate(expected):
            for page, ref in enumerate(refs):
                want = frozenset() if ref is None else frozenset(ref if isinstance(ref, set) else [ref])
                if pages.references(rank, page) != want:
                    raise AssertionError(f"rank {rank} page {page}: the cache manager records references "
                                         f"{set(pages.references(rank, page))}, block tables hold it for {set(want)}")


def _claim(owners: list, page: int, rid) -> None:
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
