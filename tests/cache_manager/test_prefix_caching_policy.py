"""Prefix cache: hits, refcounts, the head-wise hit-validity rule and the eviction policy.

Driven through ResourceManagerV1 with a fake model step (tokens marked computed, a fixed token
sampled), so pages are registered, shared, recycled and evicted exactly as in the engine.
"""

import pytest

from fastdeploy.cache_manager.head_wise import first_window_block
from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.driver import fake_step
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

BS = 16
# The tiny preset's SWA spec: head 0 slides with window 128 and a 16-token sink (one sink block).
WINDOW, SINK = 128, 16


def tokens(n, seed=0):
    return [3 + (i * 37 + seed * 101 + (i * i) % 23) % 250 for i in range(n)]


def request(rid, prompt, max_tokens=4):
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=2)


def step(rm):
    return fake_step(rm, check=True)


def run(rm, *requests):
    for r in requests:
        rm.add_request(r)
    starts = {}
    while rm.has_unfinished_requests():
        for s in step(rm).requests:
            starts.setdefault(s.request.request_id, s.start)
    return starts


def manager(make_config, mode="head_wise_recycle_on", blocks=128, **kwargs):
    kwargs.setdefault("max_num_batched_tokens", 512)
    return ResourceManagerV1(make_config(mode, num_gpu_blocks_override=blocks, **kwargs))


def cached_path(rm, prompt):
    """The cached path a new request with this prompt would hit (validity rule applied)."""
    return rm.kv_cache_manager.match_prefix(request("probe", prompt))


def evict(rm, node, head):
    """Tombstone one head's page of a cached block, as eviction would."""
    cache = rm.cache_manager.prefix_cache
    page = node.pages[head]
    cache._evict_page(cache.slot_rank[head], page, node, head)


# -- 1-D semantics ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_off", "head_wise_recycle_on"])
def test_second_request_starts_after_the_shared_full_blocks(make_config, mode):
    rm = manager(make_config, mode)
    prompt = tokens(40)
    assert run(rm, request("a", prompt)) == {"a": 0}
    # 40 tokens = 2 full blocks + a partial one; the partial block is never shared.
    assert run(rm, request("b", prompt + [5, 6])) == {"b": 32}
    s = rm.stats()
    assert s["prefix_cache_hit_tokens_total"] == 32 and s["prefix_cache_query_tokens_total"] == 40 + 42


def test_a_hit_covering_the_whole_prompt_backs_off_one_block(make_config):
    rm = manager(make_config, "1d")
    prompt = tokens(48)  # exactly 3 blocks: at least the last token must be computed
    run(rm, request("a", prompt))
    assert run(rm, request("b", prompt)) == {"b": 32}


def test_shared_blocks_are_refcounted_and_released_pages_stay_cached(make_config):
    rm = manager(make_config, "1d", blocks=16)
    prompt = tokens(64)
    rm.add_request(request("a", prompt, max_tokens=20))
    step(rm)
    rm.add_request(request("b", prompt, max_tokens=20))
    step(rm)
    (a,), (b,) = rm.kv_cache_manager.table("a"), rm.kv_cache_manager.table("b")
    assert a[:3] == b[:3]  # shared blocks, one copy
    assert a[3] != b[3]    # b computed its last block itself
    rm.abort_request("a")
    rm.check_integrity()  # b still references the shared blocks
    assert rm.cache_manager.references(0, b[0]) == {"b"}
    rm.abort_request("b")
    cm = rm.cache_manager
    assert cm.num_free_pages == cm.num_total_pages  # cached but unreferenced pages are available
    assert cm.prefix_cache_stats()["prefix_cache_cached_pages"] > 0
    cm.clear_prefix_cache()
    assert cm.prefix_cache_stats()["prefix_cache_cached_pages"] == 0
    assert cm.num_free_pages == cm.num_total_pages
    cm.check_integrity()


def test_allocation_evicts_least_recently_released_blocks_first(make_config):
    rm = manager(make_config, "1d", blocks=12, max_model_len=256)
    old, new = tokens(64, seed=1), tokens(64, seed=2)
    run(rm, request("old", old))   # 4 full blocks cached (64 prompt + 3 outputs computed)
    run(rm, request("new", new))   # 4 more; 8 of 12 blocks cached, all unreferenced
    run(rm, request("big", tokens(96, seed=3), max_tokens=40))  # needs 9 blocks: evicts 5
    stats = rm.stats()
    assert stats["prefix_cache_evictions_total"] > 0
    assert len(cached_path(rm, old)) == 0          # the older prefix went first ...
    assert len(cached_path(rm, new)) == 3          # ... the newer one survived
    rm.check_integrity()


def test_preempted_request_resumes_from_its_own_cached_blocks(make_config):
    rm = manager(make_config, "head_wise_recycle_on", reserve=False, blocks=18, max_num_batched_tokens=64)
    for i in range(3):
        rm.add_request(request(f"r{i}", tokens(40, seed=i), max_tokens=60))
    victim = None
    while victim is None:
        batch = step(rm)
        victim = batch.preempted[0] if batch.preempted else None
    while victim.status.value != "running":
        batch = step(rm)
    first = next(s for s in batch.requests if s.request is victim)
    assert first.start > 0 and first.start % BS == 0
    while rm.has_unfinished_requests():
        step(rm)
    assert len(victim.output_token_ids) == 60


