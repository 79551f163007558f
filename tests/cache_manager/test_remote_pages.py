"""The KV cache manager's part in prefill/decode disaggregation, through the real scheduler: a decode
server's table for a remote prompt takes only the pages a later query reads (-1 elsewhere, exactly where
the retention rule says they are dead); a prefill server's finished request parks its pages, unchanged
and never recycled, until they are freed; live_pages stops at the tokens asked for; check_integrity
holds throughout."""

import pytest

from fastdeploy.cache_manager.head_wise import first_window_block
from fastdeploy.disaggregation.transfer_config import RemotePrefill
from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

SWA = {"sliding_window": 20, "sink_size": 5, "swa_kv_heads": [0, 2]}
BS = 8


def scheduler(make_config, mode):
    return ResourceManagerV1(make_config(mode, block_size=BS, max_num_batched_tokens=64, head_wise_swa_config=SWA,
                                         num_gpu_blocks_override=32))


def request(rid, n, max_tokens=4):
    return Request(rid, [3 + (i * 7) % 200 for i in range(n)], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_id=2)


@pytest.mark.parametrize("n", [9, 16, 41, 57])
def test_a_remote_prompt_takes_only_the_pages_a_later_query_reads(make_config, n):
    rm = scheduler(make_config, "head_wise_recycle_on")
    kv = rm.kv_cache_manager
    r = request("d", n)
    r.remote_kv = RemotePrefill("e", "p", "h", 1, [[0]], n - 1)
    rm.add_request(r)
    batch = rm.schedule()
    assert batch.loading == [r] and batch.requests == [] and r.kv_loading
    assert r.num_computed_tokens == n - 1
    rm.check_integrity()
    entries = -(-(n - 1) // BS)
    sliding = {s for _, slots in rm.layout.recycling_groups for s in slots}
    for s, row in enumerate(kv.table("d")):
        for i, page in enumerate(row[:entries]):
            dead = s in sliding and 1 <= i < first_window_block(n - 1, 20, BS)  # sink 5 keeps block 0
            assert (page == -1) == dead, (s, i)
    assert sum(len(row) for row in kv.live_pages("d", n - 1)) == sum(rm.layout.pages_per_rank(n - 1, 0))
    rm.kv_loaded(r)
    assert rm.schedule().requests[0].num_tokens == 1  # the last prompt token, computed here


def test_a_parked_table_is_held_unchanged_until_freed(make_config):
    rm = scheduler(make_config, "head_wise_recycle_on")
    kv = rm.kv_cache_manager
    r = request("p", 57, max_tokens=1)
    r.hands_off_kv = True
    rm.add_request(r)
    while rm.has_unfinished_requests():
        batch = rm.schedule()
        rm.update_from_output(batch, [7 if s.samples else None for s in batch.requests])
    assert kv.holds("p") and kv.num_parked == 1
    before = [list(row) for row in kv.table("p")]
    live = kv.live_pages("p", 56)
    assert all(i < 7 for row in live for i, _ in row)  # tokens [0, 56): 7 blocks, never the 8th
    for _ in range(3):  # later steps recycle nothing of it
        rm.add_request(request(f"o{_}", 30, max_tokens=2))
        while rm.has_unfinished_requests():
            batch = rm.schedule()
            rm.update_from_output(batch, [7 if s.samples else None for s in batch.requests])
            rm.check_integrity()
    assert kv.table("p") == before
    kv.free("p")
    assert kv.num_parked == 0 and not kv.holds("p")
    rm.check_integrity()
    assert kv.pages.num_free_pages == kv.pages.num_total_pages
