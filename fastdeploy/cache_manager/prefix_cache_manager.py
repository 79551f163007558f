"""PrefixCacheManager: the free lists of KV blocks (1-D mode) or per-head pages (head-wise mode).

1-D mode hands out whole blocks from one min-heap. Head-wise mode keeps one min-heap of pages per
KV head (a page's home head is `page % H`); a head allocates from its own list and, when that is
empty, borrows from the fullest other list on its rank, so pages freed by sliding-window heads serve
full heads of other requests. With tensor parallelism every rank has its own page space and lists.

Ownership is tracked per page (or block), so double frees and frees of someone else's page are
caught at the call, not as corrupted attention three steps later.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Iterable, Optional, Sequence

from fastdeploy.cache_manager.head_wise import PageLayout

_ANONYMOUS = "<no request>"


class _Pool:
    """Free lists and owners of one rank's page (or block) space."""

    def __init__(self, num_ids: int, num_lists: int):
        self.num_lists = num_lists
        self.num_ids = num_ids
        self.owner: list = [None] * num_ids
        self.free_lists: list = [list(range(h, num_ids, num_lists)) for h in range(num_lists)]
        self.num_free = num_ids  # kept in step with the lists; schedule() reads it every step

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

    def give_back(self, ids: Iterable[int], owner: Hashable, what: str) -> None:
        ids = list(ids)
        self.check_owned(ids, owner, what)
        self.release(ids)

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
        if len(set(ids)) != len(ids):
            raise ValueError(f"{_label(what, rank)} {_first_duplicate(ids)} appears twice in one free call "
                             f"of request {owner!r}")
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_ids:
                raise ValueError(f"{_label(what, rank)} {i!r} freed by request {owner!r} is not a valid id "
                                 f"(0..{self.num_ids - 1})")
            holder = owners[i]
            if holder != owner:
                if holder is None:
                    raise ValueError(f"double free: {_label(what, rank)} {i} freed by request {owner!r} "
                                     f"is already free")
                raise ValueError(f"{_label(what, rank)} {i} freed by request {owner!r} belongs to request "
                                 f"{holder!r}")

    def check(self, label: str) -> int:
        """Raise if a free id is missing, listed twice, in the wrong list, or also owned."""
        listed = [0] * self.num_ids
        for home, free in enumerate(self.free_lists):
            for i in free:
                if i % self.num_lists != home:
                    raise AssertionError(f"{label}: id {i} sits in free list {home}, its home is {i % self.num_lists}")
                listed[i] += 1
        owned = 0
        for i, holder in enumerate(self.owner):
            if holder is None and listed[i] != 1:
                raise AssertionError(f"{label}: free id {i} is listed {listed[i]} times")
            if holder is not None:
                if listed[i]:
                    raise AssertionError(f"{label}: id {i} is owned by {holder!r} and also free")
                owned += 1
        listed_total = sum(len(f) for f in self.free_lists)
        if listed_total != self.num_free:
            raise AssertionError(f"{label}: free count {self.num_free} but {listed_total} ids are listed")
        if owned + self.num_free != self.num_ids:
            raise AssertionError(f"{label}: free {self.num_free} + owned {owned} != total {self.num_ids}")
        return owned


