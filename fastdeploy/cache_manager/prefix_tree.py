"""The prefix cache: full KV blocks shared between requests, one page per KV head, SWA-aware eviction.

Index. A trie of `BlockNode`s, one per full block of `block_size` tokens; a node's children are
keyed by the *exact* token ids of the next block, so the path from the root is the chained block
hash of upstream without any chance of a collision. A partial block is never cached. A node holds
one page per *slot*: in head-wise mode a slot is a global KV head (page ids are local to the head's
rank); in 1-D mode there is a single slot holding the block id. `-1` in a slot is a tombstone: that
head's copy of the block was evicted (or never cached).

Ownership. A page is free, private to one request (its id in the pool's `owner`), or cached
(`owner` is `CACHED` and `pool.holders[page]` is the set of requests whose tables reference it).
A cached page nobody references is *evictable*: it counts as available for allocation and is
evicted (tombstoned and returned to its home free list) only when a free list runs dry.

Hit validity (docs/retention_rule.md). A hit of `n` blocks lets the next query sit at position
`n*bs`. It is valid iff every full head holds all `n` blocks and every recycling SWA head holds its sink blocks
and the blocks `[first_window_block(n*bs), n)`; SWA blocks in between are dead on that basis and
the request's rows get -1 there, exactly as the recycler would have written them. A path that is
not valid shrinks to the longest valid prefix.

Eviction policy (per page, cheapest class first, LRU by release time within a class, deeper
blocks first on ties so a chain is eaten from its tail):
  0. *stale SWA pages*: a recycling head's page of a non-sink block that no *anchor* below it can
     see. Anchors are the nodes where hits are likely to end: leaves (a repeated prompt or the next
     turn of a chat extends a leaf) and branch points (where requests sharing a system prompt
     diverge). A node stays a branch point while it is cached once a second child has been created
     under it, whether or not the first is still there: when one conversation at a time uses a
     system prompt, the last one's tail is often evicted before the next arrives, and the next
     ones resume there.
     A SWA page outside the window of every anchor of its subtree serves only hits ending
     at an unremarkable block in the middle of a chain. This class is what lets recycling keep
     saving memory when prefixes are cached: the out-of-window SWA pages of a request are
     reclaimable while its full-head pages are still in use (the vLLM #48435 problem). The SWA
     window pages in front of an anchor are *not* in this class, so a cached prefix does not lose
     exactly the pages that make it reusable before the rest of it. (Judging staleness against the
     *deepest* block of a chain instead would evict precisely a shared system prompt's window pages:
     they lie outside the window of every user's longer tail below the branch point.)
  1. *whole leaves*: every page of a leaf block is unreferenced; leaf before parent.
  2. anything else unreferenced (window pages still protected, pages of interior blocks).
Every unreferenced page is in some class, so "free + evictable" pages really can all be obtained;
the scheduler's reservation rule relies on that.

The classes are kept in one lazy heap per rank: any change that can alter a page's key pushes a
fresh entry, and a popped entry is used only if it still equals the page's current key.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Iterable, Optional



class _Marker:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


CACHED = _Marker("<prefix cache>")  # pool owner of a page held by the prefix cache

STALE_SWA, WHOLE_LEAF, OTHER = 0, 1, 2  # eviction classes, cheapest first


def _absent_from_pool(node: "BlockNode", column: int) -> bool:
    return node.gaps[column] > 0


def _absent_from_tiers(node: "BlockNode", column: int) -> bool:
    hosted = node.hosted
    return node.gaps[column] > (hosted[column] if hosted else 0)


class BlockNode:
    """One cached full block: its pages per slot and the bookkeeping the eviction policy needs."""

    __slots__ = ("parent", "key", "depth", "children", "pages", "gaps", "num_referenced", "protects", "anchor",
                 "children_created", "host", "hosted", "digest")

    def __init__(self, parent: Optional["BlockNode"], key: Optional[tuple], depth: int, num_slots: int,
                 num_types: int = 1, column_sizes: tuple = ()):
        self.parent = parent
        self.key = key
        self.depth = depth            # block index; the root is -1
        self.children: dict = {}
        self.pages = [-1] * num_slots
        # Tombstones per column (0: slots that attend fully, 1 + k: recycling type k's slots), so a
        # lookup asks "does every full head hold this block" in O(1), not O(slots).
        self.gaps = list(column_sizes)
        self.num_referenced = 0       # pages (slots) of this block referenced by some request
        self.protects = [0] * num_types  # per recycling sliding type: anchors whose window covers this block
        self.anchor = False
        self.children_created = 0     # two or more: requests diverged here (a branch point for good)
        # The lower tier (host_tier.py): per slot the entry holding this block's page there (-1: none), and
        # per column how many; None while the node has none. A slot's page is in the pool or the tier, never both.
        self.host: Optional[list] = None
        self.hosted: Optional[list] = None
        self.digest: Optional[str] = None  # the disk tier's name of this block's chain (host_tier._digest)

    @property
    def protect(self) -> int:
        """Anchors whose window (of the first recycling sliding type, the only one in most models) covers
        this block."""
        return self.protects[0]

    @protect.setter
    def protect(self, value: int) -> None:
        self.protects[0] = value

    @property
    def empty(self) -> bool:
        """No page in the pool and none in the lower tier."""
        return all(p < 0 for p in self.pages) and not (self.hosted and any(self.hosted))

    @property
    def detached(self) -> bool:
        """Removed from the trie (a request may still point at it as its registration parent)."""
        return self.parent is None and self.depth >= 0

    def __repr__(self) -> str:
        return f"BlockNode(depth={self.depth}, pages={self.pages}, refs={self.num_referenced})"


class PrefixCache:
    """The trie, per-page reference sets and the eviction heaps over a set of page pools (one per rank)."""

    def __init__(self, pools: list, slot_rank: list, layout):
        """`layout` (head_wise.PageLayout) has one slot per entry of `slot_rank`; its recycling groups are
        the sliding types whose hits, dead blocks and stale pages follow their own window and sink."""
        self.pools = pools
        self.slot_rank = list(slot_rank)
        self.num_slots = len(self.slot_rank)
        self.layout = layout
        self.types = [kind for kind, _ in layout.recycling_groups]
        self.type_slots = [slots for _, slots in layout.recycling_groups]
        self.type_of_slot = layout.type_of_slot  # recycling type index of each slot (None: full)
        self.full_slots = [s for s in range(self.num_slots) if self.type_of_slot[s] is None]
        self.rec_slots = layout.sliding_slots if self.types else ()
        self.block_size = layout.block_size
        self.type_sink_blocks = layout.sink_blocks_per_type
        self.num_types = max(1, len(self.types))
        self.column_of_slot = [0 if k is None else 1 + k for k in self.type_of_slot]
        self.column_sizes = (len(self.full_slots),) + tuple(len(slots) for slots in self.type_slots)
        self.root = BlockNode(None, None, -1, self.num_slots, self.num_types)
        ranks = len(pools)
        self.where = [dict() for _ in range(ranks)]      # page -> (node, slot)
        self.tick_of = [dict() for _ in range(ranks)]    # page -> release tick (LRU key)
        self.heaps = [[] for _ in range(ranks)]
        self.num_evictable = [0] * ranks
        self.evictable_per_home = [[0] * pool.num_lists for pool in pools]
        self.num_nodes = 0
        self.evictions_total = 0
        self.version = 0  # bumped whenever a lookup could answer differently
        # Nodes whose pages or place in the trie changed since a watcher (kv_events) took them; None while
        # nobody watches.
        self.changed: Optional[set] = None
        self.clock = 0
        # The tier below the pool (host_tier.HostTier) or None: evicted pages a hit can still read go there.
        self.lower = None
        # Pool pages (rank 0) a load from the lower tier is still writing -> that load (tier_loader.TierLoad).
        # They are cached and referenced by the load (never evicted); no hit may read them (reads_loading).
        self.loading: dict = {}
        for pool in pools:
            pool.holders = {}

    # -- lookup and hits -----------------------------------------------------------------------
    def match(self, block_keys: Iterable[tuple], tiers: bool = False) -> list:
        """The longest valid cached path for these consecutive block keys (validity: module docstring);
        with `tiers`, a page the lower tier holds counts as cached (load_needs says which to load)."""
        absent = _absent_from_tiers if tiers and self.lower is not None else _absent_from_pool
        node, path = self.root, []
        for key in block_keys:
            node = node.children.get(key)
            if node is None or absent(node, 0):
                break
            path.append(node)
        return path[:self.valid_depth(path, absent)]

    def valid_depth(self, path: list, absent=None) -> int:
        """Largest n <= len(path) such that every recycling type's slots hold what a query at n*bs can see
        (their sink blocks and the blocks of their own window); `absent(node, column)`: whether a slot of
        that column lacks the block (default: in the pool)."""
        absent = absent or _absent_from_pool
        n = len(path)
        if not self.rec_slots or not n:
            return n
        for k in range(len(self.types)):
            for i in range(min(self.type_sink_blocks[k], n)):
                if absent(path[i], 1 + k):
                    n = i  # a sink block every later query sees is gone
                    break
        while n > 0:
            # For each type the last block of its window span that is missing; a hit longer than the
            # latest of them can still see it (a type's window start only moves up with n).
            missing = None
            for k in range(len(self.types)):
                lo = self.dead_end(n, k)
                gone = next((i for i in range(n - 1, lo - 1, -1) if absent(path[i], 1 + k)), None)
                if gone is not None and (missing is None or gone > missing):
                    missing = gone
            if missing is None:
                return n
            n = missing
        return 0

    def pool_depth(self, path: list) -> int:
        """How much of a valid path is a valid hit with the pool's pages alone."""
        n = next((i for i, node in enumerate(path) if node.gaps[0]), len(path))
        return self.valid_depth(path[:n])

    def read_slots(self, path: list):
        """(block index, node, slot) of every page a query after a hit on `path` reads (a sliding slot's
        dead blocks skipped)."""
        n, kinds = len(path), self.type_of_slot
        dead = [(self.type_sink_blocks[k], self.dead_end(n, k)) for k in range(len(self.types))]
        for i, node in enumerate(path):
            for s in range(self.num_slots):
                k = kinds[s]
                if k is None or not dead[k][0] <= i < dead[k][1]:
                    yield i, node, s

    def reads_loading(self, path: list) -> bool:
        """Whether a hit on `path` reads a page a load is still writing (the hit must wait for that load)."""
        loading = self.loading
        return bool(loading) and any(node.pages[s] in loading for _, node, s in self.read_slots(path)
                                     if self.slot_rank[s] == 0)

    def load_needs(self, path: list) -> list:
        """(node, slot) of every page a hit on `path` reads that only the lower tier holds."""
        return [(node, s) for _, node, s in self.read_slots(path) if node.pages[s] < 0]

    def dead_end(self, n: int, k: int = 0) -> int:
        """Blocks [sink blocks, dead_end) of recycling type k are dead for a request resuming at n full blocks."""
        if not self.types:
            return 0
        return self.layout.first_live_block(k, n * self.block_size)

    def acquire(self, path: list, owner: Hashable) -> list:
        """Reference a valid hit; per slot, its page ids (-1 where a SWA block is already dead)."""
        rows = [[-1] * len(path) for _ in range(self.num_slots)]
        for i, node, s in self.read_slots(path):
            rows[s][i] = node.pages[s]
        self.reference(path, owner)
        return rows

    def reference(self, path: list, owner: Hashable) -> list:
        """Reference every pool page a hit on `path` reads (pages only the lower tier holds are skipped);
        returns them per rank, for unref."""
        pinned = [[] for _ in self.pools]
        last, was_unreferenced = None, False
        for _, node, s in self.read_slots(path):
            if node is not last:
                if was_unreferenced and last.num_referenced:
                    self._repush(last)  # its still-unreferenced pages are no longer a whole leaf
                last, was_unreferenced = node, node.num_referenced == 0
            p = node.pages[s]
            if p < 0:
                continue
            rank = self.slot_rank[s]
            holders = self.pools[rank].holders[p]
            if not holders:
                self._count_evictable(rank, p, -1)
                node.num_referenced += 1
            holders.add(owner)
            pinned[rank].append(p)
        if was_unreferenced and last.num_referenced:
            self._repush(last)
        return pinned

    # -- registration --------------------------------------------------------------------------
    def register(self, parent: BlockNode, key: tuple, pages: list, owner: Hashable) -> Optional[BlockNode]:
        """Cache a block the owner has fully computed under `parent`; returns its node (the next parent).

        If the same block is already cached, the owner's pages stay private except where the cached
        block has a tombstone, which the owner's page then fills. None when `parent` left the trie.
        """
        if parent.detached:
            return None
        node = parent.children.get(key)
        created = node is None
        if created:
            node = BlockNode(parent, key, parent.depth + 1, self.num_slots, self.num_types, self.column_sizes)
        adopted, was_unreferenced = False, node.num_referenced == 0
        for s, p in enumerate(pages):
            if p >= 0 and node.pages[s] < 0:
                self.adopt(node, s, p, owner)
                adopted = True
        if created:
            if not adopted:
                return None  # nothing to cache (every head of the block already recycled)
            parent.children[key] = node
            parent.children_created += 1
            self.num_nodes += 1
            self._children_changed(parent)
            self._update_anchor(node)
        elif adopted and was_unreferenced:
            self._repush(node)  # its other pages are no longer part of a whole unreferenced leaf
        return node

    def fill(self, node: BlockNode, pages: list, owner: Hashable) -> None:
        """A request lets go of its private copies of a block it registered (`pages` per slot, -1 where none):
        they fill the slots whose cached copy was evicted meanwhile. Two requests that compute one prefix at
        the same time keep one copy of it; the other is private. When the cached copy loses the window pages
        in front of the prefix's end *before* that end becomes a branch point (they were stale for its first
        user then), the duplicate is what keeps the branch point a valid hit for every later user."""
        if not node.detached:
            self.register(node.parent, node.key, pages, owner)

    def adopt(self, node: BlockNode, slot: int, page: int, owner: Hashable) -> None:
        """Make the owner's private page the node's page of `slot` (a tombstone there), referenced by the
        owner; a copy the lower tier held of it is dropped (the pool's copy is the one read)."""
        rank = self.slot_rank[slot]
        pool = self.pools[rank]
        if pool.owner[page] != owner:
            raise ValueError(f"request {owner!r} registers page {page} (rank {rank}) it does not own privately")
        pool.owner[page] = CACHED
        pool.holders[page] = {owner}
        self.where[rank][page] = (node, slot)
        node.pages[slot] = page
        node.gaps[self.column_of_slot[slot]] -= 1
        node.num_referenced += 1
        self.version += 1
        if self.changed is not None:
            self.changed.add(node)
        if node.host is not None and node.host[slot] >= 0:
            self.lower.discard(node.host[slot])

    # -- the lower tier --------------------------------------------------------------------------
    def hold_below(self, node: BlockNode, slot: int, entry: int) -> None:
        """The lower tier now holds the node's page of `slot` (just evicted from the pool) in `entry`."""
        if node.host is None:
            node.host, node.hosted = [-1] * self.num_slots, [0] * len(self.column_sizes)
        node.host[slot] = entry
        node.hosted[self.column_of_slot[slot]] += 1
        self.version += 1
        if self.changed is not None:
            self.changed.add(node)

    def move_below(self, node: BlockNode, slot: int, entry: int) -> None:
        """The lower tier moved the node's page of `slot` to another of its entries (memory to a file)."""
        node.host[slot] = entry

    def graft(self, parent: BlockNode, key: tuple) -> BlockNode:
        """The node of `key` under `parent`, created without pages if absent (the disk tier's restart fills
        its slots with hold_below; prune_empty removes what stays empty)."""
        node = parent.children.get(key)
        if node is None:
            node = BlockNode(parent, key, parent.depth + 1, self.num_slots, self.num_types, self.column_sizes)
            parent.children[key] = node
            parent.children_created += 1
            self.num_nodes += 1
            self._children_changed(parent)
            self._update_anchor(node)
            self.version += 1
            if self.changed is not None:
                self.changed.add(node)
        return node

    def prune_empty(self) -> None:
        """Remove every leaf left with no page anywhere (and the chains above it that end up so)."""
        stack, leaves = [self.root], []
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is not self.root and not node.children and node.empty:
                leaves.append(node)
        for leaf in leaves:
            self._remove_empty_leaves(leaf)

    def drop_below(self, node: BlockNode, slot: int, prune: bool = True) -> None:
        """The lower tier let the node's page of `slot` go; a node left with no page anywhere leaves the trie
        (`prune` False: the caller gives the slot a pool page next, a load's adopt)."""
        node.host[slot] = -1
        node.hosted[self.column_of_slot[slot]] -= 1
        if not any(node.hosted):
            node.host = node.hosted = None
        self.version += 1
        if self.changed is not None:
            self.changed.add(node)
        if prune:
            self._remove_empty_leaves(node)

    # -- release and eviction ------------------------------------------------------------------
    def unref(self, rank: int, pages: Iterable[int], owner: Hashable) -> None:
        """Drop the owner's reference to cached pages (validated by the caller); keep them cached."""
        self.clock += 1
        holders_of, where, ticks = self.pools[rank].holders, self.where[rank], self.tick_of[rank]
        for p in pages:
            holders = holders_of[p]
            holders.remove(owner)
            if holders:
                continue
            node, s = where[p]
            ticks[p] = self.clock
            self._count_evictable(rank, p, +1)
            node.num_referenced -= 1
            if node.num_referenced == 0:
                self._repush(node)  # may have become a whole unreferenced leaf
            else:
                self._push(rank, node, s, p)

    def evict(self, rank: int, count: int) -> bool:
        """Evict `count` unreferenced pages of a rank into their free lists; False (nothing done) if too few."""
        if count <= 0:
            return True
        if self.num_evictable[rank] < count:
            return False
        where, holders = self.where[rank], self.pools[rank].holders
        while count:
            if not self.heaps[rank]:
                self._rebuild_heap(rank)
            # Looked up each time: evicting a page can repush its node's pages, and a push may
            # compact, which replaces the heap list.
            entry = heapq.heappop(self.heaps[rank])
            p = entry[3]
            loc = where.get(p)
            if loc is None or holders[p] or self._key(rank, loc[0], loc[1], p) != entry:
                continue  # stale entry: the page was referenced, evicted or changed class since
            self._evict_page(rank, p, *loc)
            count -= 1
        self._compact_if_bloated(rank)
        return True

    def forget(self, rank: int, page: int) -> None:
        """Take an unreferenced cached page out of the cache without storing it below: a load could not write
        it (its file was corrupt), so nothing may read it. A node left with no page anywhere leaves the trie."""
        node, slot = self.where[rank][page]
        if self.pools[rank].holders[page]:
            raise AssertionError(f"page {page} (rank {rank}) of {node!r} is forgotten while referenced by "
                                 f"{set(self.pools[rank].holders[page])}")
        self._evict_page(rank, page, node, slot, spill=False)

    def clear(self) -> int:
        """Evict every unreferenced cached page and empty the lower tier; returns the pool pages evicted."""
        lower, self.lower = self.lower, None  # nothing spills: everything goes
        total = 0
        try:
            for rank in range(len(self.pools)):
                n = self.num_evictable[rank]
                self.evict(rank, n)
                total += n
        finally:
            self.lower = lower
        if lower is not None:
            lower.clear()
        return total

    @property
    def num_cached_pages(self) -> int:
        return sum(len(w) for w in self.where)

    # -- internals -----------------------------------------------------------------------------
    def _count_evictable(self, rank: int, page: int, delta: int) -> None:
        self.num_evictable[rank] += delta
        self.evictable_per_home[rank][page % self.pools[rank].num_lists] += delta

    def _key(self, rank: int, node: BlockNode, slot: int, page: int) -> tuple:
        k = self.type_of_slot[slot]
        if k is not None and node.depth >= self.type_sink_blocks[k] and node.protects[k] == 0:
            cls = STALE_SWA
        elif node.num_referenced == 0 and not node.children:
            cls = WHOLE_LEAF
        else:
            cls = OTHER
        return cls, self.tick_of[rank][page], -node.depth, page

    def _push(self, rank: int, node: BlockNode, slot: int, page: int) -> None:
        # Hits and releases push fresh entries and leave the old ones stale; compacting here (not
        # only in evict) bounds the heap when the cache never runs dry. Amortised O(1) per push.
        self._compact_if_bloated(rank)
        heapq.heappush(self.heaps[rank], self._key(rank, node, slot, page))

    def _compact_if_bloated(self, rank: int) -> None:
        """Drop stale entries once they outnumber live ones 3 to 1; O(heap), so O(1) per push
        amortised, whatever the number of cached pages still in use."""
        heap = self.heaps[rank]
        if len(heap) <= 4 * self.num_evictable[rank] + 256:
            return
        where, holders, live = self.where[rank], self.pools[rank].holders, {}
        for entry in heap:
            page = entry[3]
            loc = where.get(page)
            if loc is not None and not holders[page] and self._key(rank, loc[0], loc[1], page) == entry:
                live[page] = entry  # duplicates of a current entry collapse to one
        heap = list(live.values())
        heapq.heapify(heap)
        self.heaps[rank] = heap

    def _repush(self, node: BlockNode) -> None:
        """Push fresh heap entries for the node's unreferenced pages after its class may have changed."""
        for s, p in enumerate(node.pages):
            if p >= 0:
                rank = self.slot_rank[s]
                if not self.pools[rank].holders[p]:
                    self._push(rank, node, s, p)

    def _rebuild_heap(self, rank: int) -> None:
        """One current entry per evictable page, from the trie's page index: the fallback for an
        empty heap, O(cached pages)."""
        holders = self.pools[rank].holders
        heap = [self._key(rank, node, s, p) for p, (node, s) in self.where[rank].items() if not holders[p]]
        heapq.heapify(heap)
        self.heaps[rank] = heap

    def _evict_page(self, rank: int, page: int, node: BlockNode, slot: int, spill: bool = True) -> None:
        pool = self.pools[rank]
        # A page a hit can still read goes down a tier (copied before anyone can write it: allocation
        # only hands it out, the next step writes); a stale sliding page no anchor sees is dropped.
        spill = spill and self.lower is not None and self._key(rank, node, slot, page)[0] != STALE_SWA
        entry = self.lower.store(rank, page, node, slot) if spill else -1
        node.pages[slot] = -1
        node.gaps[self.column_of_slot[slot]] += 1
        del self.where[rank][page], self.tick_of[rank][page], pool.holders[page]
        self._count_evictable(rank, page, -1)
        pool.release([page])
        self.evictions_total += 1
        self.version += 1
        if self.changed is not None:
            self.changed.add(node)
        if entry >= 0:
            self.hold_below(node, slot, entry)
        self._remove_empty_leaves(node)

    def _remove_empty_leaves(self, node: BlockNode) -> None:
        while node is not self.root and not node.detached and not node.children and node.empty:
            parent = node.parent
            self._remove_leaf(node)
            node = parent

    def _remove_leaf(self, node: BlockNode) -> None:
        if self.changed is not None:
            self.changed.add(node)
        node.children = {}
        self._update_anchor(node, force_off=True)
        parent = node.parent
        del parent.children[node.key]
        node.parent = None
        self.num_nodes -= 1
        self._children_changed(parent)

    def _children_changed(self, node: BlockNode) -> None:
        if node is self.root:
            return
        self._update_anchor(node)
        if node.num_referenced == 0 and len(node.children) <= 1:
            self._repush(node)  # it may have become (or stopped being) a whole leaf

    def _update_anchor(self, node: BlockNode, force_off: bool = False) -> None:
        """Keep `protects[k]` = number of anchors whose window of recycling type k covers each block."""
        if not self.rec_slots:
            return
        want = not force_off and (len(node.children) != 1 or node.children_created > 1)  # a leaf or a branch point
        if want == node.anchor:
            return
        node.anchor = want
        delta = 1 if want else -1
        for k in range(len(self.types)):
            lo = self.dead_end(node.depth + 1, k)
            a = node
            while a is not self.root and a.depth >= lo:
                was_zero = a.protects[k] == 0
                a.protects[k] += delta
                if was_zero != (a.protects[k] == 0):
                    self._repush(a)
                a = a.parent

    # -- verification --------------------------------------------------------------------------
    def check(self) -> None:
        """Raise AssertionError unless trie, references, tombstones, anchors and heaps are consistent."""
        nodes, stack = [], [self.root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                if child.parent is not node or child.key != key or child.depth != node.depth + 1:
                    raise AssertionError(f"{child!r} is linked wrongly under {node!r}")
                stack.append(child)
                nodes.append(child)
        if len(nodes) != self.num_nodes:
            raise AssertionError(f"trie has {len(nodes)} nodes, counter says {self.num_nodes}")
        seen = [0] * len(self.pools)
        evictable = [0] * len(self.pools)
        protect = {id(n): [0] * self.num_types for n in nodes}
        heap_entries = [set(heap) for heap in self.heaps]
        below = 0
        for node in nodes:
            if not node.children and node.empty:
                raise AssertionError(f"{node!r}: an all-tombstone leaf was not removed")
            if node.host is not None:
                hosted = [0] * len(self.column_sizes)
                for s, h in enumerate(node.host):
                    if h >= 0:
                        hosted[self.column_of_slot[s]] += 1
                        if node.pages[s] >= 0:
                            raise AssertionError(f"{node!r}: slot {s} is in the pool and in the lower tier")
                        if self.lower is None or self.lower.holder(h) != (node, s):
                            raise AssertionError(f"{node!r}: slot {s} names lower-tier entry {h}, which holds "
                                                 f"something else")
                        below += 1
                if hosted != node.hosted or not any(hosted):
                    raise AssertionError(f"{node!r}: lower-tier entries per column {hosted}, counters say "
                                         f"{node.hosted}")
            gaps = [0] * len(self.column_sizes)
            for s, p in enumerate(node.pages):
                gaps[self.column_of_slot[s]] += p < 0
            if gaps != node.gaps:
                raise AssertionError(f"{node!r}: tombstones per column {gaps}, counters say {node.gaps}")
            referenced = 0
            for s, p in enumerate(node.pages):
                if p < 0:
                    continue
                rank = self.slot_rank[s]
                pool = self.pools[rank]
                if self.where[rank].get(p) != (node, s) or pool.owner[p] is not CACHED:
                    raise AssertionError(f"page {p} (rank {rank}) of {node!r} is not recorded as cached there")
                seen[rank] += 1
                if pool.holders[p]:
                    referenced += 1
                else:
                    evictable[rank] += 1
                    if self._key(rank, node, s, p) not in heap_entries[rank]:
                        raise AssertionError(f"evictable page {p} (rank {rank}) has no valid heap entry")
            if referenced != node.num_referenced:
                raise AssertionError(f"{node!r}: {referenced} referenced pages, counter says {node.num_referenced}")
            if self.rec_slots:
                anchor = len(node.children) != 1 or node.children_created > 1
                if anchor != node.anchor:
                    raise AssertionError(f"{node!r}: anchor flag {node.anchor}, expected {anchor}")
                if anchor:
                    for k in range(len(self.types)):
                        lo, a = self.dead_end(node.depth + 1, k), node
                        while a is not self.root and a.depth >= lo:
                            protect[id(a)][k] += 1
                            a = a.parent
        if self.lower is not None:
            self.lower.check(below)
        for page, load in self.loading.items():  # being written: cached, and kept from eviction by its load
            if page not in self.where[0] or load not in self.pools[0].holders[page]:
                raise AssertionError(f"page {page} being loaded by {load!r} is not a cached page it references")
        for node in nodes:
            if self.rec_slots and protect[id(node)] != node.protects:
                raise AssertionError(f"{node!r}: protect {node.protects}, expected {protect[id(node)]}")
        for rank, pool in enumerate(self.pools):
            if seen[rank] != len(self.where[rank]):
                raise AssertionError(f"rank {rank}: {len(self.where[rank])} cached pages recorded, "
                                     f"{seen[rank]} reachable in the trie")
            if evictable[rank] != self.num_evictable[rank] or sum(self.evictable_per_home[rank]) != evictable[rank]:
                raise AssertionError(f"rank {rank}: {evictable[rank]} evictable pages, counters say "
                                     f"{self.num_evictable[rank]} / {self.evictable_per_home[rank]}")
            cached_owner = sum(1 for o in pool.owner if o is CACHED)
            if cached_owner != seen[rank] or len(pool.holders) != seen[rank]:
                raise AssertionError(f"rank {rank}: {cached_owner} pages owned by the cache, "
                                     f"{len(pool.holders)} reference sets, {seen[rank]} in the trie")
