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
