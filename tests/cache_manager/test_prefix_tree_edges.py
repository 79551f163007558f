"""Prefix-tree edges found by mutation testing: the cache version, partially recycled blocks, a hit
that loses its first block, registration misuse, and clearing every rank."""

import pytest

from fastdeploy.cache_manager.prefix_cache_manager import PrefixCacheManager
from fastdeploy.cache_manager.prefix_tree import CACHED

BS = 16
# Head 0 slides over a window longer than every chain here: each of its blocks stays visible.
LONG_WINDOW = {"sliding_window": 1000, "sink_size": 0, "swa_kv_heads": [0]}


def key(i):
    return tuple([500 + i] * BS)


def manager(make_config, tp=1, blocks=16):
    cfg = make_config("head_wise_recycle_on", num_gpu_blocks_override=blocks, enable_prefix_caching=True,
                      head_wise_swa_config=LONG_WINDOW, tensor_parallel_size=tp)
    return PrefixCacheManager(cfg, tensor_parallel_size=tp)


def cache_chain(cm, owner, n):
    rows = cm.allocate_gpu_blocks_head_wise([n] * 4, owner)
    parent = cm.prefix_root
    for i in range(n):
        parent = cm.register_block(parent, key(i), [row[i] for row in rows], owner)
    return rows


def test_every_change_a_lookup_could_see_gives_a_new_cache_version(make_config):
    cm = manager(make_config, blocks=4)
    cache = cm.prefix_cache
    versions = [cache.version]
    rows = cm.allocate_gpu_blocks_head_wise([1] * 4, "a")
    parent = cm.register_block(cm.prefix_root, key(0), [r[0] for r in rows], "a")
    versions.append(cache.version)
    more = cm.allocate_gpu_blocks_head_wise([1] * 4, "a")
    cm.register_block(parent, key(1), [r[0] for r in more], "a")
    versions.append(cache.version)
    cm.recycle_gpu_blocks_head_wise([r + m for r, m in zip(rows, more)], "a")
    cm.allocate_gpu_blocks_head_wise([9, 0, 0, 0], "b")  # 8 free pages: one cached page is evicted
    versions.append(cache.version)
    cm.allocate_gpu_blocks_head_wise([1, 0, 0, 0], "c")  # and one more
    versions.append(cache.version)
    assert len(set(versions)) == len(versions), versions
    cm.check_integrity()


def test_a_hit_whose_first_swa_block_is_gone_is_empty(make_config):
    cm = manager(make_config)
    rows = cache_chain(cm, "a", 3)
    cm.recycle_gpu_blocks_head_wise(rows, "a")
    node = cm.match_prefix([key(0)])[0]
    cache = cm.prefix_cache
    cache._evict_page(cache.slot_rank[0], node.pages[0], node, 0)  # the SWA page of block 0
    # With no sink and a window over everything, every query sees block 0: no hit is valid.
    assert cm.match_prefix([key(0), key(1), key(2)]) == []
    cm.check_integrity()


def test_a_block_registered_with_its_swa_page_already_recycled_caches_the_full_heads(make_config):
    cm = manager(make_config)
    rows = cm.allocate_gpu_blocks_head_wise([1] * 4, "a")
    pages = [-1] + [r[0] for r in rows[1:]]  # slot 0 (the SWA head) first, and already gone
    node = cm.register_block(cm.prefix_root, key(0), pages, "a")
    assert node is not None and node.pages == pages
    assert [cm.owners()[0][p] for p in pages[1:]] == [CACHED] * 3
    assert cm.owners()[0][rows[0][0]] == "a"  # the SWA page itself stays private
    cm.recycle_gpu_blocks_head_wise(rows, "a")
    cm.check_integrity()


def test_registering_a_page_the_request_does_not_own_privately_is_rejected(make_config):
    cm = manager(make_config)
    rows = cm.allocate_gpu_blocks_head_wise([1] * 4, "a")
    page = rows[2][0]
    with pytest.raises(ValueError) as info:
        cm.register_block(cm.prefix_root, key(0), [r[0] for r in rows], "b")
    assert str(info.value) == f"request 'b' registers page {rows[0][0]} (rank 0) it does not own privately"
    assert cm.owners()[0][page] == "a"


def test_clearing_the_cache_counts_the_pages_of_every_rank(make_config):
    cm = manager(make_config, tp=2)
    rows = cache_chain(cm, "a", 2)
    cm.recycle_gpu_blocks_head_wise(rows, "a")
    assert cm.prefix_cache_stats()["prefix_cache_evictable_pages"] == 8
    assert cm.clear_prefix_cache() == 8  # 2 blocks x 2 heads on each of 2 ranks
    assert cm.num_free_pages == cm.num_total_pages
    cm.check_integrity()


