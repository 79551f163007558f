"""The prefix-cache trie (prefix_tree.py) driven through the real PrefixCacheManager.

test_prefix_caching_policy.py drives whole requests through the scheduler; here a small `Writer`
plays one request against the manager's own API, in the order ResourceManagerV1 uses it (take a
hit, allocate a chunk's pages, register each finished block, recycle the SWA head's dead blocks,
release), so tombstones, eviction order and the eviction heap can be set up exactly and observed.

Geometry: block 16, SWA head 0 with window 32 (two blocks) and a 16-token sink (block 0), full
heads 1..3. A query at n blocks sees the SWA head's block 0 and blocks [n - 2, n).
"""

import pytest

from fastdeploy.cache_manager.head_wise import first_window_block
from fastdeploy.cache_manager.prefix_cache_manager import PrefixCacheManager
from fastdeploy.cache_manager.prefix_tree import CACHED

BS, WINDOW, SINK_BLOCKS = 16, 32, 1
SWA = {"sliding_window": WINDOW, "sink_size": 16, "swa_kv_heads": [0]}


def chain(n, seed=0):
    """Token tuples of n consecutive full blocks; different seeds share no block."""
    return [tuple([seed * 1000 + i] * BS) for i in range(n)]


@pytest.fixture
def make_manager(make_config):
    def make(blocks, tensor_parallel_size=1):
        cfg = make_config("head_wise_recycle_on", num_gpu_blocks_override=blocks, enable_prefix_caching=True,
                          head_wise_swa_config=SWA, tensor_parallel_size=tensor_parallel_size)
        return PrefixCacheManager(cfg, tensor_parallel_size=tensor_parallel_size)

    return make


class Writer:
    """One request, using the manager the way the scheduler does; checks integrity after each call."""

    def __init__(self, cm, rid, keys, hit=()):
        self.cm, self.rid, self.keys = cm, rid, keys
        heads = cm.layout.num_slots
        self.rows = cm.acquire_prefix(hit, rid) if hit else [[] for _ in range(heads)]
        self.parent = hit[-1] if hit else cm.prefix_root
        self.done = len(hit)
        self.recycled_upto = max(SINK_BLOCKS, first_window_block(self.done * BS, WINDOW, BS))
        cm.check_integrity()

    def compute(self, n):
        """Compute the next n blocks as one chunk and register them (recycling is a separate step)."""
        new = self.cm.allocate_gpu_blocks_head_wise([n] * len(self.rows), self.rid)
        for row, pages in zip(self.rows, new):
            row.extend(pages)
        for i in range(self.done, self.done + n):
            if self.parent is None:
                break  # the chain above left the cache, as in ResourceManagerV1._register_blocks
            pages = [row[i] for row in self.rows]
            self.parent = self.cm.register_block(self.parent, self.keys[i], pages, self.rid)
        self.done += n
        self.cm.check_integrity()

    def recycle(self):
        """Return the SWA head's blocks that left the window (one release call = one LRU tick)."""
        end = max(self.recycled_upto, first_window_block(self.done * BS, WINDOW, BS))
        dead = self.rows[0][self.recycled_upto:end]
        self.cm.free([dead], self.rid, slots=[0])
        self.rows[0][self.recycled_upto:end] = [-1] * len(dead)
        self.recycled_upto = end
        self.cm.check_integrity()

    def release(self):
        self.cm.recycle_gpu_blocks_head_wise([[p for p in row if p >= 0] for row in self.rows], self.rid)
        self.cm.check_integrity()


def swa_tombstones(cm, keys):
    """Depths along the cached chain of `keys` whose SWA page is a tombstone (walks the raw trie)."""
    node, out = cm.prefix_root, []
    for key in keys:
        node = node.children.get(key)
        if node is None:
            break
        if node.pages[0] < 0:
            out.append(node.depth)
    return out


def take_all_free_pages(cm, rid="filler"):
    """Hold every page on the free lists, so the next allocation must evict."""
    evictable = cm.prefix_cache_stats()["prefix_cache_evictable_pages"]
    free = cm.num_free_pages - evictable
    return cm.allocate_gpu_blocks_head_wise([free, 0, 0, 0], rid)


