"""The scheduler with a host tier below the prefix cache, under random workloads with sharing, aborts and
eviction: every page a running request reads holds the KV of exactly its block, wherever it was cached.

The "KV" is one int64 per pool page: after each step the test writes, into every page of a fully computed
block, a signature of the block's whole token prefix and the page's slot, as the model would write that
block's K/V. Pages the pool evicts go to a real HostTier over that array, and come back by its copies; so a
page that came back from the wrong entry, or was overwritten while cached, or was read while a sliding slot
dropped it, shows up as a wrong signature. check_integrity() (trie, references, tier entries) holds after
every step, and at the end every page and entry is obtainable again. Loads from the tier run on the loader's
thread while the request waits in the loading state; the test waits for each after the step that began it,
so a run is deterministic (hypothesis replays it) and the load ends at the next step.
"""

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastdeploy.cache_manager.host_tier import HostTier
from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

SWA = {"sliding_window": 13, "sink_size": 3, "swa_kv_heads": [0, 3]}
PREFIXES = [[11 + (i * 7) % 50 for i in range(80)], [61 + (i * 3) % 40 for i in range(80)],
            [21 + (i * 5) % 30 for i in range(80)]]

job = st.tuples(
    st.integers(0, 3),        # shared prefix: one of PREFIXES, or none
    st.integers(8, 72),       # how much of it
    st.lists(st.integers(3, 6), max_size=10),  # own suffix
    st.integers(1, 12),       # max tokens
    st.integers(0, 6),        # arrival step
    st.sampled_from([None, None, 2]),  # abort this many steps after arrival
)


def signature(request, block: int, slot: int, bs: int) -> int:
    return hash((tuple(request.token_ids(0, (block + 1) * bs)), slot)) & ((1 << 62) - 1)


def pages_of_blocks(table: list, blocks: range):
    """(block index, slot, page) of the table's pages of these blocks (recycled entries skipped)."""
    for i in blocks:
        for s, row in enumerate(table):
            if i < len(row) and row[i] != -1:
                yield i, s, row[i]


@pytest.mark.parametrize("mode,entries", [("1d", 6), ("1d", 400), ("head_wise_recycle_on", 20),
                                          ("head_wise_recycle_on", 400), ("head_wise_recycle_off", 400)])
def test_pages_read_after_hits_across_tiers_hold_their_blocks_kv(make_config, mode, entries):
    cfg = make_config(mode, reserve=True, num_gpu_blocks_override=14, block_size=8, max_num_batched_tokens=40,
                      max_num_seqs=4, max_model_len=256, head_wise_swa_config=SWA)
    seen = {"host_hits": 0, "stored": 0, "evicted_from_tier": 0}

    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(job, min_size=3, max_size=10))
    def run(jobs):
        rm = ResourceManagerV1(cfg)
        kv = rm.kv_cache_manager
        bs = kv.block_size
        pool = np.zeros((kv.pages_per_rank // kv.pages_per_entry, 1), np.int64)
        tier = HostTier(entries, [pool.view(np.uint8)])
        rm.cache_manager.attach_host_tier(tier)
        pending, done = list(enumerate(jobs)), {}
        for t in itertools.count():
            for i, (pre, plen, suffix, out, arrive, abort) in list(pending):
                if arrive > t:
                    continue
                pending.remove((i, jobs[i]))
                prompt = (PREFIXES[pre][:plen] if pre < 3 else []) + suffix or [5]
                r = Request(f"r{i}", prompt, SamplingParams(max_tokens=out, ignore_eos=True), eos_token_id=2)
                try:
                    rm.add_request(r)
                except ValueError:
                    continue
                if abort is not None:
                    done[f"r{i}"] = t + abort
            for rid, when in list(done.items()):
                if when == t:
                    rm.abort_request(rid)
            batch = rm.schedule()
            rm.check_integrity()
            for load in rm.cache_manager.loads_in_flight:  # deterministic: each load is done by the next step
                load.done.wait()
            for scheduled in batch.requests:  # the step's attention reads the blocks before its chunk...
                request, table = scheduled.request, kv.table(scheduled.request.request_id)
                for i, s, page in pages_of_blocks(table, range(scheduled.start // bs)):
                    assert pool[page, 0] == signature(request, i, s, bs), \
                        f"step {t}: {request.request_id} block {i} slot {s} page {page} holds another block's KV"
                end = scheduled.start + scheduled.num_tokens  # ...and writes the blocks its chunk completes
                for i, s, page in pages_of_blocks(table, range(scheduled.start // bs, end // bs)):
                    pool[page, 0] = signature(request, i, s, bs)
            rm.update_from_output(batch, [3 + t % 4 if s.samples else None for s in batch.requests])
            if not pending and not rm.has_unfinished_requests() and not rm.tier_loads_pending:
                break  # (a load whose request was aborted ends at a later step, as the engine's loop steps for it)
            assert t < 3000, "no progress"
        stats = rm.stats()
        seen["host_hits"] += stats["prefix_cache_host_hit_tokens_total"]
        seen["stored"] += stats["host_cache_stored_pages_total"]
        seen["evicted_from_tier"] += stats["host_cache_evicted_pages_total"]
        cm = rm.cache_manager
        assert cm.num_free_pages == cm.num_total_pages
        cm.clear_prefix_cache()
        cm.check_integrity()
        assert tier.num_held == 0 and cm.prefix_cache.num_nodes == 0
        assert all(o is None for owners in cm.owners() for o in owners)

    run()
    # The workloads stored evicted pages in the tier and hit on them; a small tier also dropped some.
    assert seen["stored"] > 0 and seen["host_hits"] > 0, seen
    assert entries > 100 or seen["evicted_from_tier"] > 0, seen
