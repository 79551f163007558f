"""Scheduler counters and the on-demand admission rule with a prefix hit, against hand counts."""

import pytest

from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.driver import fake_step
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

ONE_SWA = {"sliding_window": 20, "sink_size": 5, "swa_kv_heads": [0]}
PROMPT_A = [3 + (i * 11) % 200 for i in range(40)]


def request(rid, prompt, max_tokens):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=2)


def step(rm):
    return fake_step(rm, check=True)


def run(rm, *requests):
    for r in requests:
        rm.add_request(r)
    while rm.has_unfinished_requests():
        step(rm)


def test_stats_after_a_repeated_prompt_by_hand(make_config):
    rm = ResourceManagerV1(make_config("1d", num_gpu_blocks_override=10, head_wise_swa_config=ONE_SWA))
    rm.add_request(request("a", PROMPT_A, 1))
    rm.add_request(request("b", PROMPT_A, 1))  # same prompt, admitted in the same step: no hit yet
    assert rm.stats()["num_requests_waiting"] == 2
    step(rm)
    assert rm.stats()["num_requests_running"] == 0  # both sampled their only token and finished
    run(rm, request("c", PROMPT_A + [7], 1))
    # a and b each cached blocks 0 and 1 (tokens 0..31; the second copy stays private and is freed);
    # c hits both: 32 of its 41 tokens. Every page is free or cached-unreferenced again.
    assert rm.stats() == {
        "kv_pages_total": 40, "kv_pages_free": 40, "kv_pages_free_per_head": [10, 10, 10, 10],
        "num_requests_running": 0, "num_requests_waiting": 0, "swa_pages_recycled_total": 0,
        "num_preemptions_total": 0, "prefix_cache_hit_tokens_total": 32,
        "prefix_cache_query_tokens_total": 40 + 40 + 41,
        "prefix_cache_cached_pages": 2 * 4, "prefix_cache_evictable_pages": 2 * 4,
        "prefix_cache_evictions_total": 0, "prefix_cache_cached_blocks": 2,
        "prefix_cache_query_requests_total": 3, "prefix_cache_hit_requests_total": 1,  # only c hit
        "prefix_cache_host_hit_tokens_total": 0,  # no host tier (--swap-space)
        "recomputed_tokens_total": 0,
    }


def test_each_preemption_of_a_request_is_counted_on_it(make_config):
    cfg = make_config("1d", reserve=False, num_gpu_blocks_override=10, head_wise_swa_config=ONE_SWA,
                      max_num_batched_tokens=64, enable_prefix_caching=False)
    rm = ResourceManagerV1(cfg)
    requests = [request(f"r{i}", [7] * 20, 80) for i in range(4)]
    counted = {r.request_id: 0 for r in requests}
    for r in requests:
        rm.add_request(r)
    while rm.has_unfinished_requests():
        for victim in step(rm).preempted:
            counted[victim.request_id] += 1
    assert {r.request_id: r.num_preemptions for r in requests} == counted
    assert max(counted.values()) >= 2, counted  # a request preempted twice: the count accumulates
    assert rm.num_preemptions_total == sum(counted.values())


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_off"])
@pytest.mark.parametrize("blocks,admitted", [(7, True), (6, False)])
def test_on_demand_admission_counts_the_pages_a_hit_already_holds(make_config, mode, blocks, admitted):
    rm = ResourceManagerV1(make_config(mode, reserve=False, num_gpu_blocks_override=blocks,
                                       head_wise_swa_config=ONE_SWA))
    run(rm, request("a", PROMPT_A, 1))  # caches blocks 0 and 1 (tokens 0..31)
    rm.add_request(request("r", [5] * 16, 40))
    step(rm)  # r: 1 block
    rm.add_request(request("b", PROMPT_A[:32] + [6] * 8, 4))
    batch = step(rm)  # r grows to 2 blocks; b hits blocks 0 and 1 and asks for 8 tokens
    # b needs its table for 32 + 8 tokens plus 2 blocks of headroom = 72 tokens = 5 blocks x 4 heads
    # = 20 pages, of which its hit holds 2 x 4 = 8: 12 more. Free: blocks - 2 (r) - 2 (hit), x 4.
    assert ("b" in [s.request.request_id for s in batch.requests]) is admitted
    # Admitted, b holds its 40-token table (3 blocks, 2 of them the hit); waiting, it let the hit go
    # (cached pages count as free again).
    assert rm.cache_manager.free_pages_per_rank() == [(blocks - 2 - (3 if admitted else 0)) * 4]


