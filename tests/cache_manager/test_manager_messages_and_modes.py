"""PrefixCacheManager: the exact misuse messages (they name the id, the request, the rank and the
call), integrity messages, and the manager without a prefix cache, in 1-D and head-wise mode."""

import pytest

from fastdeploy.cache_manager.prefix_cache_manager import PrefixCacheManager

SWA = {"sliding_window": 32, "sink_size": 0, "swa_kv_heads": [0]}
BS = 16


def manager(make_config, mode, blocks=10, tp=1, prefix_caching=True):
    cfg = make_config(mode, num_gpu_blocks_override=blocks, head_wise_swa_config=SWA, tensor_parallel_size=tp,
                      enable_prefix_caching=prefix_caching)
    return PrefixCacheManager(cfg, tensor_parallel_size=tp)


def message(call):
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


# -- misuse messages --------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_1d_misuse_messages(make_config, prefix_caching):
    cm = manager(make_config, "1d", prefix_caching=prefix_caching)
    cm.allocate_gpu_blocks(2, "a")
    assert message(lambda: cm.recycle_gpu_blocks([1, 0, 0], "a")) == \
        "block 0 appears twice in one free call of request 'a'"
    assert message(lambda: cm.recycle_gpu_blocks([10], "a")) == \
        "block 10 freed by request 'a' is not a valid id (0..9)"
    assert message(lambda: cm.recycle_gpu_blocks(["x"], "a")) == \
        "block 'x' freed by request 'a' is not a valid id (0..9)"
    assert message(lambda: cm.recycle_gpu_blocks([True], "a")) == \
        "block True freed by request 'a' is not a valid id (0..9)"
    assert message(lambda: cm.recycle_gpu_blocks([5])) == \
        "double free: block 5 freed by request '<no request>' is already free"
    assert message(lambda: cm.recycle_gpu_blocks([1], "b")) == "block 1 freed by request 'b' belongs to request 'a'"
    assert message(lambda: cm.allocate_gpu_blocks(9, "b")) == "request 'b' asked for 9 blocks but only 8 are free"
    assert message(lambda: cm.allocate_gpu_blocks(1.5, "b")) == \
        "request 'b': block count must be a non-negative integer, got 1.5"
    assert message(lambda: cm.allocate_gpu_blocks(True, "b")) == \
        "request 'b': block count must be a non-negative integer, got True"
    assert message(lambda: cm.allocate_gpu_blocks_head_wise([1] * 4, "b")) == \
        "allocate_gpu_blocks_head_wise called on a cache manager in 1-D (FD_HEAD_WISE_KV_CACHE=0) mode"
    for method, args in [("can_allocate_gpu_blocks_head_wise", ([1] * 4,)),
                         ("recycle_gpu_blocks_head_wise", ([[]] * 4,))]:
        assert message(lambda: getattr(cm, method)(*args)) == \
            f"{method} called on a cache manager in 1-D (FD_HEAD_WISE_KV_CACHE=0) mode"
    cm.recycle_gpu_blocks([0, 1], "a")
    cm.check_integrity()


def test_head_wise_misuse_messages_name_the_rank_and_the_request(make_config):
    cm = manager(make_config, "head_wise_recycle_on", tp=2)  # 20 pages per rank, 2 heads per rank
    rows = cm.allocate_gpu_blocks_head_wise([1, 1, 1, 1], "a")
    assert rows == [[0], [1], [0], [1]]  # rank-local ids: heads 2 and 3 are rank 1's slots 0 and 1
    for method, args in [("allocate_gpu_blocks", (1,)), ("can_allocate_gpu_blocks", (1,)),
                         ("recycle_gpu_blocks", ([0],))]:
        assert message(lambda: getattr(cm, method)(*args)) == \
            f"{method} called on a cache manager in head-wise (FD_HEAD_WISE_KV_CACHE=1) mode"
    assert message(lambda: cm.recycle_gpu_blocks_head_wise([[0], [], [5], []], "a")) == \
        "double free: page (rank 1) 5 freed by request 'a' is already free"
    assert message(lambda: cm.recycle_gpu_blocks_head_wise([[], [], [0], [0]], "a")) == \
        "page (rank 1) 0 appears twice in one free call of request 'a'"
    assert message(lambda: cm.recycle_gpu_blocks_head_wise([[20], [], [], []], "a")) == \
        "page (rank 0) 20 freed by request 'a' is not a valid id (0..19)"
    assert message(lambda: cm.recycle_gpu_blocks_head_wise([[0]], "a")) == \
        "request 'a': expected pages for 4 KV heads, got 1"
    assert message(lambda: cm.allocate_gpu_blocks_head_wise([1, 1], "b")) == \
        "request 'b': expected a page count for each of 4 KV heads, got 2"
    assert message(lambda: cm.can_allocate_gpu_blocks_head_wise([1, 1])) == \
        "request '<no request>': expected a page count for each of 4 KV heads, got 2"
    assert message(lambda: cm.allocate_gpu_blocks_head_wise([1, 1, 1, -1], "b")) == \
        "request 'b': block count must be a non-negative integer, got -1"
    # Rank 0 has exactly the 18 it is asked for; rank 1 is one short: the message names rank 1.
    assert message(lambda: cm.allocate_gpu_blocks_head_wise([9, 9, 10, 9], "b")) == \
        "request 'b' asked for 19 pages on rank 1 but only 18 are free"
    assert not cm.can_allocate_gpu_blocks_head_wise([9, 9, 10, 9])
    assert cm.can_allocate_gpu_blocks_head_wise([9, 9, 9, 9])
    cm.recycle_gpu_blocks_head_wise(rows, "a")
    cm.check_integrity()