# -- head-wise hit validity (docs/retention_rule.md) ---------------------------------------------
@pytest.fixture
def long_prefix(make_config):
    """A finished 300-token request: 18 full blocks cached; a repeat may hit all 18 (query at 288)."""
    rm = manager(make_config, "head_wise_recycle_on")
    prompt = tokens(300)
    run(rm, request("a", prompt, max_tokens=1))
    path = cached_path(rm, prompt)
    assert len(path) == 18 and first_window_block(288, WINDOW, BS) == 10
    return rm, prompt, path


def test_hit_survives_when_only_out_of_window_swa_pages_are_gone(long_prefix):
    rm, prompt, path = long_prefix
    for i in (1, 5, 9):  # dead for a query at 288: blocks [1, 10) of the SWA head
        evict(rm, path[i], 0)
    assert len(cached_path(rm, prompt)) == 18
    assert run(rm, request("b", prompt)) == {"b": 288}


def test_hit_shrinks_when_a_swa_window_page_is_gone(long_prefix):
    rm, prompt, path = long_prefix
    evict(rm, path[12], 0)  # visible from 288: the hit must stop before block 12
    # n = 12: the query at 192 sees SWA blocks [first_window_block(192) = 4, 12) and the sink: all held.
    assert len(cached_path(rm, prompt)) == 12
    assert run(rm, request("b", prompt)) == {"b": 192}


def test_hit_shrinks_past_a_missing_window_page_to_a_valid_depth(long_prefix):
    rm, prompt, path = long_prefix
    evict(rm, path[12], 0)
    evict(rm, path[8], 0)   # inside the window of a 12-block hit too; a 8-block hit sees [0, 8)
    assert len(cached_path(rm, prompt)) == 8


def test_missing_sink_or_full_head_pages_bound_the_hit(long_prefix):
    rm, prompt, path = long_prefix
    evict(rm, path[7], 2)   # full head: nothing at or beyond block 7 can be used
    assert len(cached_path(rm, prompt)) == 7
    evict(rm, path[0], 0)   # the SWA head's sink block: every query sees it
    assert cached_path(rm, prompt) == []


def test_hit_rows_match_what_the_recycler_would_have_left(long_prefix):
    rm, prompt, _ = long_prefix
    rm.add_request(request("b", prompt, max_tokens=3))
    step(rm)
    table = rm.kv_cache_manager.table("b")
    assert [i for i, p in enumerate(table[0]) if p == -1] == list(range(1, 10))
    assert all(-1 not in row for row in table[1:])
    assert rm.kv_cache_manager.recycled_upto("b") == [10]
    while rm.has_unfinished_requests():
        step(rm)


# -- eviction policy --------------------------------------------------------------------------------
def test_stale_swa_pages_are_evicted_before_any_block_of_a_cached_prefix(make_config):
    rm = manager(make_config, "head_wise_recycle_on", blocks=40, max_model_len=640)
    prompt = tokens(300)
    run(rm, request("a", prompt, max_tokens=1))
    cache = rm.cache_manager.prefix_cache
    free = rm.cache_manager.free_pages_per_rank()[0] - cache.num_evictable[0]
    assert cache.num_evictable[0] == 4 * 18  # everything of the finished request is cached
    # An unrelated 24-block request needs 96 pages, 8 more than are free. Stale SWA pages are the
    # SWA head's blocks 1..9 (outside the window of a hit at 288, not the sink): 8 of those go.
    assert free == 88
    rm.add_request(request("b", tokens(24 * BS - 8, seed=7), max_tokens=1))
    step(rm)
    assert cache.evictions_total == 8
    path = cached_path(rm, prompt)
    assert len(path) == 18, "the prefix lost pages a hit needs"
    gone = [(n.depth, h) for n in path for h, p in enumerate(n.pages) if p == -1]
    assert len(gone) == 8 and all(h == 0 and 1 <= d <= 9 for d, h in gone)
    while rm.has_unfinished_requests():
        step(rm)


def test_whole_leaves_go_tail_first_so_the_shared_prefix_lasts(make_config):
    rm = manager(make_config, "1d", blocks=14, max_model_len=640)
    prompt = tokens(160)
    run(rm, request("a", prompt, max_tokens=1))  # 10 blocks cached
    run(rm, request("b", tokens(60, seed=5), max_tokens=40))  # needs 7 blocks: 4 free + 3 evicted
    assert len(cached_path(rm, prompt)) == 7  # the chain lost its last 3 blocks, not its head


