"""The host tier: a second level of the prefix cache, in host memory, below the KV pool (`--swap-space`).

When the pool evicts a cached page that a hit can still read, the page's bytes are copied here instead
of being lost (prefix_tree.PrefixCache._evict_page); a stale sliding page, one no anchor's window sees,
is never stored, so with FD_HEAD_WISE_KV_CACHE=1 the tier holds only each head's pages a hit needs. The
tier is indexed by the prefix tree itself: a trie node keeps, per slot, its page in the pool or its
entry here (`BlockNode.host`). A lookup may end on pages held here; at admission they get pool pages that
become cached pool pages at once (PrefixCacheManager.load_prefix), so the scheduler's page arithmetic never
sees the tier, and the bytes are copied into them off the engine loop (tier_loader.py: `copy_in` runs on
the loader's thread) while the request waits in the loading state.

An entry holds one pool id's bytes of every KV tensor (K and V of each lane, scales of quantized pages):
a page head-wise, a block of every head in 1-D mode. Entries leave least-recently-stored first; the
entries a load is reading are pinned, then held by the load (no longer named by the trie) until it ends.
Stores run in the engine process between two steps on the in-process rank's tensors (tensor_parallel_size
1, pages in host memory: the CPU device); a load writes only pool pages no step reads or writes.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import time
from typing import Optional

import numpy as np

from fastdeploy.cache_manager.disk_tier import PageFiles, chain_digest

logger = logging.getLogger("fastdeploy.cache")


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

    def __init__(self, num_entries: int, views: list, keep_alive: Optional[list] = None, codec=None):
        """`views`: per KV tensor, [pool ids, bytes] arrays the pool's pages live in (pool_views); `codec`
        (tier_codec.PageCodec): entries are stored compressed (--swap-space-dtype), else as the pool's bytes."""
        if num_entries < 1:
            raise ValueError(f"the host tier holds no page: {num_entries} entries")
        self.views = views
        self._keep_alive = keep_alive  # the tensors behind the views
        units = [v.shape[1] for v in views]
        self.offsets = np.cumsum([0] + units[:-1]).tolist()
        self.units = units
        self.codec = codec
        self.pool_entry_bytes = sum(units)  # one pool id's bytes in every KV tensor
        self.entry_bytes = codec.stored_bytes if codec is not None else self.pool_entry_bytes  # as stored here
        self.num_entries = num_entries
        self.data = np.empty((num_entries, self.entry_bytes), np.uint8)  # pages are touched when first stored
        self.cache = None  # the PrefixCache whose trie names the entries (PrefixCacheManager.attach_host_tier)
        self._holder: list = [None] * num_entries       # entry -> (node, slot)
        self._free = list(range(num_entries - 1, -1, -1))
        self._lru: collections.OrderedDict = collections.OrderedDict()  # held, unpinned entries, oldest first
        self._pinned: set = set()
        self._loading: set = set()   # entries a load is copying into the pool (no longer named by the trie)
        self.stored_total = 0        # pages copied in
        self.evicted_total = 0       # pages dropped to make room
        self.loaded_total = 0        # pages copied back into the pool
        self.load_seconds_total = 0.0
        self.store_seconds_total = 0.0
        self.loads_total = 0         # prefix hits that loaded pages from here
        self.load_failures_total = 0  # loads that could not write every page (a corrupt file): recomputed
        # The disk tier (attach_disk): handle -> file path and -> (node, slot); its own LRU and pinned set.
        self.files: Optional[PageFiles] = None
        self.disk_capacity = 0
        self._disk_path: dict = {}
        self._disk_holder: dict = {}
        self._disk_lru: collections.OrderedDict = collections.OrderedDict()
        self._disk_pinned: set = set()
        self._disk_loading: set = set()
        self._next_handle = num_entries
        self.disk_stored_total = self.disk_evicted_total = self.disk_loaded_total = self.disk_restored_total = 0
        self.disk_load_seconds_total = self.disk_store_seconds_total = 0.0

    @classmethod
    def for_bytes(cls, swap_space_bytes: int, kv_tensors: list, num_pool_entries: int, dtype: Optional[str] = None,
                  head_dim: int = 0) -> "HostTier":
        """A tier of `swap_space_bytes` over these KV tensors; `dtype` int8/int4: compressed entries (float32
        pool pages only; the first half of the tensors hold keys, as the attention backend lists them)."""
        views = pool_views(kv_tensors, num_pool_entries)
        codec = None
        if dtype is not None:
            from fastdeploy.cache_manager.tier_codec import PageCodec

            codec = PageCodec(dtype, [v.shape[1] for v in views], head_dim, num_key_views=len(views) // 2)
        entry_bytes = codec.stored_bytes if codec is not None else sum(v.shape[1] for v in views)
        entries = int(swap_space_bytes) // entry_bytes
        if entries < 1:
            raise ValueError(f"--swap-space: {swap_space_bytes} bytes hold no page of {entry_bytes} bytes")
        return cls(entries, views, keep_alive=list(kv_tensors), codec=codec)

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
            if not self._to_disk(self.data[entry], old_node, old_slot):
                self.cache.drop_below(old_node, old_slot)
        else:
            return -1
        t0 = time.perf_counter()
        row = self.data[entry]
        if self.codec is not None:
            self.codec.encode(self.views, page, row)
        else:
            for view, off, unit in zip(self.views, self.offsets, self.units):
                row[off:off + unit] = view[page]
        self.store_seconds_total += time.perf_counter() - t0
        self._holder[entry] = (node, slot)
        self._lru[entry] = None
        self.stored_total += 1
        return entry

    def discard(self, entry: int) -> None:
        """The pool holds the entry's page again: the entry is free (a file: deleted)."""
        node, slot = self.holder(entry)
        self._release(entry)
        self.cache.drop_below(node, slot)

    def holder(self, entry: int):
        return self._holder[entry] if entry < self.num_entries else self._disk_holder.get(entry)

    # -- loads ---------------------------------------------------------------------------------
    def pin(self, entries: list) -> None:
        """Keep these entries while pool pages are found for them (allocation may store others here)."""
        for entry in entries:
            lru, pinned = self._lists(entry)
            del lru[entry]
            pinned.add(entry)

    def unpin(self, entries: list) -> None:
        for entry in entries:
            lru, pinned = self._lists(entry)
            if entry in pinned:  # not a file fetch dropped
                pinned.discard(entry)
                lru[entry] = None
                lru.move_to_end(entry, last=False)  # a load that fell through: first to go again

    def claim(self, entry: int) -> Optional[str]:
        """A pinned entry leaves the trie: a load holds it until it ends (end_load). Returns its file, or None
        for an entry in memory. The caller gives the trie's slot a pool page at once (PrefixCache.adopt)."""
        node, slot = self.holder(entry)
        self.cache.drop_below(node, slot, prune=False)
        if entry < self.num_entries:
            self._pinned.remove(entry)
            self._holder[entry] = None
            self._loading.add(entry)
            return None
        self._disk_pinned.remove(entry)
        del self._disk_holder[entry]
        self._disk_loading.add(entry)
        return self._disk_path[entry]

    def copy_in(self, load) -> None:
        """The loader's thread: read the load's files, copy every entry it could read into its pool page (rank
        0). Reads the load's own entries and writes its own pages only; records what failed on the load."""
        t0 = time.perf_counter()
        rows, good = [], []
        if all(path is None for path in load.paths):  # host memory only: one gather, not a row at a time
            rows, good = self.data[np.asarray(load.entries, np.int64)], list(load.pages)
        else:
            for i, (entry, path) in enumerate(zip(load.entries, load.paths)):
                row = self.data[entry] if path is None else self.files.read_checked(path)
                if row is None:
                    load.bad.append(i)  # truncated or corrupt: its page is not written (end_load drops it)
                else:
                    rows.append(row)
                    good.append(load.pages[i])
        t1 = time.perf_counter()
        load.read_seconds = t1 - t0 if any(p is not None for p in load.paths) else 0.0
        if len(rows):
            rows = rows if isinstance(rows, np.ndarray) else np.stack(rows)
            index = np.asarray(good, np.int64)
            if self.codec is not None:
                self.codec.decode(rows, self.views, index)
            else:
                for view, off, unit in zip(self.views, self.offsets, self.units):
                    view[index] = rows[:, off:off + unit]
        load.copy_seconds = time.perf_counter() - t1

    def end_load(self, load) -> None:
        """The engine loop, once the worker is done: the load's entries are let go (the pool holds their pages
        now; a corrupt file is deleted and counted), and its times and pages counted."""
        unwritten = set(load.unwritten())
        for i, entry in enumerate(load.entries):
            if entry < self.num_entries:
                self._loading.remove(entry)
                self._free.append(entry)
                continue
            self._disk_loading.remove(entry)
            path = self._disk_path.pop(entry)
            if i in load.bad:
                self.files.drop_corrupt(path)
            else:
                self.files.remove(path)
        written = [e for i, e in enumerate(load.entries) if i not in unwritten]
        self.disk_load_seconds_total += load.read_seconds
        self.load_seconds_total += load.copy_seconds
        self.loaded_total += len(written)
        self.disk_loaded_total += sum(e >= self.num_entries for e in written)
        if unwritten:
            self.load_failures_total += 1
        else:
            self.loads_total += 1

    @property
    def num_loading(self) -> int:
        """Entries held by loads in flight."""
        return len(self._loading) + len(self._disk_loading)

    def clear(self) -> None:
        """Let every entry go (files deleted)."""
        for entry in list(self._lru) + list(self._disk_lru):
            self.discard(entry)

    def _lists(self, entry: int) -> tuple:
        return (self._lru, self._pinned) if entry < self.num_entries else (self._disk_lru, self._disk_pinned)

    def _release(self, entry: int) -> None:
        if entry >= self.num_entries:
            self.files.remove(self._disk_path.pop(entry))
            del self._disk_holder[entry]
            self._disk_pinned.discard(entry)
            self._disk_lru.pop(entry, None)
            return
        self._holder[entry] = None
        self._pinned.discard(entry)
        self._lru.pop(entry, None)
        self._free.append(entry)

    # -- the disk tier -------------------------------------------------------------------------
    def attach_disk(self, files: PageFiles, capacity_bytes: int) -> None:
        """Write what the LRU lets go to `files` (up to `capacity_bytes` of pages) instead of dropping it."""
        if files.entry_bytes != self.entry_bytes:
            raise ValueError(f"disk tier: files of {files.entry_bytes}-byte entries under a {self.entry_bytes}-byte tier")
        self.files = files
        self.disk_capacity = int(capacity_bytes) // self.entry_bytes
        if self.disk_capacity < 1:
            raise ValueError(f"--kvcache-storage-space: {capacity_bytes} bytes hold no page of {self.entry_bytes} bytes")

    def _to_disk(self, row: np.ndarray, node, slot: int) -> bool:
        """Write the (node, slot) entry's bytes to a file and make the trie name it; False without a disk
        tier, when every file is being read, or when the write fails (the page is then dropped)."""
        if self.files is None:
            return False
        while len(self._disk_path) >= self.disk_capacity:  # files being loaded still take room
            if not self._disk_lru:
                return False
            oldest = next(iter(self._disk_lru))
            self.disk_evicted_total += 1
            self.discard(oldest)
        t0 = time.perf_counter()
        try:
            path = self.files.write(self._digest(node), self._digest(node.parent), node.key, slot, row)
        except OSError as exc:
            self.files.write_errors_total += 1
            if self.files.write_errors_total == 1:
                logger.warning("disk tier: writing a page failed (%s); pages the host tier lets go are dropped "
                               "until writes succeed", exc)
            return False
        self.disk_store_seconds_total += time.perf_counter() - t0
        handle = self._adopt_file(path, node, slot)
        self.cache.move_below(node, slot, handle)
        self.disk_stored_total += 1
        return True

    def _adopt_file(self, path: str, node, slot: int) -> int:
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        self._disk_path[handle] = path
        self._disk_holder[handle] = (node, slot)
        self._disk_lru[handle] = None
        return handle

    def _digest(self, node) -> str:
        """The chain digest of a trie node (the root's: the cache identity), memoised on the node."""
        todo = []
        while node.depth >= 0 and node.digest is None:
            todo.append(node)
            node = node.parent
        digest = self.files.identity if node.depth < 0 else node.digest
        for n in reversed(todo):
            n.digest = digest = chain_digest(digest, n.key)
        return digest

    def persist(self) -> int:
        """Write every entry held in memory to disk, oldest first (a clean shutdown); returns how many."""
        written = 0
        for entry in list(self._lru):
            node, slot = self._holder[entry]
            if self._to_disk(self.data[entry], node, slot):
                self._holder[entry] = None
                self._lru.pop(entry)
                self._free.append(entry)
                written += 1
        return written

    def restore(self) -> int:
        """Rebuild the trie's nodes from the files (pages on disk only), oldest first; files whose chain does
        not reach the root (a parent's files are gone) and files beyond the capacity are deleted. Returns
        the pages restored."""
        found = list(self.files.scan())
        excess = len(found) - self.disk_capacity
        for path, *_ in found[:max(0, excess)]:
            self.files.remove(path)
        found = found[max(0, excess):]
        parents = {chain_digest(parent, key): (parent, key) for _, parent, key, _, _ in found}
        nodes = {self.files.identity: self.cache.root}

        def node_of(digest):
            chain = []
            while digest not in nodes:
                if digest not in parents:
                    return None
                chain.append(digest)
                digest = parents[digest][0]
            for d in reversed(chain):
                nodes[d] = self.cache.graft(nodes[parents[d][0]], parents[d][1])
                nodes[d].digest = d
            return nodes[chain[0]] if chain else nodes[digest]

        restored = 0
        for path, parent, key, slot, _ in found:
            node = node_of(chain_digest(parent, key))
            if node is None or not 0 <= slot < self.cache.num_slots or (node.host is not None and node.host[slot] >= 0):
                self.files.remove(path)
                continue
            self.cache.hold_below(node, slot, self._adopt_file(path, node, slot))
            restored += 1
        self.cache.prune_empty()
        self.disk_restored_total = restored
        return restored

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
                "host_cache_load_failures_total": self.load_failures_total,
                "host_cache_loading_pages": self.num_loading,
                "host_cache_load_seconds_total": self.load_seconds_total,
                "host_cache_store_seconds_total": self.store_seconds_total,
                **(self._disk_stats() if self.files is not None else {})}

    def _disk_stats(self) -> dict:
        return {"disk_cache_pages": len(self._disk_path), "disk_cache_pages_total": self.disk_capacity,
                "disk_cache_bytes": len(self._disk_path) * self.entry_bytes,
                "disk_cache_stored_pages_total": self.disk_stored_total,
                "disk_cache_evicted_pages_total": self.disk_evicted_total,
                "disk_cache_loaded_pages_total": self.disk_loaded_total,
                "disk_cache_restored_pages": self.disk_restored_total,
                "disk_cache_corrupt_files_total": self.files.corrupt_total,
                "disk_cache_load_seconds_total": self.disk_load_seconds_total,
                "disk_cache_store_seconds_total": self.disk_store_seconds_total}

    def check(self, named_by_trie: int) -> None:
        """Raise AssertionError unless every entry is free, held once (LRU or pinned) or being loaded, and the
        trie names exactly the held ones (`named_by_trie`: the entries its nodes name)."""
        held = [e for e, h in enumerate(self._holder) if h is not None]
        if len(held) + len(self._loading) + len(self._free) != self.num_entries or \
                len(set(self._free) | set(held) | self._loading) != self.num_entries:
            raise AssertionError(f"host tier: {len(held)} held + {len(self._loading)} loading + {len(self._free)} "
                                 f"free != {self.num_entries}")
        if set(held) != set(self._lru) | self._pinned or set(self._lru) & self._pinned:
            raise AssertionError("host tier: held entries differ from the LRU and the pinned ones")
        files = set(self._disk_holder)
        if files != set(self._disk_lru) | self._disk_pinned or set(self._disk_lru) & self._disk_pinned or \
                files & self._disk_loading or files | self._disk_loading != set(self._disk_path) or \
                len(self._disk_path) > max(self.disk_capacity, 0):
            raise AssertionError("disk tier: held files differ from the LRU and the pinned ones, or exceed the capacity")
        if named_by_trie != len(held) + len(files):
            raise AssertionError(f"host tier: {len(held)} entries and {len(files)} files held, the trie names "
                                 f"{named_by_trie}")
