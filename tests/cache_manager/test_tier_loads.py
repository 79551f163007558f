"""Loads from the host and disk tiers run off the step (cache_manager/tier_loader.py): a request whose prefix hit
the lower tiers hold waits in the loading state while other requests' steps run, nobody reads a page before its
copy is done, a failed load falls back to recomputing, and every page stays accounted for at every step.

The pool's "KV" is a numpy array with one int64 per page (test_host_tier.py); the loader's work is gated by an
event the test sets, so "the load is still running" is a state the test holds, not a race it hopes for.
"""

import os
import threading

import numpy as np
import pytest

from fastdeploy.engine.request import Request, RequestStatus, SamplingParams

from test_disk_tier import files_of, scheduler as disk_scheduler
from test_host_tier import BS, NEXT_TURN, PROMPT, run, scheduler

OTHER = [200 + (i * 13) % 40 for i in range(30)]  # a prompt sharing nothing with PROMPT
UNWRITTEN = -1  # what the pool holds where no copy wrote
COMPUTED = -2   # what a step writes into the pages of the blocks it computes (not PROMPT's: its pages came back)


def gate(monkeypatch, tier) -> threading.Event:
    """Hold every load of `tier` until the returned event is set."""
    opened, copy_in = threading.Event(), tier.copy_in

    def gated(load):
        assert opened.wait(timeout=60), "the test never opened the gate"
        copy_in(load)

    monkeypatch.setattr(tier, "copy_in", gated)
    return opened


def evicted_to_tier(rm, pool) -> dict:
    """Cache PROMPT, push every page of it to the tier, and forget the pool's bytes; returns what each
    (block, slot) held."""
    run(rm, "a", PROMPT)
    cache = rm.cache_manager.prefix_cache
    before = {(node.depth, s): int(pool[p, 0]) for p, (node, s) in cache.where[0].items()}
    cache.evict(0, cache.num_evictable[0])
    pool[:] = UNWRITTEN
    return before


def add(rm, rid, prompt, max_tokens=2):
    request = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=2)
    rm.add_request(request)
    return request


