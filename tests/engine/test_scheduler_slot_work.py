"""The scheduler's per-step work with many slots: slots with nothing to recycle cost the recycle pass nothing.

Work is counted, not timed: free-list operations (heap pushes and pops of the cache manager) and the table
rows the recycle pass reads, per schedule() call, on two slot layouts with the same single sliding slot but
3 or 7 full slots (tiny preset, 2 layers x 4 KV heads: one SWA head in every layer -> 2 lanes of 4 slots;
one SWA pair in layer 0 only -> 1 lane of 8 slots).
"""

import heapq

import pytest

from fastdeploy.cache_manager import prefix_cache_manager
from fastdeploy.cache_manager.kv_cache_manager import KVCacheManager
from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

LAYOUTS = {
    "2 lanes x 4 slots": {"sliding_window": 32, "sink_size": 0, "swa_kv_heads": [[0], [0]]},
    "1 lane x 8 slots": {"sliding_window": 32, "sink_size": 0, "swa_kv_heads": [[0], []]},
}


class RowCountingTables(list):
    """A request's per-slot table list that counts the rows read by index (the recycle pass's access)."""

    reads = 0

    def __getitem__(self, index):
        if isinstance(index, int):
            RowCountingTables.reads += 1
        return super().__getitem__(index)


class CountingHeap:
    pushes = pops = 0

    @staticmethod
    def heappush(heap, item):
        CountingHeap.pushes += 1
        heapq.heappush(heap, item)

    @staticmethod
    def heappop(heap):
        CountingHeap.pops += 1
        return heapq.heappop(heap)


def run_counting(make_config, monkeypatch, swa: dict) -> tuple:
    """Per schedule() call: (pushes, pops, rows read); and the layout."""
    cfg = make_config("head_wise_recycle_on", num_gpu_blocks_override=64, head_wise_swa_config=swa,
                      max_num_batched_tokens=256, enable_prefix_caching=False)
    rm = ResourceManagerV1(cfg)
    start = KVCacheManager.start

    def start_counting(self, request_id, hit=()):
        cached = start(self, request_id, hit)
        table = self._tables[request_id]
        table.rows = RowCountingTables(table.rows)
        return cached

    monkeypatch.setattr(KVCacheManager, "start", start_counting)
    monkeypatch.setattr(prefix_cache_manager, "heapq", CountingHeap)
    for i in range(3):  # staggered prompts: their blocks cross at different steps
        rm.add_request(Request(f"r{i}", [5] * (40 + 7 * i), SamplingParams(max_tokens=150, ignore_eos=True),
                               eos_token_id=-1))
    steps = []
    while rm.has_unfinished_requests():
        before = (CountingHeap.pushes, CountingHeap.pops, RowCountingTables.reads, rm.kv_cache_manager.swa_pages_recycled_total)
        batch = rm.schedule()
        after = (CountingHeap.pushes, CountingHeap.pops, RowCountingTables.reads, rm.kv_cache_manager.swa_pages_recycled_total)
        steps.append(tuple(a - b for a, b in zip(after, before)) + (len(batch.requests),))
        rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
    rm.check_integrity()
    return steps, cfg.slot_layout


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_recycle_pass_touches_only_sliding_slots_of_requests_due(make_config, monkeypatch, name):
    steps, layout = run_counting(make_config, monkeypatch, LAYOUTS[name])
    assert len(layout.sliding_slots) == 1 and layout.slots_per_rank == {"2 lanes x 4 slots": 4,
                                                                        "1 lane x 8 slots": 8}[name]
    assert sum(recycled for _, _, _, recycled, _ in steps) > 0
    for pushes, pops, rows, recycled, scheduled in steps:
        # A push per recycled page and nothing else (no request finishes inside schedule()). The pass indexes
        # a request's table twice per sliding slot (read the dead range, write -1 over it), for the requests
        # it recycles only: never a full slot's row, and nothing at all in a step that recycles nothing.
        assert pushes == recycled
        assert rows % (2 * len(layout.sliding_slots)) == 0 and rows <= 2 * len(layout.sliding_slots) * 3
        assert (rows == 0) == (recycled == 0)
        # A step allocates whole blocks: one page per slot at each block a request crosses, none otherwise.
        assert pops % layout.slots_per_rank == 0


def test_recycle_work_is_the_same_with_four_more_full_slots(make_config, monkeypatch):
    few, _ = run_counting(make_config, monkeypatch, LAYOUTS["2 lanes x 4 slots"])
    many, _ = run_counting(make_config, monkeypatch, LAYOUTS["1 lane x 8 slots"])
    assert len(few) == len(many)
    # Same workload, one sliding slot in both: the recycle pass pushes and reads exactly the same per step.
    assert [(p, r, rec) for p, _, r, rec, _ in few] == [(p, r, rec) for p, _, r, rec, _ in many]
    # Only allocation grows with the slots (a page for each slot per block crossed): exactly 8 / 4 times.
    assert [2 * pops for _, pops, _, _, _ in few] == [pops for _, pops, _, _, _ in many]
