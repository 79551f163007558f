"""The host tier: a second level of the prefix cache, in host memory, below the KV pool (`--swap-space`).

When the pool evicts a cached page that a hit can still read, the page's bytes are copied here instead
of being lost (prefix_tree.PrefixCache._evict_page); a stale sliding page, one no anchor's window sees,
is never stored, so with FD_HEAD_WISE_KV_CACHE=1 the tier holds only each head's pages a hit needs. The
tier is indexed by the prefix tree itself: a trie node keeps, per slot, its page in the pool or its
entry here (`BlockNode.host`). A lookup may end on pages held here; before the request starts, they are
copied back into pool pages and become cached pool pages again (PrefixCacheManager.load_prefix), so the
scheduler's page arithmetic never sees the tier.

An entry holds one pool id's bytes of every KV tensor (K and V of each lane, scales of quantized pages):
a page head-wise, a block of every head in 1-D mode. Entries leave least-recently-stored first; the
entries a load is reading are pinned. Copies run in the engine process on the in-process rank's tensors
(tensor_parallel_size 1, pages in host memory: the CPU device), between two steps, so no step is writing
the pages copied.
"""

from __future__ import annotations

import collections
import ctypes
import time
from typing import Optional

import numpy as np


def pool_views(kv_tensors: list, num_entries: int) -> list:
    """A [num_entries, bytes per entry] uint8 view of each KV tensor's memory (host tensors, entry-major)."""
    views = []
    for tensor in kv_tensors:
        nbytes = int(tensor.numel()) * tensor.element_size()
        buffer = (ctypes.c_uint8 * nbytes).from_address(int(tensor.data_ptr()))
        views.append(np.ctypeslib.as_array(buffer).reshape(num_entries, nbytes // num_entries))
    return views


class HostTier:
    """Entries of page bytes in host memory, their LRU and what each holds (a trie node's slot)."""

    def __init__(self, num_entries: int, views: list, keep_alive: Optional[list] = None):
        """`views`: per KV tensor, [pool ids, bytes] arrays the pool's pages live in (pool_views)."""
        if num_entries < 1:
            raise ValueError(f"the host tier holds no page: {num_entries} entries")
        self.views = views
        self._keep_alive = keep_alive  # the tensors behind the views
        units = [v.shape[1] for v in views]
        self.offsets = np.cumsum([0] + units[:-1]).tolist()
        self.units = units
        self.entry_bytes = sum(units)
        self.num_entries = num_entries
        self.data = np.empty((num_entries, self.entry_bytes), np.uint8)  # pages are touched when first stored
        self.cache = None  # the PrefixCache whose trie names the entries (PrefixCacheManager.attach_host_tier)
        self._holder: list = [None] * num_entries       # entry -> (node, slot)
        self._free = list(range(num_entries - 1, -1, -1))
        self._lru: collections.OrderedDict = collections.OrderedDict()  # held, unpinned entries, oldest first
        self._pinned: set = set()
        self.stored_total = 0        # pages copied in
        self.evicted_total = 0       # pages dropped to make room
        self.loaded_total = 0        # pages copied back into the pool
        self.load_seconds_total = 0.0
        self.store_seconds_total = 0.0
        self.loads_total = 0         # prefix hits that loaded pages from here

    @classmethod
    def for_bytes(cls, swap_space_bytes: int, kv_tensors: list, num_pool_entries: int) -> "HostTier":
        views = pool_views(kv_tensors, num_pool_entries)
        entry_bytes = sum(v.shape[1] for v in views)
        entries = int(swap_space_bytes) // entry_bytes
        if entries < 1:
            raise ValueError(f"--swap-space: {swap_space_bytes} bytes hold no page of {entry_bytes} bytes")
        return cls(entries, views, keep_alive=list(kv_tensors))

    # -- what the prefix tree asks -------------------------------------------------------------
    def store(self, rank: int, page: int, node, slot: int) -> int:
        """Copy a pool page being evicted into an entry; the entry, or -1 when every entry is being read."""
        if rank != 0:
            raise ValueError("the host tier serves one rank (tensor_parallel_size 1)")
        if self._free:
            entry = self._free.pop()
        elif self._lru:
            entry, _ = self._lru.popitem(last=False)
            old_node, old_slot = self._holder[entry]
            self._holder[entry] = None
            self.evicted_total += 1
            self.cache.drop_below(old_node, old_slot)
        else:
            return -1
        t0 = time.perf_counter()
        row = self.data[entry]
        for view, off, unit in zip(self.views, self.offsets, self.units):
            row[off:off + unit] = view[page]
        self.store_seconds_total += time.perf_counter() - t0
        self._holder[entry] = (node, slot)
        self._lru[entry] = None
        self.stored_total += 1
        return entry

    def discard(self, entry: int) -> None:
        """The pool holds the entry's page again: the entry is free."""
        node, slot = self._holder[entry]
        self._release(entry)
        self.cache.drop_below(node, slot)

    def holder(self, entry: int):
        return self._holder[entry]

    # -- loads ---------------------------------------------------------------------------------
    def pin(self, entries: list) -> None:
        """Keep these entries while pool pages are found for them (allocation may store others here)."""
        for entry in entries:
            del self._lru[entry]
            self._pinned.add(entry)

    def unpin(self, entries: list) -> None:
        for entry in entries:
            self._pinned.discard(entry)
            self._lru[entry] = None
            self._lru.move_to_end(entry, last=False)  # a load that fell through: first to go again

    def load(self, entries: list, pages: list) -> None:
        """Copy pinned entries into pool pages (rank 0); the trie adopting the pages frees the entries."""
        t0 = time.perf_counter()
        rows = self.data[np.asarray(entries, np.int64)]
        index = np.asarray(pages, np.int64)
        for view, off, unit in zip(self.views, self.offsets, self.units):
            view[index] = rows[:, off:off + unit]
        self.load_seconds_total += time.perf_counter() - t0
        self.loaded_total += len(entries)
        self.loads_total += 1

    def clear(self) -> None:
        for entry in list(self._lru):
            self.discard(entry)

    def _release(self, entry: int) -> None:
        self._holder[entry] = None
        self._pinned.discard(entry)
        self._lru.pop(entry, None)
        self._free.append(entry)

    # -- observability -------------------------------------------------------------------------
    @property
    def num_held(self) -> int:
        return self.num_entries - len(self._free)

    def stats(self) -> dict:
        return {"host_cache_pages": self.num_held, "host_cache_pages_total": self.num_entries,
                "host_cache_bytes": self.num_held * self.entry_bytes,
                "host_cache_stored_pages_total": self.stored_total,
                "host_cache_evicted_pages_total": self.evicted_total,
                "host_cache_loaded_pages_total": self.loaded_total,
                "host_cache_loads_total": self.loads_total,
                "host_cache_load_seconds_total": self.load_seconds_total,
                "host_cache_store_seconds_total": self.store_seconds_total}

    def check(self, named_by_trie: int) -> None:
        """Raise AssertionError unless every entry is free or held once (LRU or pinned), and the trie names
        exactly the held ones (`named_by_trie`: the entries its nodes name)."""
        held = [e for e, h in enumerate(self._holder) if h is not None]
        if len(held) + len(self._free) != self.num_entries or len(set(self._free)) != len(self._free):
            raise AssertionError(f"host tier: {len(held)} held + {len(self._free)} free != {self.num_entries}")
        if set(held) != set(self._lru) | self._pinned or set(self._lru) & self._pinned:
            raise AssertionError("host tier: held entries differ from the LRU and the pinned ones")
        if named_by_trie != len(held):
            raise AssertionError(f"host tier: {len(held)} entries held, the trie names {named_by_trie}")
