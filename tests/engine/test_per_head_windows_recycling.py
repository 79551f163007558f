"""The recycle step with two sliding types (design §17): each type's slots drop their blocks at their own
window and sink, the allocator stays consistent (check_integrity every step), and what a request holds
after each recycle step is the page-need function's value for that step."""

import pytest

from fastdeploy.cache_manager.head_wise import dead_block_range
from fastdeploy.cache_manager.slots import AttentionType
from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

# Layer 0's head 1 slides with window 6 + sink 3, layer 1's head 1 with window 14: one lane, 8 slots.
SPEC = {"sliding_window": 8, "sink_size": 0, "swa_kv_heads": [[1], [1]], "head_windows": [[6], [14]],
        "head_sinks": [[3], [0]]}
NARROW, WIDE = AttentionType(6, 3), AttentionType(14, 0)


@pytest.mark.parametrize("policy", ["projected", "reserve", "on_demand"])
def test_each_sliding_type_recycles_at_its_own_window(make_config, policy, monkeypatch):
    monkeypatch.setenv("FD_ADMISSION_POLICY", policy)
    cfg = make_config(block_size=4, num_gpu_blocks_override=64, max_num_batched_tokens=8, max_model_len=128,
                      enable_prefix_caching=False, head_wise_swa_config=SPEC)
    rm = ResourceManagerV1(cfg)
    groups = dict(rm.layout.recycling_groups)
    assert set(groups) == {NARROW, WIDE}
    request = Request("r", list(range(3, 43)), SamplingParams(max_tokens=30, ignore_eos=True), eos_token_id=2)
    rm.add_request(request)
    kills = {NARROW: set(), WIDE: set()}  # the processed-token counts at which each type lost a block
    while rm.has_unfinished_requests():
        kv = rm.kv_cache_manager
        before = kv.recycled_upto("r") if kv.holds("r") else [None] * len(groups)  # none until admitted
        batch = rm.schedule()
        (step,), n = batch.requests, request.num_computed_tokens
        for k, (kind, slots) in enumerate(rm.layout.recycling_groups):
            dead = dead_block_range(n, kind.window, kind.sink, 4)
            assert kv.recycled_upto("r")[k] == dead.stop  # every dead block of this type is back
            for s in slots:
                row = kv.table("r")[s]
                assert [i for i, p in enumerate(row) if p == -1] == list(dead)
            if before[k] is not None and kv.recycled_upto("r")[k] > before[k]:
                kills[kind].add(n)
        held = sum(p != -1 for row in kv.table("r") for p in row)
        assert [held] == rm.layout.pages_per_rank(step.start, step.num_tokens)
        rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
        rm.check_integrity()
    # Block i of a type dies once (i + 1) * 4 <= n - W + 1 and it holds no sink token: the narrow type's
    # block 1 at n = 13 (its block 0 holds the sink and is kept), the wide type's block 0 at n = 17. Prefill
    # runs in chunks of 8, so the recycle steps that see them first are at n = 16 and n = 24.
    assert (min(kills[NARROW]), min(kills[WIDE])) == (16, 24)
    assert rm.kv_cache_manager.swa_pages_recycled_total > 0
    cm = rm.cache_manager
    assert cm.num_free_pages == cm.num_total_pages