def test_heap_compaction_keeps_the_entries_of_pages_nobody_touches(make_config):
    # Chain X is cached and never used again: its heap entries are pushed once. Hit cycles on chain A
    # bloat the heap with stale entries until it is compacted: X's entries must survive that.
    cm = manager(make_config, blocks=32)
    x = cm.allocate_gpu_blocks_head_wise([2] * 4, "x")
    parent = cm.prefix_root
    for i in range(2):
        parent = cm.register_block(parent, tuple([900 + i] * BS), [row[i] for row in x], "x")
    cm.recycle_gpu_blocks_head_wise(x, "x")
    cm.recycle_gpu_blocks_head_wise(cache_chain(cm, "a", 4), "a")
    cache = cm.prefix_cache
    keys = [key(i) for i in range(4)] + [tuple([7] * BS)]
    longest = 0
    for i in range(200):
        rows = cm.acquire_prefix(cm.match_prefix(keys), f"r{i}")
        cm.recycle_gpu_blocks_head_wise([[p for p in row if p >= 0] for row in rows], f"r{i}")
        longest = max(longest, len(cache.heaps[0]))
    bound = 4 * cache.num_evictable[0] + 256
    assert 200 * 16 > bound >= longest  # pushes outnumber the bound: compaction did run
    cm.check_integrity()  # every evictable page, X's included, still has its current heap entry
    cached = [p for row in x for p in row] + [p for node in cm.match_prefix(keys) for p in node.pages]
    assert {entry[3] for entry in cache.heaps[0]} == set(cached)


@pytest.fixture
def branched(make_config):
    """Chains a (blocks 0, 1, 2) and b (block 0, then its own block), both released: node 0 is a
    branch point under two leaves, so with the long window three anchors protect it."""
    cm = manager(make_config)
    a = cache_chain(cm, "a", 3)
    b = cm.allocate_gpu_blocks_head_wise([1] * 4, "b")
    first = cm.match_prefix([key(0)])[0]
    cm.register_block(first, tuple([800] * BS), [row[0] for row in b], "b")
    cm.recycle_gpu_blocks_head_wise(a, "a")
    cm.recycle_gpu_blocks_head_wise(b, "b")
    cm.check_integrity()
    assert first.protect == 3 and len(first.children) == 2
    return cm, first


def broken(cm):
    with pytest.raises(AssertionError) as info:
        cm.check_integrity()
    return str(info.value)


def test_integrity_check_names_each_broken_trie_invariant(branched):
    cm, first = branched
    cache = cm.prefix_cache
    child = first.children[key(1)]
    child.key = tuple([801] * BS)  # only the key disagrees with the parent's index
    assert broken(cm) == f"{child!r} is linked wrongly under {first!r}"
    child.key = key(1)
    cache.num_nodes += 1
    assert broken(cm) == "trie has 4 nodes, counter says 5"
    cache.num_nodes -= 1
    leaf = child.children[key(2)]
    saved = list(leaf.pages)
    leaf.pages[:] = [-1] * len(saved)
    assert broken(cm) == f"{leaf!r}: an all-tombstone leaf was not removed"
    leaf.pages[:] = saved
    cm.check_integrity()


def test_integrity_check_names_each_broken_page_record(branched):
    cm, first = branched
    cache, pool = cm.prefix_cache, cm._pools[0]
    page = first.pages[1]
    cache.where[0][page] = (first.children[key(1)], 1)  # still owned by the cache, recorded elsewhere
    assert broken(cm) == f"page {page} (rank 0) of {first!r} is not recorded as cached there"
    cache.where[0][page] = (first, 1)
    saved = list(cache.heaps[0])
    cache.heaps[0] = [e for e in saved if e[3] != page]
    assert broken(cm) == f"evictable page {page} (rank 0) has no valid heap entry"
    cache.heaps[0] = saved
    first.anchor = False
    assert broken(cm) == f"{first!r}: anchor flag False, expected True"
    first.anchor = True
    free = pool.free_lists[3][0]
    cache.where[0][free] = (first, 3)  # recorded, but the trie does not reach it there
    assert broken(cm) == "rank 0: 17 cached pages recorded, 16 reachable in the trie"
    del cache.where[0][free]
    cache.evictable_per_home[0][0] += 1  # the per-home split only
    assert broken(cm) == "rank 0: 16 evictable pages, counters say 16 / [5, 4, 4, 4]"
    cache.evictable_per_home[0][0] -= 1
    pool.holders[free] = set()  # a reference set for a page the cache does not own
    assert broken(cm) == "rank 0: 16 pages owned by the cache, 17 reference sets, 16 in the trie"
    del pool.holders[free]
    cm.check_integrity()