def test_single_pool_messages_name_rank_0(make_config):
    cm = manager(make_config, "head_wise_recycle_on")
    cm.allocate_gpu_blocks_head_wise([1, 1, 1, 1], "a")
    assert message(lambda: cm.free([[0], [9]], "a", slots=[0, 1])) == \
        "double free: page (rank 0) 9 freed by request 'a' is already free"
    assert message(lambda: cm.recycle_gpu_blocks_head_wise([[0], [1], [2], [0]], "a")) == \
        "page (rank 0) 0 appears twice in one free call of request 'a'"


# -- integrity messages -----------------------------------------------------------------------------
@pytest.mark.parametrize("mode,label", [("1d", "1-D pool"), ("head_wise_recycle_on", "rank 0")])
def test_integrity_messages_name_the_pool_and_the_broken_invariant(make_config, mode, label):
    cm = manager(make_config, mode, prefix_caching=False)
    pool = cm._pools[0]
    n = pool.num_lists

    def broken():
        with pytest.raises(AssertionError) as info:
            cm.check_integrity()
        return str(info.value)

    pool.free_lists[0].append(pool.free_lists[0][0])
    assert broken() == f"{label}: free id 0 is listed 2 times"
    pool.free_lists[0].pop()
    if n > 1:
        pool.free_lists[1].append(pool.free_lists[0][1])  # id 4 into head 1's list
        assert broken() == f"{label}: id 4 sits in free list 1, its home is 0"
        pool.free_lists[1].pop()
    pool.num_free -= 1
    assert broken() == f"{label}: free count {pool.num_free} but {pool.num_free + 1} ids are listed"
    pool.num_free += 1
    taken = pool.take(0, 1, "a")[0]
    pool.owner[taken] = None  # neither owned nor free
    assert broken() == f"{label}: free id {taken} is listed 0 times"
    pool.owner[taken] = "a"
    pool.free_lists[0].append(taken)
    pool.num_free += 1
    assert broken() == f"{label}: id {taken} is owned by 'a' and also free"


# -- no prefix cache ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_on"])
def test_without_a_prefix_cache_every_page_is_free_or_private(make_config, mode):
    cm = manager(make_config, mode, blocks=6, prefix_caching=False)
    assert cm.prefix_cache is None and cm.prefix_root is None
    assert cm.match_prefix([tuple(range(BS))]) == [] and cm.clear_prefix_cache() == 0
    assert cm.prefix_cache_stats() == {"prefix_cache_cached_pages": 0, "prefix_cache_evictable_pages": 0,
                                       "prefix_cache_evictions_total": 0, "prefix_cache_cached_blocks": 0}
    assert cm.free_pages_per_head() == [6, 6, 6, 6] and cm.free_pages_per_rank() == [24]
    if mode == "1d":
        taken = cm.allocate_gpu_blocks(6, "a")  # exactly every block: nothing to evict, nothing short
        assert cm.free_pages_per_rank() == [0] and cm.num_free_blocks == 0
        cm.recycle_gpu_blocks(taken, "a")
    else:
        rows = cm.allocate_gpu_blocks_head_wise([6, 6, 6, 6], "a")
        assert cm.free_pages_per_head() == [0, 0, 0, 0]
        cm.free([rows[1], rows[2]], "a", slots=[1, 2])  # two heads' rows in one call
        assert cm.free_pages_per_head() == [0, 6, 6, 0]
        cm.recycle_gpu_blocks_head_wise([rows[0], [], [], rows[3]], "a")
    assert cm.num_free_pages == cm.num_total_pages == 24
    cm.check_integrity()


def test_1d_free_pages_per_rank_repeats_the_shared_blocks_for_every_rank(make_config):
    cm = manager(make_config, "1d", blocks=6, tp=2)
    cm.allocate_gpu_blocks(2, "a")
    # One block id space serves both ranks; each rank holds 2 heads of every block.
    assert cm.free_pages_per_rank() == [8, 8]
    assert cm.free_pages_per_head() == [4, 4, 4, 4]


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_on"])
def test_evictable_cached_pages_count_as_free_per_head_and_in_stats(make_config, mode):
    # Stats count pages in both modes: a cached 1-D block is one page per KV head.
    cm = manager(make_config, mode, blocks=6)
    head_wise = cm.head_wise
    rows = cm.allocate_gpu_blocks_head_wise([2] * 4, "a") if head_wise else [cm.allocate_gpu_blocks(2, "a")]
    parent = cm.prefix_root
    for i in range(2):
        parent = cm.register_block(parent, tuple([i] * BS), [row[i] for row in rows], "a")
    assert cm.free_pages_per_head() == [4, 4, 4, 4]
    assert cm.prefix_cache_stats() == {"prefix_cache_cached_pages": 2 * 4, "prefix_cache_evictable_pages": 0,
                                       "prefix_cache_evictions_total": 0, "prefix_cache_cached_blocks": 2}
    if head_wise:
        cm.recycle_gpu_blocks_head_wise(rows, "a")
    else:
        cm.recycle_gpu_blocks(rows[0], "a")
    assert cm.free_pages_per_head() == [6, 6, 6, 6]  # 4 free + 2 cached, evictable
    assert cm.prefix_cache_stats()["prefix_cache_evictable_pages"] == 2 * 4
    # Taking every page evicts the cached ones: 2 blocks' pages, counted per page.
    if head_wise:
        cm.allocate_gpu_blocks_head_wise([6] * 4, "b")
    else:
        cm.allocate_gpu_blocks(6, "b")
    assert cm.prefix_cache_stats() == {"prefix_cache_cached_pages": 0, "prefix_cache_evictable_pages": 0,
                                       "prefix_cache_evictions_total": 2 * 4, "prefix_cache_cached_blocks": 0}
    cm.check_integrity()
