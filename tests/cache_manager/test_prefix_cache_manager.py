"""PrefixCacheManager: 1-D and per-head free lists, borrowing, TP pools, misuse errors, integrity."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdeploy.cache_manager.prefix_cache_manager import PrefixCacheManager

SWA = {"sliding_window": 32, "sink_size": 0, "swa_kv_heads": [0]}


@pytest.fixture
def one_d(make_config):
    return PrefixCacheManager(make_config("1d", num_gpu_blocks_override=10))


@pytest.fixture
def head_wise(make_config):
    return PrefixCacheManager(make_config("head_wise_recycle_on", num_gpu_blocks_override=10,
                                          head_wise_swa_config=SWA))


def test_1d_allocates_lowest_block_ids_first(one_d):
    assert one_d.allocate_gpu_blocks(3, "a") == [0, 1, 2]
    one_d.recycle_gpu_blocks([1], "a")
    assert one_d.allocate_gpu_blocks(2, "b") == [1, 3]
    assert one_d.can_allocate_gpu_blocks(6) and not one_d.can_allocate_gpu_blocks(7)
    one_d.check_integrity()


def test_1d_double_free_names_block_and_request(one_d):
    blocks = one_d.allocate_gpu_blocks(2, "req-1")
    one_d.recycle_gpu_blocks(blocks, "req-1")
    with pytest.raises(ValueError, match=r"double free: block 0 .*'req-1'"):
        one_d.recycle_gpu_blocks([0], "req-1")


def test_1d_freeing_another_requests_block_is_rejected(one_d):
    one_d.allocate_gpu_blocks(2, "owner")
    with pytest.raises(ValueError, match=r"block 1 freed by request 'thief' belongs to request 'owner'"):
        one_d.recycle_gpu_blocks([1], "thief")
    with pytest.raises(ValueError, match="not a valid id"):
        one_d.recycle_gpu_blocks([99], "owner")
    with pytest.raises(ValueError, match="appears twice"):
        one_d.recycle_gpu_blocks([0, 0], "owner")
    one_d.check_integrity()


def test_1d_over_allocation_and_bad_counts_raise(one_d):
    with pytest.raises(ValueError, match="only 10 are free"):
        one_d.allocate_gpu_blocks(11, "big")
    with pytest.raises(ValueError, match="non-negative integer"):
        one_d.allocate_gpu_blocks(-1, "neg")
    assert one_d.num_free_blocks == 10


def test_wrong_mode_calls_raise(one_d, head_wise):
    with pytest.raises(ValueError, match="1-D"):
        one_d.allocate_gpu_blocks_head_wise([1, 1, 1, 1], "x")
    with pytest.raises(ValueError, match="head-wise"):
        head_wise.allocate_gpu_blocks(1, "x")
    with pytest.raises(ValueError, match="head-wise"):
        head_wise.recycle_gpu_blocks([0], "x")


def test_head_wise_allocates_from_home_lists(head_wise):
    pages = head_wise.allocate_gpu_blocks_head_wise([2, 2, 2, 2], "a")
    assert pages == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert all(p % 4 == h for h, row in enumerate(pages) for p in row)
    assert head_wise.num_free_pages == 32
    assert head_wise.free_pages_per_head() == [8, 8, 8, 8]


def test_head_wise_with_recycle_off_addresses_the_same_bytes_as_1d(make_config):
    """Lock-step per-head allocation gives head h page b*H + h for the 1-D block b."""
    cfg_1d = make_config("1d", num_gpu_blocks_override=12)
    cfg_hw = make_config("head_wise_recycle_off", num_gpu_blocks_override=12, head_wise_swa_config=SWA)
    one, hw = PrefixCacheManager(cfg_1d), PrefixCacheManager(cfg_hw)
    rng = random.Random(0)
    held = {}
    for step in range(200):
        rid = f"r{rng.randrange(6)}"
        if rid in held and rng.random() < 0.4:
            blocks, pages = held.pop(rid)
            one.recycle_gpu_blocks(blocks, rid)
            hw.recycle_gpu_blocks_head_wise(pages, rid)
            continue
        n = rng.randrange(1, 4)
        if not one.can_allocate_gpu_blocks(n):
            continue
        blocks = one.allocate_gpu_blocks(n, rid)
        pages = hw.allocate_gpu_blocks_head_wise([n] * 4, rid)
        assert pages == [[b * 4 + h for b in blocks] for h in range(4)]
        old_b, old_p = held.get(rid, ([], [[], [], [], []]))
        held[rid] = (old_b + blocks, [o + p for o, p in zip(old_p, pages)])
    one.check_integrity()
    hw.check_integrity()


def test_empty_home_list_borrows_from_the_fullest_other_list(head_wise):
    head_wise.allocate_gpu_blocks_head_wise([10, 0, 0, 0], "a")  # head 0's list is now empty
    head_wise.allocate_gpu_blocks_head_wise([0, 0, 4, 0], "b")   # list 2 has 6 left, lists 1 and 3 have 10
    borrowed = head_wise.allocate_gpu_blocks_head_wise([3, 0, 0, 0], "c")[0]
    # Fullest first, ties to the lower head: list 1 (10), then list 3 (10 vs 9), then list 1 (9 vs 9).
    assert [p % 4 for p in borrowed] == [1, 3, 1]
    head_wise.check_integrity()
    # A borrowed page goes back to its own home list, not the borrower's.
    head_wise.recycle_gpu_blocks_head_wise([borrowed, [], [], []], "c")
    assert head_wise.free_pages_per_head()[0] == 0
    head_wise.check_integrity()


def test_head_wise_over_allocation_is_all_or_nothing(head_wise):
    with pytest.raises(ValueError, match="only 40 are free"):
        head_wise.allocate_gpu_blocks_head_wise([20, 20, 1, 0], "greedy")
    assert head_wise.num_free_pages == 40
    assert not head_wise.can_allocate_gpu_blocks_head_wise([20, 20, 1, 0])
    assert head_wise.can_allocate_gpu_blocks_head_wise([40, 0, 0, 0])


def test_head_wise_bad_recycle_changes_nothing(head_wise):
    pages = head_wise.allocate_gpu_blocks_head_wise([1, 1, 1, 1], "a")
    with pytest.raises(ValueError, match="already free"):
        head_wise.recycle_gpu_blocks_head_wise([[pages[0][0], 8], [], [], []], "a")
    assert head_wise.num_free_pages == 36  # the valid page in the bad call was not freed either
    with pytest.raises(ValueError, match="belongs to request 'a'"):
        head_wise.recycle_gpu_blocks_head_wise([pages[0], [], [], []], "b")
    with pytest.raises(ValueError, match="4 KV heads"):
        head_wise.recycle_gpu_blocks_head_wise([pages[0]], "a")
    head_wise.recycle_gpu_blocks_head_wise(pages, "a")
    assert head_wise.num_free_pages == 40
    head_wise.check_integrity()


def test_tensor_parallel_ranks_have_their_own_pools(make_config):
    cfg = make_config("head_wise_recycle_on", num_gpu_blocks_override=4, tensor_parallel_size=2,
                      head_wise_swa_config=SWA)
    cm = PrefixCacheManager(cfg, tensor_parallel_size=2)
    assert cm.free_pages_per_rank() == [8, 8]
    pages = cm.allocate_gpu_blocks_head_wise([8, 0, 1, 0], "a")  # rank 0 fully used by head 0 (borrowing)
    assert sorted(pages[0]) == list(range(8)) and pages[2] == [0]  # rank-local ids
    assert cm.free_pages_per_rank() == [0, 7]
    # Head 1 lives on rank 0 and may not borrow from rank 1.
    assert not cm.can_allocate_gpu_blocks_head_wise([0, 1, 0, 0])
    with pytest.raises(ValueError, match="on rank 0"):
        cm.allocate_gpu_blocks_head_wise([0, 1, 0, 0], "b")
    cm.recycle_gpu_blocks_head_wise(pages, "a")
    cm.check_integrity()
    assert cm.num_free_pages == 16


def test_tensor_parallel_size_must_match_config(make_config):
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        PrefixCacheManager(make_config("1d", num_gpu_blocks_override=4), tensor_parallel_size=2)


def test_check_integrity_catches_each_kind_of_corruption(head_wise):
    head_wise.allocate_gpu_blocks_head_wise([1, 1, 1, 1], "a")
    pool = head_wise._pools[0]
    pool.free_lists[1].append(pool.free_lists[1][0])  # listed twice
    with pytest.raises(AssertionError, match="listed 2 times"):
        head_wise.check_integrity()
    pool.free_lists[1].pop()
    pool.free_lists[2].append(0)  # owned page also free, in the wrong list
    with pytest.raises(AssertionError):
        head_wise.check_integrity()
    pool.free_lists[2].pop()
    pool.owner[0] = None  # neither owned nor free
    with pytest.raises(AssertionError, match="listed 0 times"):
        head_wise.check_integrity()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.lists(st.integers(0, 6), min_size=4, max_size=4),
                          st.booleans()), max_size=40))
def test_random_alloc_free_sequences_keep_integrity_and_free_all_at_end(ops):
    from fastdeploy.config import CacheConfig, FDConfig, ModelConfig, ParallelConfig, SchedulerConfig

    cfg = FDConfig(model_config=ModelConfig.create(None, 512, SWA), cache_config=CacheConfig(
        block_size=16, num_gpu_blocks_override=6), scheduler_config=SchedulerConfig(),
        parallel_config=ParallelConfig(2), head_wise_kv_cache=True)
    cm = PrefixCacheManager(cfg, tensor_parallel_size=2)
    held = {}
    for rid, counts, free_half in ops:
        rid = f"r{rid}"
        if rid in held and free_half:
            rows = held[rid]
            give = [row[: len(row) // 2] for row in rows]
            held[rid] = [row[len(row) // 2:] for row in rows]
            cm.recycle_gpu_blocks_head_wise(give, rid)
        elif cm.can_allocate_gpu_blocks_head_wise(counts):
            got = cm.allocate_gpu_blocks_head_wise(counts, rid)
            held[rid] = [a + b for a, b in zip(held.get(rid, [[]] * 4), got)]
        cm.check_integrity()
    for rid, rows in held.items():
        cm.recycle_gpu_blocks_head_wise(rows, rid)
    cm.check_integrity()
    assert cm.num_free_pages == cm.num_total_pages
