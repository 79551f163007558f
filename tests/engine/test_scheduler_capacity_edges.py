"""Scheduler rules at a capacity with no slack: one page more or less changes the outcome.

Page needs here are worked out by hand from docs/retention_rule.md, not with head_wise.py. Block 16; window
W = 17 (= 1 mod bs), no sink: computing position n >= 16 sees keys n-16..n, i.e. blocks
(n - 16) // 16 and n // 16, so a SWA head never holds more than 2 live blocks once decoding, and
block b is dead once b + 2 blocks are processed. The KV of the last sampled token is never written:
prompt p with t output tokens computes positions 0 .. p + t - 2.
"""

import pytest

from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

BS, HEADS = 16, 4
ALL_SWA = {"sliding_window": 17, "sink_size": 0, "swa_kv_heads": [0, 1, 2, 3]}
ONE_SWA = {"sliding_window": 17, "sink_size": 0, "swa_kv_heads": [0]}


def request(rid, prompt_len, max_tokens):
    prompt = [3 + (i * 7 + len(rid)) % 200 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=2)


def manager(make_config, blocks, swa, reserve=True):
    return ResourceManagerV1(make_config("head_wise_recycle_on", reserve=reserve, num_gpu_blocks_override=blocks,
                                         head_wise_swa_config=swa, enable_prefix_caching=False))


def drive(rm, limit=500):
    """Run to completion with no preemption; per step, the ids scheduled and the fewest free pages seen."""
    steps, low = [], rm.cache_manager.num_free_pages
    for _ in range(limit):
        if not rm.has_unfinished_requests():
            return steps, low
        batch = rm.schedule()
        low = min(low, rm.cache_manager.num_free_pages)
        assert not batch.preempted, f"step {len(steps)} preempted {[r.request_id for r in batch.preempted]}"
        steps.append([s.request.request_id for s in batch.requests])
        rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
        rm.check_integrity()
    raise AssertionError(f"not finished after {limit} steps; last steps {steps[-3:]}")


@pytest.mark.parametrize("reserve", [True, False])
def test_swa_pages_are_recycled_before_the_running_request_grows_its_table(make_config, reserve):
    # Prompt 16 + 33 outputs computes positions 0..47: blocks 0..2, never more than 2 at once
    # (block 0 dies when 32 tokens are processed, just as position 32 needs block 2). The cache has
    # exactly those 2 blocks per head: only recycling before allocating avoids a preemption.
    rm = manager(make_config, blocks=2, swa=ALL_SWA, reserve=reserve)
    r = request("r", 16, 33)
    rm.add_request(r)
    steps, low = drive(rm)
    assert rm.num_preemptions_total == 0 and r.num_preemptions == 0
    assert len(r.output_token_ids) == 33 and len(steps) == 33
    assert low == 0  # the cache really was full at the peak
    # Recycled by the end: block 0 at 32 processed tokens, block 1 at 48 (never reached: 47 is last).
    assert rm.kv_cache_manager.swa_pages_recycled_total == 1 * HEADS
    assert rm.cache_manager.num_free_pages == 2 * HEADS


def test_two_requests_whose_peaks_fill_the_cache_exactly_are_admitted_together(make_config):
    # Peaks: prompt 16 + 17 outputs computes 0..31 -> 2 blocks per head = 8 pages;
    # prompt 8 + 1 output computes 0..7 -> 1 block per head = 4 pages. The cache: 3 blocks = 12 pages.
    rm = manager(make_config, blocks=3, swa=ALL_SWA)
    rm.add_request(request("big", 16, 17))
    rm.add_request(request("small", 8, 1))
    steps, _ = drive(rm)
    assert steps[0] == ["big", "small"]
    assert rm.num_preemptions_total == 0


def test_a_request_one_page_over_the_free_reservation_waits(make_config):
    # One SWA head of four: prompt 16 + 65 outputs computes 0..79 -> full heads 5 blocks, the SWA
    # head 2 -> 3 * 5 + 2 = 17 pages; prompt 8 + 1 output -> 4 pages. 17 + 4 = 21 > 20 = 5 blocks.
    rm = manager(make_config, blocks=5, swa=ONE_SWA)
    rm.add_request(request("big", 16, 65))
    rm.add_request(request("small", 8, 1))
    steps, _ = drive(rm)
    assert steps[0] == ["big"]
    first_small = next(i for i, ids in enumerate(steps) if "small" in ids)
    assert first_small == 65  # only after big's 65 steps released its reservation
    assert rm.num_preemptions_total == 0


def test_a_request_whose_peak_is_the_whole_cache_is_admitted(make_config):
    rm = manager(make_config, blocks=5, swa=ONE_SWA)  # 20 pages
    rm.add_request(request("whole", 16, 65))  # 17 pages
    rm.add_request(request("after", 16, 17))  # full heads 2 blocks, SWA 2 -> 8 pages: 25 > 20, waits
    steps, _ = drive(rm)
    assert steps[0] == ["whole"] and "after" in steps[65]
    exact = manager(make_config, blocks=2, swa=ALL_SWA)  # 8 pages, a peak of exactly 8
    exact.add_request(request("exact", 16, 17))
    assert drive(exact)[0][0] == ["exact"]