def test_branch_point_keeps_the_system_prompt_window_over_branch_tails(make_config):
    rm = manager(make_config, "head_wise_recycle_on", blocks=60, max_model_len=640)
    system = tokens(200)  # 12 full blocks + 8 tokens; requests diverge inside block 12
    for i in range(2):
        run(rm, request(f"u{i}", system + tokens(160, seed=10 + i), max_tokens=1))
    cache = rm.cache_manager.prefix_cache
    branch = cached_path(rm, system + [1] * 20)
    assert len(branch) == 12 and len(branch[-1].children) == 2
    # Pressure: evict every stale SWA page (those outside the window of the branch point and leaves).
    stale = [n for n in _nodes(cache) if n.pages[0] >= 0 and n.depth >= 1 and n.protect == 0]
    cache.evict(0, len(stale))
    assert len(cached_path(rm, system + tokens(40, seed=99))) == 12  # a third user still hits the prompt
    assert all(branch[i].pages[0] >= 0 for i in range(first_window_block(192, WINDOW, BS), 12))
    assert any(n.pages[0] == -1 for n in _nodes(cache) if n.depth > 12), "branch tails kept their stale pages"
    rm.check_integrity()


def test_running_request_swa_pages_outside_its_window_are_reclaimable(make_config):
    # The vLLM #48435 problem: with prefix caching, recycled SWA pages must still serve other requests.
    rm = manager(make_config, "head_wise_recycle_on", blocks=64, max_model_len=1024)
    rm.add_request(request("long", tokens(600), max_tokens=50))
    for _ in range(5):
        step(rm)
    upto, = rm.kv_cache_manager.recycled_upto("long")
    assert upto > 20
    stats = rm.stats()
    assert stats["prefix_cache_evictable_pages"] >= upto - 1  # dead SWA pages: reclaimable
    cache = rm.cache_manager.prefix_cache
    cache.evict(0, upto - 1)
    # Only SWA pages went; every full-head page of the running request is intact and still referenced.
    assert all(p >= 0 for row in rm.kv_cache_manager.table("long")[1:] for p in row)
    rm.check_integrity()
    while rm.has_unfinished_requests():
        step(rm)


def _nodes(cache):
    out, stack = [], [cache.root]
    while stack:
        node = stack.pop()
        out.extend(node.children.values())
        stack.extend(node.children.values())
    return out


# -- integrity checks catch broken bookkeeping ------------------------------------------------------
@pytest.mark.parametrize("corrupt,message", [
    (lambda cm, page, node: cm._pools[0].holders[page].discard("b"), "3 referenced pages, counter says 4"),
    (lambda cm, page, node: cm._pools[0].holders[page].add("ghost"), "references"),
    (lambda cm, page, node: setattr(node, "num_referenced", node.num_referenced + 1), "referenced pages"),
    (lambda cm, page, node: setattr(node, "protect", node.protect + 1), "protect"),
    (lambda cm, page, node: node.pages.__setitem__(1, -1), "tombstones per column|referenced pages|reachable in the trie"),
])
def test_check_integrity_catches_broken_refcounts_anchors_and_tombstones(make_config, corrupt, message):
    rm = manager(make_config, "head_wise_recycle_on")
    prompt = tokens(300)
    run(rm, request("a", prompt, max_tokens=1))
    rm.add_request(request("b", prompt, max_tokens=5))
    step(rm)
    node = cached_path(rm, prompt)[-1]
    corrupt(rm.cache_manager, node.pages[2], node)
    with pytest.raises(AssertionError, match=message):
        rm.check_integrity()


@pytest.mark.parametrize("donate", [True, False], ids=["recycled", "finished"])
def test_a_duplicate_copy_fills_the_window_pages_the_first_copy_lost_before_the_branch_existed(make_config, donate):
    # Two users of one system prompt compute it at the same time (neither can hit the other's blocks yet).
    # The first one's pages are the cached copy; its window pages of the prompt's tail fall out of *its*
    # window and are evicted as stale before the second user's first own block makes the prompt's end a
    # branch point. The second user's private copies of those pages must then fill the tombstones when it
    # lets them go (recycled, or freed when it finishes), or no later user could ever hit the prompt.
    rm = manager(make_config, "head_wise_recycle_on", blocks=120, max_model_len=640, max_num_batched_tokens=512)
    system = tokens(200)  # 12 full blocks + 8 tokens; the users diverge inside block 12
    u0 = request("u0", system + tokens(160, seed=10), max_tokens=1)
    u1 = request("u1", system + tokens(160 if donate else 8, seed=11), max_tokens=1)
    rm.add_request(u0)
    rm.add_request(u1)
    step(rm)  # u0: its whole prompt (22 blocks cached); u1: 152 tokens (blocks 0..8, private copies)
    rm.kv_cache_manager.recycle()  # u0's head-0 blocks 1..13 leave its window: stale, no branch yet
    cache = rm.cache_manager.prefix_cache
    cache.evict(0, sum(1 for n in _nodes(cache) if n.pages[0] >= 0 and n.depth >= 1 and n.protect == 0))
    while rm.has_unfinished_requests():
        step(rm)
    branch = cached_path(rm, system + tokens(40, seed=99))  # a third user
    assert len(branch) == 12, "the system prompt's window pages were lost: no user can hit it again"
    assert all(branch[i].pages[0] >= 0 for i in range(first_window_block(12 * BS, WINDOW, BS), 12))
    rm.check_integrity()
