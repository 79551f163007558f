"""The KV cache manager: the one owner of a request's pages, asked by request id.

Driven through the real scheduler with a fake model step; checked against the retention rule by brute
force (docs/retention_rule.md: which keys a future query can see), and its change log against the
tables it describes."""

import itertools

import numpy as np
import pytest

from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1
from scripted_proposer import ScriptedProposer, boundary_hugging

SWA = {"sliding_window": 20, "sink_size": 5, "swa_kv_heads": [0, 2]}
BS = 8
BLOCKS = {"head_wise_recycle_on": 14, "1d": 18}  # too few for all four at once: on-demand admission preempts


def request(rid, n, max_tokens, seed=0):
    return Request(rid, [3 + (i * 7 + seed) % 200 for i in range(n)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=2)


def scheduler(make_config, mode, **kwargs):
    kwargs.setdefault("num_gpu_blocks_override", 64)
    return ResourceManagerV1(make_config(mode, block_size=BS, max_num_batched_tokens=24, head_wise_swa_config=SWA,
                                         **kwargs))


def steps(rm):
    while rm.has_unfinished_requests():
        batch = rm.schedule()
        yield batch
        rm.update_from_output(batch, [sampled(s) for s in batch.requests])
        rm.check_integrity()


def sampled(scheduled):
    """The model samples 9 everywhere: a verification keeps the drafts up to the first that is not 9."""
    if not scheduled.samples:
        return None
    if not scheduled.draft_token_ids:
        return 9
    drafts = list(scheduled.draft_token_ids)
    kept = next((i for i, t in enumerate(drafts) if t != 9), len(drafts))
    return drafts[:kept] + [9]


def readable_blocks(n, window, sink, num_entries):
    """Blocks holding a key some query at position >= n can see, by the definition of SWA."""
    keys = [j for j in range(num_entries * BS) if j < sink or j > n - window]  # the query at t = n sees most
    return sorted({j // BS for j in keys if j // BS < num_entries})


@pytest.mark.parametrize("mode", ["head_wise_recycle_on", "head_wise_recycle_off", "1d"])
def test_live_pages_are_the_pages_each_head_can_still_read(make_config, mode):
    rm = scheduler(make_config, mode)
    kv = rm.kv_cache_manager
    for i in range(3):
        rm.add_request(request(f"r{i}", 30 + 25 * i, 40, seed=i))
    checked = 0
    for _ in steps(rm):
        for r in rm.running:
            live, n = kv.live_pages(r.request_id), r.num_computed_tokens
            # the entries of the tokens computed so far (the table may hold pages for the step ahead)
            rows = [row[:-(-n // BS)] for row in kv.table(r.request_id)]
            checked += 1
            if kv.num_rows == 1:  # 1-D: a block holds every head, so every block is read by some head
                assert live == [list(enumerate(rows[0]))]
                continue
            for slot, (row, entries) in enumerate(zip(rows, live)):
                if slot in (0, 2):  # the sliding heads: sink blocks and the window, recycled or not
                    want = readable_blocks(n, 20, 5, len(row))
                else:
                    want = list(range(len(row)))
                assert [i for i, _ in entries] == want, (r.request_id, slot, n)
                assert all(row[i] == p != -1 for i, p in entries)
    assert checked > 50


@pytest.mark.parametrize("mode", ["head_wise_recycle_on", "1d"])
def test_the_change_log_rebuilds_every_table_from_nothing(make_config, mode):
    """Replaying a table's updates (PageTable.updates, what the persistent batch forwards) onto -1 entries
    gives the table itself, after growth, recycling, prefix hits, drafts rolled back and preemption."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}
    cfg = make_config(mode, reserve=False, block_size=BS, max_num_batched_tokens=24, head_wise_swa_config=SWA,
                      num_gpu_blocks_override=BLOCKS[mode], enable_prefix_caching=True, speculative_config=spec)
    # Drafts right up to a page boundary, wrong after it: the pages past it go back (rollback).
    rm = ResourceManagerV1(cfg, proposer=ScriptedProposer(lambda r, i: 9, boundary_hugging(BS, (20,)), lambda t: 8))
    kv = rm.kv_cache_manager
    for i, (rid, n) in enumerate([("a", 60), ("b", 60), ("c", 90), ("d", 17)]):
        r = request(rid, n, 30, seed=0 if rid in "ab" else i)  # b shares a's prompt: a prefix hit
        rm.add_request(r)
    replayed = {}
    for batch in steps(rm):
        for r in batch.preempted:
            replayed.pop(r.request_id, None)
        for s in batch.requests:
            rid = s.request.request_id
            table = replayed.setdefault(rid, np.full((kv.num_rows, 64), -1, np.int64))
            for slots, col, width, ids in kv.take_updates(rid):
                rows = slice(None) if slots is None else list(slots)
                table[rows, col:col + width] = -1 if ids is None else np.asarray(ids)
            rows = kv.table(rid)
            np.testing.assert_array_equal(table[:, :len(rows[0])], np.asarray(rows))
            assert (table[:, len(rows[0]):] == -1).all()
    assert rm.prefix_cache_hit_tokens_total > 0 and rm.num_preemptions_total > 0
    assert rm.spec_decode_num_draft_tokens_total > rm.spec_decode_num_accepted_tokens_total > 0


def test_a_request_has_one_table_and_free_is_idempotent(make_config):
    rm = scheduler(make_config, "head_wise_recycle_on")
    kv = rm.kv_cache_manager
    assert kv.start("x") == 0 and kv.holds("x")
    with pytest.raises(ValueError, match="'x' already holds a page table"):
        kv.start("x")
    assert kv.grow("x", 17) and kv.addressable_tokens("x") == 24  # three blocks of 8
    assert kv.held_pages_per_slot("x") == [3] * rm.layout.num_slots
    kv.free("x")
    kv.free("x")  # a no-op now
    assert not kv.holds("x") and kv.held_pages_per_slot("x") == [0] * rm.layout.num_slots
    assert rm.cache_manager.num_free_pages == rm.cache_manager.num_total_pages


def test_growth_that_does_not_fit_takes_nothing(make_config):
    rm = scheduler(make_config, "head_wise_recycle_on", num_gpu_blocks_override=4)
    kv = rm.kv_cache_manager
    kv.start("x")
    free = rm.cache_manager.num_free_pages
    assert not kv.grow("x", 5 * BS) and kv.addressable_tokens("x") == 0
    assert rm.cache_manager.num_free_pages == free and kv.take_updates("x") == []
    assert kv.grow("x", 4 * BS)
    kv.free("x")


def test_the_scheduler_asks_the_manager_and_holds_no_table(make_config):
    """Nothing of a request's pages lives on the Request: the manager's tables are the only ones."""
    rm = scheduler(make_config, "head_wise_recycle_on")
    rm.add_request(request("a", 40, 5))
    r = rm.requests["a"]
    for _ in itertools.islice(steps(rm), 3):
        assert not {name for name in vars(r) if "table" in name or "page" in name or "recycle" in name}
        assert rm.kv_cache_manager.holds("a")