# -- the eviction classes the lazy heap must keep current (heap-bookkeeping mutants) -------------------

def test_a_block_with_every_head_already_recycled_is_not_cached(make_config):
    # Every head slides: a block whose pages were all recycled before registration has nothing to
    # cache, and must not leave an all-tombstone node in the trie.
    cfg = make_config("head_wise_recycle_on", num_gpu_blocks_override=4, enable_prefix_caching=True,
                      head_wise_swa_config={"sliding_window": 1000, "sink_size": 0, "swa_kv_heads": [0, 1, 2, 3]})
    cm = PrefixCacheManager(cfg)
    version = cm.prefix_cache.version
    assert cm.register_block(cm.prefix_root, key(0), [-1] * 4, "a") is None
    assert cm.prefix_cache.num_nodes == 0 and cm.prefix_root.children == {}
    assert cm.prefix_cache.version == version  # nothing a lookup could see changed
    assert cm.match_prefix([key(0)]) == []
    cm.check_integrity()


def test_a_leaf_is_evicted_before_its_parent_even_when_the_parent_was_released_first(make_config):
    # Block 0 is released (tick 1) while block 1 is still in use, then block 1 (tick 2). LRU alone
    # would take block 0's page; the class order (whole leaf before interior block) takes block 1's.
    cm = manager(make_config, blocks=4)
    rows = cache_chain(cm, "a", 2)
    cm.recycle_gpu_blocks_head_wise([[row[0]] for row in rows], "a")
    cm.recycle_gpu_blocks_head_wise([[row[1]] for row in rows], "a")
    first, second = cm.match_prefix([key(0), key(1)])
    cm.allocate_gpu_blocks_head_wise([9, 0, 0, 0], "b")  # 8 free pages: exactly one cached page goes
    assert first.pages == [row[0] for row in rows]
    assert sorted(second.pages) == [-1] + sorted(row[1] for row in rows)[1:]
    cm.check_integrity()


def test_filling_a_tombstone_of_an_unreferenced_leaf_moves_its_other_pages_out_of_the_leaf_class(make_config):
    cm = manager(make_config, blocks=8)
    a = cache_chain(cm, "a", 1)
    cm.recycle_gpu_blocks_head_wise(a, "a")
    node = cm.match_prefix([key(0)])[0]
    cache = cm.prefix_cache
    cache._evict_page(cache.slot_rank[0], node.pages[0], node, 0)  # the SWA page: a tombstone
    b = cm.allocate_gpu_blocks_head_wise([1] * 4, "b")
    assert cm.register_block(cm.prefix_root, key(0), [row[0] for row in b], "b") is node
    assert node.pages[0] == b[0][0] and node.num_referenced == 1  # b's SWA page filled the tombstone
    # The full heads' pages are still unreferenced but no longer a whole unreferenced leaf.
    for s in (1, 2, 3):
        assert cache._key(0, node, s, node.pages[s])[0] == 2
    cm.check_integrity()  # each of them has a heap entry with that class
    cm.recycle_gpu_blocks_head_wise(b, "b")
    cm.check_integrity()


def test_an_unreferenced_leaf_that_gains_a_child_leaves_the_leaf_class(make_config):
    # Without recycling no anchor changes repush the node: only the child-count rule does. Request b
    # computed block 0 itself (its pages stay private: the cached block is complete), so the cached
    # node stays unreferenced while b registers block 1 under it.
    cfg = make_config("head_wise_recycle_off", num_gpu_blocks_override=8, enable_prefix_caching=True)
    cm = PrefixCacheManager(cfg)
    a = cache_chain(cm, "a", 1)
    cm.recycle_gpu_blocks_head_wise(a, "a")
    b = cm.allocate_gpu_blocks_head_wise([2] * 4, "b")
    node = cm.register_block(cm.prefix_root, key(0), [row[0] for row in b], "b")
    assert node is cm.match_prefix([key(0)])[0] and node.num_referenced == 0
    cm.register_block(node, key(1), [row[1] for row in b], "b")
    assert len(node.children) == 1
    cache = cm.prefix_cache
    assert {cache._key(0, node, s, p)[0] for s, p in enumerate(node.pages)} == {2}
    cm.check_integrity()  # the pages' entries were refreshed to the interior class
    cm.recycle_gpu_blocks_head_wise(b, "b")
    cm.check_integrity()
