"""What the host tier below the prefix cache stores, lets go and loads (cache_manager/host_tier.py).

The pool's "KV" here is a numpy array with one int64 per page, so the tier copies real bytes.
"""

import numpy as np
import pytest

from fastdeploy.cache_manager.host_tier import HostTier
from fastdeploy.cache_manager.prefix_tree import STALE_SWA
from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

SWA = {"sliding_window": 13, "sink_size": 3, "swa_kv_heads": [0, 3]}
BS = 8


def scheduler(make_config, mode="head_wise_recycle_on", entries=400, blocks=40):
    rm = ResourceManagerV1(make_config(mode, num_gpu_blocks_override=blocks, block_size=BS, max_num_batched_tokens=40,
                                       max_num_seqs=4, max_model_len=256, head_wise_swa_config=SWA))
    kv = rm.kv_cache_manager
    pool = np.arange(kv.pages_per_rank // kv.pages_per_entry, dtype=np.int64)[:, None] * 1000
    tier = HostTier(entries, [pool.view(np.uint8)])
    rm.cache_manager.attach_host_tier(tier)
    return rm, pool, tier


def run(rm, rid, prompt, max_tokens=1):
    rm.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=2))
    while rm.has_unfinished_requests():
        batch = rm.schedule()
        rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
    rm.check_integrity()


def keys(prompt):
    return [tuple(prompt[i * BS:(i + 1) * BS]) for i in range((len(prompt) - 1) // BS)]


def load_and_end(rm, hit):
    """A hit's load, run to its end as the scheduler would: wait for the loader's thread, then end it."""
    hit, from_tiers, load = rm.kv_cache_manager.load_prefix(Request("b", NEXT_TURN, SamplingParams(max_tokens=1)),
                                                            hit)
    if load is not None:
        assert rm.kv_cache_manager.finished_loads(wait=30) == [load]
        rm.kv_cache_manager.end_load(load)
    return hit, from_tiers


PROMPT = [11 + (i * 7) % 50 for i in range(80)]  # ten blocks
NEXT_TURN = PROMPT + [9] + [4] * 8  # the next turn: the prompt, its answer (9) and a new message


def test_an_evicted_page_a_hit_can_read_is_stored_and_a_stale_sliding_page_is_not(make_config):
    rm, pool, tier = scheduler(make_config)
    run(rm, "a", PROMPT)
    cache = rm.cache_manager.prefix_cache
    cached = {p: node_slot for p, node_slot in cache.where[0].items()}
    stale = {p for p, (node, s) in cached.items() if cache._key(0, node, s, p)[0] == STALE_SWA}
    assert stale and len(stale) < len(cached)  # the sliding heads' pages outside the leaf's window
    cache.evict(0, cache.num_evictable[0])
    rm.check_integrity()
    assert tier.num_held == len(cached) - len(stale)
    for p, (node, s) in cached.items():
        held = node.host is not None and node.host[s] >= 0
        assert held == (p not in stale)
        if held:  # the entry holds the page's bytes
            assert pool.view(np.uint8).shape[1] == tier.entry_bytes
            assert tier.data[node.host[s]].view(np.int64)[0] == p * 1000
    # What is stored is what a hit at the anchor (the conversation's end) reads: the next turn's hit is
    # whole across the tiers, and nothing in the pool alone.
    assert len(cache.match(keys(NEXT_TURN), tiers=True)) == 10
    assert cache.match(keys(NEXT_TURN)) == []


def test_a_hit_on_stored_pages_copies_them_back_into_the_pool(make_config):
    rm, pool, tier = scheduler(make_config)
    run(rm, "a", PROMPT)
    cache = rm.cache_manager.prefix_cache
    before = {(node.depth, s): int(pool[p, 0]) for p, (node, s) in cache.where[0].items()}
    cache.evict(0, cache.num_evictable[0])
    pool[:] = -1  # the pages are reused: their old KV is gone from the pool
    hit = load_and_end(rm, cache.match(keys(NEXT_TURN), tiers=True))
    assert hit == (cache.match(keys(NEXT_TURN)), 10 * BS)  # now a hit in the pool alone
    rm.check_integrity()
    assert tier.loaded_total == tier.stored_total and tier.num_held == 0 and tier.loads_total == 1
    for p, (node, s) in cache.where[0].items():  # every page holds its block's KV again
        assert pool[p, 0] == before[(node.depth, s)]


def test_a_full_tier_lets_its_oldest_entry_go_and_a_node_left_with_nothing_leaves_the_trie(make_config):
    rm, pool, tier = scheduler(make_config, mode="1d", entries=4)
    run(rm, "a", PROMPT)
    cache = rm.cache_manager.prefix_cache
    nodes = cache.num_nodes
    cache.evict(0, cache.num_evictable[0])  # ten blocks into four entries: the six evicted first are gone
    rm.check_integrity()
    assert tier.num_held == 4 and tier.evicted_total == nodes - 4
    assert cache.num_nodes == 4 and cache.num_cached_pages == 0
    # Blocks go deepest first, so the four kept are the chain's head: a hit on them is still whole.
    assert len(cache.match(keys(NEXT_TURN), tiers=True)) == 4


def test_a_load_the_pool_cannot_take_leaves_the_hit_to_the_pools_own_pages(make_config):
    rm, pool, tier = scheduler(make_config, mode="1d", blocks=12)
    run(rm, "a", PROMPT)
    cache = rm.cache_manager.prefix_cache
    cache.evict(0, 5)  # the chain's five deepest blocks go to the tier
    path = cache.match(keys(NEXT_TURN), tiers=True)
    assert len(path) == 10 and cache.pool_depth(path) == 5
    held = rm.cache_manager.allocate([7], "hog")  # all but the five cached pages in the pool
    assert rm.cache_manager.num_free_blocks == 5
    hit, load = rm.cache_manager.load_prefix(path)  # five pages to load, and only the path's own five left
    assert len(hit) == 5 and load is None and tier.num_held == 5 and tier.loaded_total == 0
    rm.cache_manager.check_integrity()
    rm.cache_manager.free(held, "hog")


def test_clearing_the_prefix_cache_empties_the_tier(make_config):
    rm, pool, tier = scheduler(make_config)
    run(rm, "a", PROMPT)
    cache = rm.cache_manager.prefix_cache
    cache.evict(0, cache.num_evictable[0] - 4)
    assert tier.num_held > 0 and cache.num_cached_pages == 4
    rm.cache_manager.clear_prefix_cache()
    rm.cache_manager.check_integrity()
    assert tier.num_held == 0 and cache.num_nodes == 0


@pytest.mark.parametrize("space,error", [(-1.0, "positive number of GiB"), ("2", "positive number of GiB")])
def test_a_bad_swap_space_is_refused_by_name(make_config, space, error):
    with pytest.raises(ValueError, match=error):
        make_config("1d", swap_space=space)


def test_a_host_tier_without_the_prefix_cache_is_refused(make_config):
    with pytest.raises(ValueError, match="--swap-space.*prefix cache is off"):
        make_config("1d", swap_space=1.0, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="--swap-space.*tensor_parallel_size 1"):
        make_config("1d", swap_space=1.0, tensor_parallel_size=2)
