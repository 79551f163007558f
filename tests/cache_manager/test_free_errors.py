"""A free call that is wrong anywhere fails as a whole: ValueError naming the page and the request,
and no reference, owner or free count changed — even when the bad page comes after good ones, or
sits on another tensor-parallel rank, or is a cached page the request does not reference."""

import pytest

from fastdeploy.cache_manager.prefix_cache_manager import PrefixCacheManager

BS = 16
SWA = {"sliding_window": 32, "sink_size": 16, "swa_kv_heads": [0]}


def key(i):
    return tuple([1000 + i] * BS)


def manager(make_config, mode, tp=1, blocks=16):
    cfg = make_config(mode, num_gpu_blocks_override=blocks, enable_prefix_caching=True,
                      head_wise_swa_config=SWA, tensor_parallel_size=tp)
    return PrefixCacheManager(cfg, tensor_parallel_size=tp)


def snapshot(cm):
    """Everything a free may change, read through the manager's public surface."""
    refs = [[cm.references(rank, p) for p in range(len(owners))] for rank, owners in enumerate(cm.owners())]
    return cm.owners(), refs, cm.num_free_pages, cm.free_pages_per_head(), cm.prefix_cache_stats()


def cache_chain(cm, owner, n):
    """`owner` computes n blocks and registers them all; returns its rows (one list per slot)."""
    head_wise = cm.head_wise
    if head_wise:
        rows = cm.allocate_gpu_blocks_head_wise([n] * cm.layout.num_slots, owner)
    else:
        rows = [cm.allocate_gpu_blocks(n, owner)]
    parent = cm.prefix_root
    for i in range(n):
        parent = cm.register_block(parent, key(i), [row[i] for row in rows], owner)
    cm.check_integrity()
    return rows


def free(cm, rows, owner):
    if cm.head_wise:
        cm.recycle_gpu_blocks_head_wise(rows, owner)
    else:
        cm.recycle_gpu_blocks(rows[0], owner)


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_on"])
def test_freeing_a_cached_page_the_request_does_not_reference_changes_nothing(make_config, mode):
    cm = manager(make_config, mode)
    a_rows = cache_chain(cm, "a", 3)
    hit = cm.match_prefix([key(0), key(1)])
    assert len(hit) == 2
    b_rows = cm.acquire_prefix(hit, "b")  # b references the cached blocks 0 and 1, not block 2
    own = cm.allocate_gpu_blocks_head_wise([1] * cm.layout.num_slots, "b") if cm.head_wise \
        else [cm.allocate_gpu_blocks(1, "b")]
    before = snapshot(cm)
    # Valid pages first (b's references to blocks 0 and 1, its private page), then a's block 2.
    bad = [[p for p in row if p >= 0] + mine + [a_row[2]] for row, mine, a_row in zip(b_rows, own, a_rows)]
    what = r"page \(rank 0\)" if cm.head_wise else "block"
    with pytest.raises(ValueError, match=rf"^{what} {a_rows[0][2]} freed by request 'b' is cached and not referenced "
                                         rf"by that request$"):
        free(cm, bad, "b")
    assert snapshot(cm) == before
    cm.check_integrity()
    assert "b" in cm.references(0, b_rows[0][0])
    # The correct free still works afterwards and leaves a's chain cached.
    free(cm, [[p for p in row if p >= 0] + mine for row, mine in zip(b_rows, own)], "b")
    free(cm, a_rows, "a")
    cm.check_integrity()
    assert cm.num_free_pages == cm.num_total_pages
    assert len(cm.match_prefix([key(0), key(1), key(2)])) == 3


@pytest.mark.parametrize("bad_kind", ["cached_not_referenced", "double_free", "foreign"])
def test_a_bad_page_on_one_rank_frees_nothing_on_the_other(make_config, bad_kind):
    cm = manager(make_config, "head_wise_recycle_on", tp=2)
    heads = cm.layout.num_slots
    a_rows = cache_chain(cm, "a", 2)
    b_rows = cm.acquire_prefix(cm.match_prefix([key(0)]), "b")
    b_own = cm.allocate_gpu_blocks_head_wise([1] * heads, "b")
    c_own = cm.allocate_gpu_blocks_head_wise([1] * heads, "c")
    rows = [[p for p in row if p >= 0] + mine for row, mine in zip(b_rows, b_own)]
    last = heads - 1  # a head on rank 1: rank 0's pages come first in the call
    if bad_kind == "cached_not_referenced":
        rows[last].append(a_rows[last][1])
    elif bad_kind == "double_free":
        cm.free([[b_own[last][0]]], "b", slots=[last])
    else:
        rows[last].append(c_own[last][0])
    before = snapshot(cm)
    with pytest.raises(ValueError, match=r"rank 1\).*request 'b'"):
        cm.recycle_gpu_blocks_head_wise(rows, "b")
    assert snapshot(cm) == before
    cm.check_integrity()