def step(rm, pool, before):
    """One step, checking what the step's attention reads: every page of a request's blocks below its chunk is
    written (not being loaded, not UNWRITTEN) and holds its own block's bytes where PROMPT cached them."""
    batch = rm.schedule()
    rm.check_integrity()
    loading = rm.cache_manager.prefix_cache.loading
    for scheduled in batch.requests:
        table = rm.kv_cache_manager.table(scheduled.request.request_id)
        for i in range(scheduled.start // BS):
            for s, row in enumerate(table):
                page = row[i]
                if page == -1:
                    continue
                assert page not in loading, f"{scheduled.request.request_id} reads page {page} while it loads"
                assert pool[page, 0] != UNWRITTEN, f"{scheduled.request.request_id} reads unwritten page {page}"
                if scheduled.request.token_ids(0, (i + 1) * BS) == PROMPT[:(i + 1) * BS]:  # loaded, or computed again
                    assert pool[page, 0] in (before[(i, s)], COMPUTED), f"block {i} slot {s}: page {page} holds " \
                                                                        f"another block"
        end = scheduled.start + scheduled.num_tokens  # the step writes the blocks its chunk completes
        for i in range(scheduled.start // BS, end // BS):
            for row in table:
                if i < len(row) and row[i] != -1:
                    pool[row[i], 0] = COMPUTED
    rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
    rm.check_integrity()
    return batch


def finish(rm, pool, before, limit=200):
    for _ in range(limit):
        if not rm.has_unfinished_requests() and not rm.tier_loads_pending:
            return
        step(rm, pool, before)
        for load in rm.cache_manager.loads_in_flight:
            load.done.wait(30)
    raise AssertionError("no progress")


def test_a_tier_hit_waits_in_the_loading_state_while_another_requests_steps_run(make_config, monkeypatch):
    rm, pool, tier = scheduler(make_config)
    before = evicted_to_tier(rm, pool)
    opened = gate(monkeypatch, tier)
    b, c = add(rm, "b", NEXT_TURN), add(rm, "c", OTHER, max_tokens=4)
    loading_steps = 0
    for _ in range(3):  # the load is held: b waits, c runs
        batch = step(rm, pool, before)
        assert b.kv_loading and b.status == RequestStatus.RUNNING and b not in [s.request for s in batch.requests]
        assert c in [s.request for s in batch.requests]
        loading_steps += 1
    assert batch.loading == [] and rm.stats()["host_cache_loading_requests"] == 1
    assert rm.stats()["host_cache_loading_pages"] > 0
    opened.set()
    for load in rm.cache_manager.loads_in_flight:
        load.done.wait(30)
    batch = step(rm, pool, before)  # the load ends at this step's start: b runs from its whole hit
    scheduled = {s.request.request_id: s for s in batch.requests}
    assert not b.kv_loading and scheduled["b"].start == 10 * BS and b.num_cached_tokens == 10 * BS
    finish(rm, pool, before)
    stats = rm.stats()
    assert loading_steps == 3 and stats["host_cache_loads_total"] == 1 and stats["host_cache_load_failures_total"] == 0
    assert stats["host_cache_load_wait_seconds_total"] > 0 and stats["prefix_cache_host_hit_tokens_total"] == 10 * BS
    cm = rm.cache_manager
    assert cm.num_free_pages == cm.num_total_pages and tier.num_loading == 0


def test_a_second_request_on_the_path_being_loaded_waits_for_that_load_and_reads_only_written_pages(
        make_config, monkeypatch):
    rm, pool, tier = scheduler(make_config)
    before = evicted_to_tier(rm, pool)
    opened = gate(monkeypatch, tier)
    b = add(rm, "b", NEXT_TURN)
    step(rm, pool, before)
    assert b.kv_loading
    cache = rm.cache_manager.prefix_cache
    loading = dict(cache.loading)
    assert loading and all(pool[p, 0] == UNWRITTEN for p in loading)
    # Pages being loaded are referenced by their load: evicting everything evictable leaves them cached.
    cache.evict(0, cache.num_evictable[0])
    rm.check_integrity()
    assert all(p in cache.where[0] and cache.loading[p] is load for p, load in loading.items())
    d = add(rm, "d", PROMPT + [9] + [5] * 8)  # the same ten cached blocks, another question
    for _ in range(2):
        step(rm, pool, before)  # (step() fails if d reads a page being loaded or unwritten)
        assert d.status == RequestStatus.WAITING and b.kv_loading
    opened.set()
    for load in rm.cache_manager.loads_in_flight:
        load.done.wait(30)
    batch = step(rm, pool, before)
    scheduled = {s.request.request_id: s for s in batch.requests}
    assert scheduled["b"].start == scheduled["d"].start == 10 * BS  # d waited for the load and hits it whole
    finish(rm, pool, before)
    assert rm.stats()["host_cache_loads_total"] == 1  # one load served both


def test_an_aborted_loading_request_leaves_its_load_to_end_and_every_page_is_accounted_for(make_config, monkeypatch):
    rm, pool, tier = scheduler(make_config)
    before = evicted_to_tier(rm, pool)
    opened = gate(monkeypatch, tier)
    add(rm, "b", NEXT_TURN)
    step(rm, pool, before)
    rm.abort_request("b")
    rm.check_integrity()  # its pages are held by the load alone now
    cm = rm.cache_manager
    assert cm.loads_in_flight and cm.num_free_pages < cm.num_total_pages
    opened.set()
    rm.close_tier_loads()  # shutdown: the worker finishes, the load ends, its thread stops
    rm.check_integrity()
    assert not rm.tier_loads_pending and tier.num_loading == 0 and not cm.prefix_cache.loading
    assert cm.num_free_pages == cm.num_total_pages
    assert cm.loader._thread is None
    # The pages it wrote are plain cached pages: the next turn hits them in the pool.
    add(rm, "e", NEXT_TURN)
    finish(rm, pool, before)
    assert rm.stats()["prefix_cache_hit_tokens_total"] == 2 * 10 * BS  # b's admission and e's (a hit nothing)


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_on"])
def test_a_load_that_finds_a_corrupt_file_falls_back_to_recomputing_what_is_no_longer_cached(
        make_config, tmp_path, mode):
    rm, pool, tier = disk_scheduler(make_config, tmp_path, mode=mode)
    run(rm, "a", PROMPT)
    cache = rm.cache_manager.prefix_cache
    before = {(node.depth, s): int(pool[p, 0]) for p, (node, s) in cache.where[0].items()}
    rm.cache_manager.persist_prefix_cache()
    tier.files.close()
    rm2, pool2, tier2 = disk_scheduler(make_config, tmp_path, mode=mode)  # the next process: pages on disk only
    pool2[:] = UNWRITTEN
    victim = os.path.join(tier2.files.dir, files_of(tier2)[len(files_of(tier2)) // 2])
    with open(victim, "r+b") as f:  # flip one payload byte: the header is intact, the CRC is not
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    b = add(rm2, "b", NEXT_TURN)
    step(rm2, pool2, before)
    assert b.kv_loading
    for load in rm2.cache_manager.loads_in_flight:
        load.done.wait(30)
    batch = step(rm2, pool2, before)  # the load ended failed: b went back to the queue and was admitted again
    scheduled = {s.request.request_id: s for s in batch.requests}
    assert not b.kv_loading and scheduled["b"].start < 10 * BS
    assert tier2.files.corrupt_total == 1 and not os.path.exists(victim)
    stats = rm2.stats()
    assert stats["host_cache_load_failures_total"] == 1 and stats["host_cache_loads_total"] == 0
    # The hit is counted once: the one it ran with (the pages the failed load did write are pool pages now).
    assert stats["prefix_cache_hit_tokens_total"] == scheduled["b"].start == b.num_cached_tokens
    assert stats["prefix_cache_query_requests_total"] == 1
    finish(rm2, pool2, before)
    assert b.output_token_ids == [9, 9] and stats["prefix_cache_host_hit_tokens_total"] == 0
    cm = rm2.cache_manager
    assert cm.num_free_pages == cm.num_total_pages and not cm.prefix_cache.loading


def test_a_copy_under_the_inline_budget_runs_at_admission_and_its_request_runs_in_that_step(make_config):
    """FD_TIER_LOAD_INLINE_MS: a host-memory copy the tier's measured speed puts under the budget is done in the
    engine loop at admission: no loading state, the request runs from its whole hit in the step that admits it."""
    rm, pool, tier = scheduler(make_config)
    rm.cache_manager.inline_load_seconds = 1.0
    before = evicted_to_tier(rm, pool)
    b = add(rm, "b", NEXT_TURN)
    batch = step(rm, pool, before)  # (step() fails if b reads a page not yet written)
    scheduled = {s.request.request_id: s for s in batch.requests}
    assert not b.kv_loading and scheduled["b"].start == 10 * BS and not rm.tier_loads_pending
    finish(rm, pool, before)
    stats = rm.stats()
    assert stats["host_cache_loads_total"] == 1 and stats["host_cache_load_wait_seconds_total"] == 0
    assert rm.cache_manager._seconds_per_page > 0  # measured, for the next estimate


def test_a_copy_over_the_inline_budget_still_waits_in_the_loading_state(make_config):
    rm, pool, tier = scheduler(make_config)
    rm.cache_manager.inline_load_seconds = 1e-3
    rm.cache_manager._seconds_per_page = 1.0  # as if a page had taken a second: ten pages are over budget
    before = evicted_to_tier(rm, pool)
    b = add(rm, "b", NEXT_TURN)
    step(rm, pool, before)
    assert b.kv_loading and rm.tier_loads_pending
    finish(rm, pool, before)
    assert rm.stats()["host_cache_load_wait_seconds_total"] > 0