# -- tombstones ------------------------------------------------------------------------------------
def test_tombstoned_swa_pages_are_refilled_by_a_later_writer_and_the_deeper_hit_returns(make_manager):
    cm = make_manager(blocks=16)  # 64 pages
    a = Writer(cm, "a", chain(6))
    a.compute(6)
    a.release()  # 24 pages cached, all evictable; the leaf (block 5) protects SWA blocks 4 and 5

    # Pressure evicts the three stale SWA pages (blocks 1..3): tombstones in the middle of the chain.
    free = cm.num_free_pages - cm.prefix_cache_stats()["prefix_cache_evictable_pages"]
    filler = cm.allocate_gpu_blocks_head_wise([free + 3, 0, 0, 0], "filler")
    cm.check_integrity()
    cm.recycle_gpu_blocks_head_wise(filler, "filler")
    cm.check_integrity()
    assert swa_tombstones(cm, chain(6)) == [1, 2, 3]
    assert len(cm.match_prefix(chain(6))) == 6       # its own window and sink are intact
    # A prompt that diverges after block 3 would query at 4 blocks and see SWA blocks 2, 3: gone.
    b_keys = chain(4) + chain(2, seed=1)
    hit = cm.match_prefix(b_keys)
    assert len(hit) == 1

    b = Writer(cm, "b", b_keys, hit)
    b.compute(5)  # blocks 1..3 exist in the trie: only their tombstoned SWA slot takes b's page
    nodes = cm.match_prefix(chain(6))
    for i in (1, 2, 3):
        assert nodes[i].pages[0] == b.rows[0][i]
        assert cm.owners()[0][b.rows[0][i]] is CACHED
        assert cm.references(0, b.rows[0][i]) == {"b"}
        for h in (1, 2, 3):  # the cached copy was already there: b's own page stays private
            assert nodes[i].pages[h] != b.rows[h][i] and cm.owners()[0][b.rows[h][i]] == "b"
    assert swa_tombstones(cm, chain(6)) == []
    assert len(cm.match_prefix(chain(4) + chain(1, seed=7))) == 4  # the deeper hit is back
    assert len(cm.match_prefix(b_keys)) == 6
    assert len(cm.match_prefix(chain(6))) == 6

    b.recycle()  # b's refilled SWA pages fall out of its window: unreferenced but still cached
    b.release()
    c = Writer(cm, "c", chain(5), cm.match_prefix(chain(5)))  # sees SWA blocks 0, 3, 4: one refilled
    assert c.rows[0] == [nodes[0].pages[0], -1, -1, nodes[3].pages[0], nodes[4].pages[0]]
    c.release()
    cm.clear_prefix_cache()
    cm.check_integrity()
    assert cm.num_free_pages == cm.num_total_pages


# -- eviction order ----------------------------------------------------------------------------------
def test_stale_swa_pages_are_evicted_by_release_time_then_deepest_first(make_manager):
    cm = make_manager(blocks=16)
    a = Writer(cm, "a", chain(8))
    a.compute(6)
    a.recycle()   # SWA blocks 1, 2, 3 released together (one tick)
    a.compute(2)
    a.recycle()   # SWA blocks 4, 5 released later; blocks 6, 7 are the leaf's window
    depth_of = {n.pages[0]: n.depth for n in cm.match_prefix(chain(8))}
    assert cm.prefix_cache_stats()["prefix_cache_evictable_pages"] == 5
    take_all_free_pages(cm)

    order = []
    for i in range(5):
        page = cm.allocate_gpu_blocks_head_wise([1, 0, 0, 0], f"x{i}")[0][0]  # the page just evicted
        cm.check_integrity()
        order.append(depth_of[page])
    # Older release first; within one release, deeper first so the chain is eaten from its tail.
    assert order == [3, 2, 1, 5, 4]
    assert swa_tombstones(cm, chain(8)) == [1, 2, 3, 4, 5]
    # Everything left is referenced by the running request: nothing more can be evicted.
    with pytest.raises(ValueError, match="only 0 are free"):
        cm.allocate_gpu_blocks_head_wise([1, 0, 0, 0], "y")
    assert len(cm.match_prefix(chain(8))) == 8