def test_a_waiting_request_hits_only_what_is_still_cached_when_admitted(make_config):
    # 1-D, on-demand admission, 7 blocks. a caches blocks 0..2 of PROMPT_A[:48]. r runs alone; x
    # (those 48 tokens + 16 more) hits 3 blocks but lacks 3 blocks of headroom while r runs, so it
    # waits. r grows to 6 blocks and evicts a's blocks 2 and 1 (leaf first). When r ends, x must
    # start after the one block still cached, not after the three it saw before.
    rm = ResourceManagerV1(make_config("1d", reserve=False, num_gpu_blocks_override=7, head_wise_swa_config=ONE_SWA))
    run(rm, request("a", PROMPT_A[:48], 1))
    rm.add_request(request("r", [250] * 16, 81))
    step(rm)
    rm.add_request(request("x", PROMPT_A[:48] + [9] * 16, 1))
    starts = {}
    while rm.has_unfinished_requests():
        for s in step(rm).requests:
            starts.setdefault(s.request.request_id, s.start)
    assert starts["x"] == 16


def schedule_with_ghost(rm, ghost_pages):
    """One schedule while `ghost_pages` pages of head 0 are held outside any request (so the free
    count is not a multiple of the heads); returns the ids scheduled, then gives the pages back."""
    cm = rm.cache_manager
    ghost = cm.allocate_gpu_blocks_head_wise([ghost_pages, 0, 0, 0], "ghost")
    batch = rm.schedule()
    cm.recycle_gpu_blocks_head_wise(ghost, "ghost")
    rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
    rm.check_integrity()
    return [s.request.request_id for s in batch.requests]


W17 = {"sliding_window": 17, "sink_size": 0, "swa_kv_heads": [0]}
PROMPT_64 = [3 + (i * 11) % 200 for i in range(64)]


@pytest.mark.parametrize("ghost,admitted", [(2, True), (3, False)])
def test_on_demand_admission_counts_only_the_live_pages_of_a_head_wise_hit(make_config, ghost, admitted):
    # Recycling on, head 0 slides with W = 17: a caches blocks 0..3 of 64 tokens. b (48 of them + 8)
    # hits 3 blocks; at 48 tokens the SWA head's blocks 0 and 1 are dead, so the hit holds
    # 3 x 3 + 1 = 10 pages. b needs 32 + 8 tokens + 2 blocks of headroom = 6 blocks: 3 x 6 for the
    # full heads + (6 - 2) for the SWA head = 22 pages, 12 more. 8 blocks = 32 pages; r holds 8,
    # the hit 10, the ghost 2 or 3: 12 or 11 pages are left (a's unreferenced pages count as free).
    rm = ResourceManagerV1(make_config("head_wise_recycle_on", reserve=False, num_gpu_blocks_override=8,
                                       head_wise_swa_config=W17))
    run(rm, request("a", PROMPT_64, 1))
    rm.add_request(request("r", [5] * 16, 40))
    step(rm)
    rm.add_request(request("b", PROMPT_64[:48] + [6] * 8, 4))
    assert ("b" in schedule_with_ghost(rm, ghost)) is admitted


@pytest.mark.parametrize("ghost,admitted", [(0, True), (1, False)])
def test_on_demand_admission_without_a_hit_needs_every_page(make_config, ghost, admitted):
    # b (40 new tokens, no hit) needs 40 + 32 tokens = 5 blocks = 20 pages with recycling off.
    # 7 blocks = 28 pages; r holds 8 (2 blocks), the ghost 0 or 1: 20 or 19 pages are left.
    rm = ResourceManagerV1(make_config("head_wise_recycle_off", reserve=False, num_gpu_blocks_override=7,
                                       head_wise_swa_config=W17, enable_prefix_caching=False))
    rm.add_request(request("r", [5] * 16, 40))
    step(rm)
    rm.add_request(request("b", [6] * 40, 4))
    assert ("b" in schedule_with_ghost(rm, ghost)) is admitted
