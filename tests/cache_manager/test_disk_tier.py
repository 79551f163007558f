"""The disk tier below the host tier (--kvcache-storage-backend file): what it writes, reads back, keeps across a
restart, refuses to read and lets go (cache_manager/disk_tier.py, host_tier.py).

The pool's "KV" is a numpy array with one int64 per page (the page's id x 1000 when it was computed), so the
bytes that travel pool -> memory -> file -> pool are real and each page says which block it holds.
"""

import logging
import os

import numpy as np
import pytest

from fastdeploy.cache_manager.disk_tier import PageFiles
from fastdeploy.cache_manager.host_tier import HostTier
from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

from test_host_tier import BS, NEXT_TURN, PROMPT, SWA, keys, load_and_end, run


def scheduler(make_config, directory, mode="head_wise_recycle_on", entries=6, identity="model-a", capacity=None):
    rm = ResourceManagerV1(make_config(mode, num_gpu_blocks_override=40, block_size=BS, max_num_batched_tokens=40,
                                       max_num_seqs=4, max_model_len=256, head_wise_swa_config=SWA))
    kv = rm.kv_cache_manager
    pool = np.arange(kv.pages_per_rank // kv.pages_per_entry, dtype=np.int64)[:, None] * 1000
    tier = HostTier(entries, [pool.view(np.uint8)])
    tier.attach_disk(PageFiles(str(directory), identity, tier.entry_bytes), capacity or (1 << 30))
    rm.cache_manager.attach_host_tier(tier)
    return rm, pool, tier


def block_bytes(cache, pool):
    """(block index, slot) -> the value its pool page holds, for every cached pool page."""
    return {(node.depth, s): int(pool[p, 0]) for p, (node, s) in cache.where[0].items()}


def load_next_turn(rm):
    cache = rm.cache_manager.prefix_cache
    return load_and_end(rm, cache.match(keys(NEXT_TURN), tiers=True))


def files_of(tier):
    return sorted(f for f in os.listdir(tier.files.dir) if f.endswith(".kv"))


def test_pages_the_host_tier_lets_go_are_written_to_files_and_a_hit_reads_them_back(make_config, tmp_path):
    rm, pool, tier = scheduler(make_config, tmp_path)
    run(rm, "a", PROMPT)
    cache = rm.cache_manager.prefix_cache
    before = block_bytes(cache, pool)
    cache.evict(0, cache.num_evictable[0])  # six entries in memory: every other live page goes to a file
    rm.check_integrity()
    stored = tier.stored_total
    assert tier.num_held == 6 and tier.disk_stored_total == stored - 6 == len(files_of(tier)) > 0
    pool[:] = -1  # the pool's pages are reused: their old KV is gone
    hit, from_tiers = load_next_turn(rm)
    assert len(hit) == 10 and from_tiers == 10 * BS
    assert tier.disk_loaded_total == stored - 6 and not files_of(tier)  # a page read back is the pool's again
    rm.check_integrity()
    for p, (node, s) in cache.where[0].items():  # every page holds its own block's KV
        assert pool[p, 0] == before[(node.depth, s)]


def test_a_restart_finds_the_last_runs_pages_and_its_next_turn_hits_on_them(make_config, tmp_path):
    rm, pool, tier = scheduler(make_config, tmp_path)
    run(rm, "a", PROMPT)
    before = block_bytes(rm.cache_manager.prefix_cache, pool)
    written = rm.cache_manager.persist_prefix_cache()  # a clean shutdown: memory and pool pages to files
    tier.files.close()
    # Stale sliding pages are not written: blocks 1-7 of heads 0 and 3, past the sink block (0) and before
    # the window in front of the leaf (blocks 8 and 9).
    stale = {(d, s) for d in range(1, 8) for s in SWA["swa_kv_heads"]}
    assert stale <= set(before) and written == len(files_of(tier)) == len(before) - len(stale)

    rm2, pool2, tier2 = scheduler(make_config, tmp_path)  # the next process: an empty pool
    cache2 = rm2.cache_manager.prefix_cache
    assert tier2.disk_restored_total == written and cache2.num_cached_pages == 0
    rm2.check_integrity()
    pool2[:] = -1
    hit, from_tiers = load_next_turn(rm2)
    assert len(hit) == 10 and from_tiers == 10 * BS
    rm2.check_integrity()
    for p, (node, s) in cache2.where[0].items():
        assert pool2[p, 0] == before[(node.depth, s)]
    run(rm2, "b", NEXT_TURN)  # and the request runs on the hit
    assert rm2.stats()["prefix_cache_hit_tokens_total"] >= 10 * BS


def test_another_model_or_layout_never_reads_the_files_and_says_so_once(make_config, tmp_path, caplog):
    rm, _, tier = scheduler(make_config, tmp_path)
    run(rm, "a", PROMPT)
    assert rm.cache_manager.persist_prefix_cache() > 0
    with caplog.at_level(logging.WARNING, logger="fastdeploy.cache"):
        _, _, other = scheduler(make_config, tmp_path, identity="model-b")
    assert other.disk_restored_total == 0
    assert [r.message for r in caplog.records].count(
        f"disk tier: {tmp_path} holds pages of 1 other model(s) or cache layout(s) (model-a); they are ignored") == 1
    assert files_of(tier)  # left alone


def test_a_corrupt_file_is_dropped_at_its_load_and_the_hit_is_recomputed(make_config, tmp_path):
    rm, pool, tier = scheduler(make_config, tmp_path)
    run(rm, "a", PROMPT)
    rm.cache_manager.persist_prefix_cache()
    tier.files.close()
    rm2, _, tier2 = scheduler(make_config, tmp_path)
    victim = os.path.join(tier2.files.dir, files_of(tier2)[0])
    with open(victim, "r+b") as f:  # flip one payload byte: the header is intact, the CRC is not
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    cache2 = rm2.cache_manager.prefix_cache
    hit, from_tiers = load_next_turn(rm2)  # the load finds the corrupt file on its thread, and ends failed
    assert len(hit) == 10 and tier2.load_failures_total == 1 and tier2.loads_total == 0
    assert tier2.files.corrupt_total == 1 and not os.path.exists(victim)
    rm2.check_integrity()
    # The page it could not write left the prefix cache: a lookup now stops before its block, never reads it.
    assert len(cache2.match(keys(NEXT_TURN), tiers=True)) < 10 and not cache2.loading
    run(rm2, "b", NEXT_TURN)


def test_a_truncated_file_or_an_interrupted_write_is_deleted_at_start_up(make_config, tmp_path):
    rm, _, tier = scheduler(make_config, tmp_path)
    run(rm, "a", PROMPT)
    written = rm.cache_manager.persist_prefix_cache()
    tier.files.close()
    names = files_of(tier)
    with open(os.path.join(tier.files.dir, names[-1]), "r+b") as f:
        f.truncate(40)
    open(os.path.join(tier.files.dir, names[0] + ".tmp"), "wb").close()
    rm2, _, tier2 = scheduler(make_config, tmp_path)
    assert tier2.files.corrupt_total == 1 and not any(f.endswith(".tmp") for f in os.listdir(tier2.files.dir))
    # The truncated page's block, and the blocks below it if it was their only way up, are not restored.
    assert tier2.disk_restored_total <= written - 1 and len(files_of(tier2)) == tier2.disk_restored_total
    rm2.check_integrity()


def test_the_disk_tier_keeps_to_its_capacity_oldest_first(make_config, tmp_path):
    rm, _, tier = scheduler(make_config, tmp_path, mode="1d", entries=2, capacity=3 * 8)  # three 8-byte blocks
    run(rm, "a", PROMPT)
    cache = rm.cache_manager.prefix_cache
    assert tier.entry_bytes == 8 and tier.disk_capacity == 3
    cache.evict(0, cache.num_evictable[0])  # ten blocks, deepest first: two in memory, three in files
    rm.check_integrity()
    assert tier.num_held == 2 and len(files_of(tier)) == 3 and tier.disk_evicted_total == 5
    # The five kept are the chain's head (the deepest went first): a hit on them is whole.
    assert len(cache.match(keys(NEXT_TURN), tiers=True)) == 5


def test_clearing_the_prefix_cache_deletes_the_files(make_config, tmp_path):
    rm, _, tier = scheduler(make_config, tmp_path)
    run(rm, "a", PROMPT)
    cache = rm.cache_manager.prefix_cache
    cache.evict(0, cache.num_evictable[0])
    assert files_of(tier)
    rm.cache_manager.clear_prefix_cache()
    rm.check_integrity()
    assert not files_of(tier) and cache.num_nodes == 0


@pytest.mark.parametrize("flags,error", [
    ({"kvcache_storage_backend": "mooncake", "swap_space": 1.0, "kvcache_storage_path": "/tmp"},
     "'mooncake' is not built here"),
    ({"kvcache_storage_backend": "file", "kvcache_storage_path": "/tmp"}, "--swap-space"),
    ({"kvcache_storage_backend": "file", "swap_space": 1.0}, "needs --kvcache-storage-path"),
    ({"kvcache_storage_backend": "file", "swap_space": 1.0, "kvcache_storage_path": "/tmp",
      "kvcache_storage_space": 0}, "--kvcache-storage-space must be a positive number"),
])
def test_bad_disk_tier_flags_are_refused_by_name(make_config, flags, error):
    with pytest.raises(ValueError, match=error):
        make_config("1d", **flags)


def test_a_directory_it_cannot_write_is_refused_by_name(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="--kvcache-storage-path .*cannot write there"):
        PageFiles(str(blocker / "cache"), "model-a", 80)


def test_a_second_engine_on_the_same_directory_is_refused_until_the_first_closes(tmp_path):
    first = PageFiles(str(tmp_path), "model-a", 80)
    with pytest.raises(ValueError, match="another engine serving the same model and cache layout uses it"):
        PageFiles(str(tmp_path), "model-a", 80)
    PageFiles(str(tmp_path), "model-b", 80).close()  # another model's directory is its own
    first.close()
    PageFiles(str(tmp_path), "model-a", 80).close()