def test_a_system_prompts_branch_point_keeps_its_window_after_the_older_conversation_left(make_manager):
    """One conversation at a time on a system prompt (blocks 0..3): by the time the third arrives, the
    first one's tail has been evicted, and the system prompt's end is no longer a branch point in the
    trie today. It stays an anchor, so its SWA window is evicted after whole leaves, not first, and
    the third conversation resumes at the system prompt's end instead of at its sink."""
    cm = make_manager(blocks=12)
    system = chain(4)
    a = Writer(cm, "a", system + chain(3, seed=1))
    a.compute(7)
    a.recycle()
    a.release()
    b_keys = system + chain(3, seed=2)
    b = Writer(cm, "b", b_keys, cm.match_prefix(b_keys))
    assert b.done == 4
    b.compute(3)
    b.recycle()
    b.release()

    end_of_system = cm.prefix_root
    for key in system:
        end_of_system = end_of_system.children[key]
    take_all_free_pages(cm)
    held = 0
    while len(end_of_system.children) > 1:  # pressure until a's tail has left the trie
        cm.allocate_gpu_blocks_head_wise([1, 0, 0, 0], f"p{held}")
        held += 1
    cm.allocate_gpu_blocks_head_wise([2, 0, 0, 0], "more")  # and two pages more
    cm.check_integrity()
    assert end_of_system.anchor and swa_tombstones(cm, system) == [1]
    assert len(cm.match_prefix(system + chain(3, seed=3))) == 4

# -- the lazy eviction heap ----------------------------------------------------------------------
def heap_bound(cache, rank=0):
    """The compaction threshold PrefixCache.evict() enforces."""
    return 4 * cache.num_evictable[rank] + 256


def cached_chain_with_hit_cycles(make_manager, cycles):
    """A 6-block chain, then `cycles` requests that each hit it and release (no eviction happens)."""
    cm = make_manager(blocks=32)
    a = Writer(cm, "a", chain(6))
    a.compute(6)
    a.release()
    keys = chain(6) + chain(1, seed=3)
    for i in range(cycles):
        hit = cm.match_prefix(keys)
        assert len(hit) == 6
        rows = cm.acquire_prefix(hit, f"r{i}")
        cm.recycle_gpu_blocks_head_wise([[p for p in row if p >= 0] for row in rows], f"r{i}")
    cm.check_integrity()  # every evictable page still has its current key in the heap
    return cm


def test_eviction_compacts_the_heap_after_many_hit_cycles(make_manager):
    cm = cached_chain_with_hit_cycles(make_manager, 300)
    cache = cm.prefix_cache
    take_all_free_pages(cm)
    cm.allocate_gpu_blocks_head_wise([1, 0, 0, 0], "x")
    assert len(cache.heaps[0]) <= heap_bound(cache), "stale heap entries survived an eviction"
    cm.check_integrity()
    assert cache.num_evictable[0] == 23
    # The compacted heap still evicts in policy order. The hits never referenced SWA blocks 1..3
    # (dead for a query at 6 blocks), so those kept a's release tick, the oldest: deepest first.
    assert swa_tombstones(cm, chain(6)) == [3]
    cm.allocate_gpu_blocks_head_wise([2, 0, 0, 0], "y")
    cm.check_integrity()
    assert swa_tombstones(cm, chain(6)) == [1, 2, 3]


def test_hit_cycles_without_eviction_keep_the_heap_bounded(make_manager):
    cm = cached_chain_with_hit_cycles(make_manager, 300)
    cache = cm.prefix_cache
    assert len(cache.heaps[0]) <= heap_bound(cache)


# -- hits, registration parents, availability -------------------------------------------------------
def test_a_hit_pins_its_visible_pages_but_leaves_its_dead_swa_pages_evictable(make_manager):
    cm = make_manager(blocks=16)
    a = Writer(cm, "a", chain(8))
    a.compute(8)
    a.release()  # all 32 pages cached; none of the SWA pages recycled by a
    path = cm.match_prefix(chain(8) + chain(1, seed=2))
    assert len(path) == 8
    rows = cm.acquire_prefix(path, "b")
    cm.check_integrity()
    # A query at 8 blocks sees SWA block 0 (sink) and blocks 6, 7: blocks 1..5 are dead for it.
    assert rows[0] == [n.pages[0] if i in (0, 6, 7) else -1 for i, n in enumerate(path)]
    assert all(rows[h] == [n.pages[h] for n in path] for h in (1, 2, 3))
    dead = [path[i].pages[0] for i in range(1, 6)]
    assert all(cm.references(0, p) == frozenset() for p in dead)
    assert all(cm.references(0, p) == {"b"} for row in rows for p in row if p >= 0)
    assert cm.prefix_cache_stats()["prefix_cache_evictable_pages"] == 5

    take_all_free_pages(cm)
    got = cm.allocate_gpu_blocks_head_wise([5, 0, 0, 0], "x")[0]
    assert sorted(got) == sorted(dead)  # exactly the dead pages were reclaimable
    with pytest.raises(ValueError, match="only 0 are free"):
        cm.allocate_gpu_blocks_head_wise([1, 0, 0, 0], "y")
    assert all(cm.owners()[0][p] is CACHED for row in rows for p in row if p >= 0)
    cm.check_integrity()
    assert len(cm.match_prefix(chain(8))) == 8  # the tombstones are all outside the hit's view