class PrefixCacheManager:
    """Free-list manager for the KV cache, in 1-D or head-wise mode (DESIGN §3, §6)."""

    def __init__(self, fd_config, tensor_parallel_size: int = 1):
        if tensor_parallel_size != fd_config.parallel_config.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} differs from the config's "
                             f"{fd_config.parallel_config.tensor_parallel_size}")
        self.fd_config = fd_config
        self.head_wise = fd_config.head_wise_kv_cache
        self.layout = PageLayout.from_config(fd_config)
        self.num_gpu_blocks = fd_config.cache_config.num_gpu_blocks
        self.tensor_parallel_size = tensor_parallel_size
        self.heads_per_rank = self.layout.heads_per_rank
        if self.head_wise:
            pages = self.num_gpu_blocks * self.heads_per_rank
            self._pools = [_Pool(pages, self.heads_per_rank) for _ in range(tensor_parallel_size)]
        else:
            # Every rank holds the same block ids for its own heads: one pool serves them all.
            self._pools = [_Pool(self.num_gpu_blocks, 1)]

    # -- 1-D mode ------------------------------------------------------------------------------
    def can_allocate_gpu_blocks(self, num_blocks: int) -> bool:
        self._require_mode(False, "can_allocate_gpu_blocks")
        return num_blocks <= self._pools[0].num_free

    def allocate_gpu_blocks(self, num_blocks: int, req_id: Optional[Hashable] = None) -> list:
        self._require_mode(False, "allocate_gpu_blocks")
        owner = _owner(req_id)
        _check_count(num_blocks, owner)
        pool = self._pools[0]
        if num_blocks > pool.num_free:
            raise ValueError(f"request {owner!r} asked for {num_blocks} blocks but only {pool.num_free} are free")
        return pool.take(0, num_blocks, owner)

    def recycle_gpu_blocks(self, block_ids: Iterable[int], req_id: Optional[Hashable] = None) -> None:
        self._require_mode(False, "recycle_gpu_blocks")
        self._pools[0].give_back(block_ids, _owner(req_id), "block")

    # -- head-wise mode ------------------------------------------------------------------------
    def can_allocate_gpu_blocks_head_wise(self, num_blocks_per_head: Sequence[int]) -> bool:
        self._require_mode(True, "can_allocate_gpu_blocks_head_wise")
        need = self._need_per_rank(num_blocks_per_head, _ANONYMOUS)
        return all(n <= pool.num_free for n, pool in zip(need, self._pools))

    def allocate_gpu_blocks_head_wise(self, num_blocks_per_head: Sequence[int],
                                      req_id: Optional[Hashable] = None) -> list:
        """One list of rank-local page ids per global KV head; all-or-nothing."""
        self._require_mode(True, "allocate_gpu_blocks_head_wise")
        owner = _owner(req_id)
        need = self._need_per_rank(num_blocks_per_head, owner)
        for rank, (n, pool) in enumerate(zip(need, self._pools)):
            if n > pool.num_free:
                raise ValueError(f"request {owner!r} asked for {n} pages on rank {rank} but only "
                                 f"{pool.num_free} are free")
        hpr = self.heads_per_rank
        return [self._pools[h // hpr].take(h % hpr, n, owner) for h, n in enumerate(num_blocks_per_head)]

    def try_allocate_pages_every_head(self, count: int, req_id: Hashable) -> Optional[list]:
        """Scheduler fast path: `count` pages for every KV head, or None (nothing taken) if a rank lacks room."""
        hpr = self.heads_per_rank
        for pool in self._pools:
            if pool.num_free < count * hpr:
                return None
        return [pool.take(h, count, req_id) for pool in self._pools for h in range(hpr)]

    def recycle_pages_of_heads(self, heads: Sequence[int], pages_per_head: Sequence[list], req_id: Hashable) -> None:
        """Scheduler fast path of recycle_gpu_blocks_head_wise for a few heads; same checks."""
        hpr = self.heads_per_rank
        for h, pages in zip(heads, pages_per_head):
            self._pools[h // hpr].check_owned(pages, req_id, "page", h // hpr)
        for h, pages in zip(heads, pages_per_head):
            self._pools[h // hpr].release(pages)

    def recycle_gpu_blocks_head_wise(self, pages_per_head: Sequence[Iterable[int]],
                                     req_id: Optional[Hashable] = None) -> None:
        self._require_mode(True, "recycle_gpu_blocks_head_wise")
        owner = _owner(req_id)
        pages_per_head = [list(p) for p in pages_per_head]
        if len(pages_per_head) != self.layout.num_kv_heads:
            raise ValueError(f"request {owner!r}: expected pages for {self.layout.num_kv_heads} KV heads, "
                             f"got {len(pages_per_head)}")
        # Validate everything before freeing anything, so a bad call changes nothing.
        hpr = self.heads_per_rank
        per_rank = [sum(pages_per_head[rank * hpr:(rank + 1) * hpr], [])
                    for rank in range(self.tensor_parallel_size)]
        for rank, (pool, pages) in enumerate(zip(self._pools, per_rank)):
            pool.check_owned(pages, owner, "page", rank)
        for pool, pages in zip(self._pools, per_rank):
            pool.release(pages)

    @property
    def num_free_pages(self) -> int:
        """Free pages over all heads and ranks (in 1-D mode: free blocks x KV heads)."""
        if self.head_wise:
            return sum(pool.num_free for pool in self._pools)
        return self._pools[0].num_free * self.layout.num_kv_heads

    @property
    def num_total_pages(self) -> int:
        return self.num_gpu_blocks * self.layout.num_kv_heads

    @property
    def num_free_blocks(self) -> int:
        self._require_mode(False, "num_free_blocks")
        return self._pools[0].num_free

    def free_pages_per_head(self) -> list:
        """Free pages in each global KV head's home list (1-D mode: every head sees the free blocks)."""
        if not self.head_wise:
            return [self._pools[0].num_free] * self.layout.num_kv_heads
        return [len(free) for pool in self._pools for free in pool.free_lists]

    def free_pages_per_rank(self) -> list:
        if not self.head_wise:
            return [self._pools[0].num_free * self.heads_per_rank] * self.tensor_parallel_size
        return [pool.num_free for pool in self._pools]

    def pages_owned_by(self, req_id: Hashable) -> int:
        return sum(1 for pool in self._pools for holder in pool.owner if holder == req_id)

    def check_integrity(self) -> None:
        """Raise AssertionError unless every id is free in exactly its home list or owned, per rank."""
        for rank, pool in enumerate(self._pools):
            pool.check(f"rank {rank}" if self.head_wise else "1-D pool")

    def owners(self) -> list:
        """Per rank, the owner of every id (None = free); for cross-checks against block tables."""
        return [list(pool.owner) for pool in self._pools]

    # -- helpers -------------------------------------------------------------------------------
    def _require_mode(self, head_wise: bool, method: str) -> None:
        if head_wise != self.head_wise:
            mode = "head-wise (FD_HEAD_WISE_KV_CACHE=1)" if self.head_wise else "1-D (FD_HEAD_WISE_KV_CACHE=0)"
            raise ValueError(f"{method} called on a cache manager in {mode} mode")

    def _need_per_rank(self, num_blocks_per_head: Sequence[int], owner: Hashable) -> list:
        if len(num_blocks_per_head) != self.layout.num_kv_heads:
            raise ValueError(f"request {owner!r}: expected a page count for each of {self.layout.num_kv_heads} "
                             f"KV heads, got {len(num_blocks_per_head)}")
        need = [0] * self.tensor_parallel_size
        for h, n in enumerate(num_blocks_per_head):
            _check_count(n, owner)
            need[h // self.heads_per_rank] += n
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