def test_a_block_registered_under_an_evicted_parent_is_not_cached(make_manager):
    cm = make_manager(blocks=16)
    a = Writer(cm, "a", chain(3))
    a.compute(3)
    a.release()
    # b was admitted before a's blocks were cached, so it computes the same blocks privately: the
    # trie keeps a's copies and b's registration parent is a node b holds no reference to.
    b = Writer(cm, "b", chain(4))
    b.compute(2)
    assert all(cm.owners()[0][p] == "b" for row in b.rows for p in row)
    parent = b.parent
    assert parent is not None and parent.depth == 1
    assert cm.clear_prefix_cache() == 12  # a's pages, including b's registration parent, leave
    assert cm.prefix_cache_stats()["prefix_cache_cached_blocks"] == 0
    b.compute(2)
    assert b.parent is None
    assert cm.prefix_cache_stats()["prefix_cache_cached_blocks"] == 0  # nothing hangs off a detached node
    assert cm.prefix_cache_stats()["prefix_cache_cached_pages"] == 0
    assert cm.match_prefix(chain(4)) == []
    assert all(cm.owners()[0][p] == "b" for row in b.rows for p in row)
    b.release()
    assert cm.num_free_pages == cm.num_total_pages


def test_every_page_counted_as_available_can_be_allocated(make_manager):
    """Free + evictable is what the scheduler admits against: all of it must be obtainable, on every
    rank, whatever mix of classes, tombstones, branches and live references the trie holds."""
    cm = make_manager(blocks=24, tensor_parallel_size=2)  # heads 0, 1 on rank 0; 2, 3 on rank 1
    a = Writer(cm, "a", chain(10))
    for n in (4, 4, 2):
        a.compute(n)
        a.recycle()
    a.release()
    # 20 pages of a per rank are cached. Squeezing evicts rank 0's five oldest stale SWA pages
    # (blocks 1..5) and, on rank 1 (full heads only), both pages of the leaf: full-head tombstones.
    avail = cm.free_pages_per_rank()
    squeeze = cm.allocate_gpu_blocks_head_wise([avail[0] - 15, 0, avail[1] - 18, 0], "squeeze")
    cm.check_integrity()
    assert swa_tombstones(cm, chain(10)) == [1, 2, 3, 4, 5]
    path = cm.match_prefix(chain(10))  # stops before the leaf; a 9-block query sees SWA blocks 7, 8
    assert len(path) == 9 and path[-1].children[chain(10)[9]].pages[2:] == [-1, -1]
    cm.recycle_gpu_blocks_head_wise(squeeze, "squeeze")
    b_keys = chain(6) + chain(4, seed=1)
    b = Writer(cm, "b", b_keys, cm.match_prefix(b_keys[:9]))
    b.compute(len(b_keys) - b.done)
    b.recycle()  # b keeps running: its references pin part of the trie
    c_keys = chain(3) + chain(5, seed=2)
    c = Writer(cm, "c", c_keys, cm.match_prefix(c_keys[:7]))
    c.compute(len(c_keys) - c.done)
    c.recycle()
    c.release()

    avail = cm.free_pages_per_rank()
    assert cm.prefix_cache_stats()["prefix_cache_evictable_pages"] > 0
    cm.allocate_gpu_blocks_head_wise([avail[0], 0, avail[1], 0], "all")
    cm.check_integrity()
    assert cm.free_pages_per_rank() == [0, 0]
    assert not cm.can_allocate_gpu_blocks_head_wise([1, 0, 0, 0])
    assert not cm.can_allocate_gpu_blocks_head_wise([0, 0, 0, 1])
    held_cached = sum(1 for h, row in enumerate(b.rows) for p in row
                      if p >= 0 and cm.owners()[h // 2][p] is CACHED)
    assert cm.prefix_cache_stats()["prefix_cache_cached_pages"] == held_cached
