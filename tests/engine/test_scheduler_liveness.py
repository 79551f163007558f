"""Liveness: every admitted request finishes; the cache is never idle while a request waits.

The reproduction of issue 13: with on-demand admission a request preempted late in its decode came
back as one recompute chunk of prompt + outputs that needed more pages than the whole cache (at
position 0 nothing is dead, so its SWA head needs every page), and it was released and retried on
an idle cache forever. Chunks are now bounded by the page-need function, so they always fit.
"""

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastdeploy.cache_manager.head_wise import PageLayout
from fastdeploy.cache_manager.slots import AttentionType
from fastdeploy.envs import override
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

POLICIES = ("reserve", "on_demand", "projected")
EOS = 2
MODES = {"1d": ("0", "1"), "head_wise_recycle_off": ("1", "0"), "head_wise_recycle_on": ("1", "1")}


def config(policy, mode="head_wise_recycle_on", **kwargs):
    head_wise, recycle = MODES[mode]
    # The legacy flag too, so the same test runs on an engine that predates FD_ADMISSION_POLICY.
    legacy = "0" if policy == "on_demand" else "1"
    with override(FD_HEAD_WISE_KV_CACHE=head_wise, FD_HEAD_WISE_SWA_RECYCLE=recycle, FD_ADMISSION_POLICY=policy,
             FD_RESERVE_OUTPUT_PAGES=legacy):
        return EngineArgs(**kwargs).create_engine_config()


def issue_13_config(policy, prefix_caching):
    """Head-wise, recycling on, block 16, 30 blocks (120 pages), W 16, S 0, SWA head [0], chunk 2048."""
    return config(policy, block_size=16, num_gpu_blocks_override=30, max_num_batched_tokens=2048,
                  max_model_len=1024, enable_prefix_caching=prefix_caching,
                  head_wise_swa_config={"sliding_window": 16, "sink_size": 0, "swa_kv_heads": [0]})


def issue_13_requests():
    params = dict(ignore_eos=True)
    return [("X", list(range(3, 13)), SamplingParams(max_tokens=500, **params)),
            ("A", [3 + i % 200 for i in range(400)], SamplingParams(max_tokens=200, **params))]


def fake_step(rm, sample=lambda request: 9):
    """schedule(); fail if the cache is idle while requests wait; advance with sampled tokens."""
    batch = rm.schedule()
    if not rm.running and rm.waiting:
        raise AssertionError(f"idle cache, waiting {list(rm.waiting)}: {rm.cache_manager.num_free_pages} of "
                             f"{rm.cache_manager.num_total_pages} pages free")
    rm.update_from_output(batch, [sample(s.request) if s.samples else None for s in batch.requests])
    rm.check_integrity()
    return batch


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_issue_13_reproduction_finishes_both_requests_in_the_scheduler(policy, prefix_caching):
    rm = ResourceManagerV1(issue_13_config(policy, prefix_caching))
    reqs = [Request(rid, ids, p, eos_token_id=EOS) for rid, ids, p in issue_13_requests()]
    for r in reqs:
        rm.add_request(r)
    for _ in range(3000):
        if not rm.has_unfinished_requests():
            break
        fake_step(rm)
    assert not rm.has_unfinished_requests(), (rm.running, list(rm.waiting))
    assert [len(r.output_token_ids) for r in reqs] == [500, 200]
    assert rm.cache_manager.num_free_pages == rm.cache_manager.num_total_pages
    if policy == "on_demand":
        assert rm.num_preemptions_total >= 1  # the scenario does preempt A late in its decode
        assert rm.recomputed_tokens_total > 400  # ...which recomputes its prompt and outputs
        from fastdeploy.entrypoints.openai.metrics import ServerMetrics, parse_prometheus_text

        scraped = parse_prometheus_text(ServerMetrics().render(rm.stats(), 0))
        assert scraped["fastdeploy:recomputed_tokens_total"] == rm.recomputed_tokens_total
    else:
        assert rm.num_preemptions_total == 0 and rm.recomputed_tokens_total == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_issue_13_reproduction_finishes_through_the_engine(prefix_caching):
    from fastdeploy.engine.engine import LLMEngine

    with override(FD_ATTENTION_BACKEND="APPEND_ATTN"):
        engine = LLMEngine(issue_13_config("on_demand", prefix_caching))
    for rid, ids, params in issue_13_requests():
        engine.add_request(rid, ids, params)
    lengths = {}
    for _ in range(3000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                lengths[out.request_id] = len(out.outputs.token_ids)
    assert lengths == {"X": 500, "A": 200}
    assert engine.scheduler.num_preemptions_total >= 1


def test_a_recompute_chunk_is_capped_to_what_the_cache_holds():
    """The reproduction's failing step: A re-admitted after its preemption recomputes in chunks that fit."""
    rm = ResourceManagerV1(issue_13_config("on_demand", False))
    reqs = [Request(rid, ids, p, eos_token_id=EOS) for rid, ids, p in issue_13_requests()]
    for r in reqs:
        rm.add_request(r)
    a = reqs[1]
    while a.num_preemptions == 0:
        fake_step(rm)
    while True:
        batch = fake_step(rm)
        chunk = next((s for s in batch.requests if s.request is a), None)
        if chunk is not None:
            break
    assert chunk.start == 0 and max(rm.layout.pages_per_rank(0, a.num_tokens)) > rm.pages_per_rank
    assert 0 < chunk.num_tokens < a.num_tokens  # one chunk of prompt + outputs would not fit...
    assert max(rm.layout.pages_per_rank(0, chunk.num_tokens)) <= rm.pages_per_rank  # ...this one does


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.integers(1, 8), st.sampled_from([1, 2, 4]), st.integers(1, 3), st.integers(1, 40), st.integers(0, 20),
       st.integers(0, 200), st.integers(0, 300), st.lists(st.integers(0, 200), min_size=2, max_size=2))
def test_largest_chunk_within_is_the_largest_chunk_that_fits(bs, heads, n_swa, window, sink, n, num_new, limits):
    tp = 2 if heads >= 2 else 1
    layout = PageLayout(bs, heads, tp, ((AttentionType(window, sink), tuple(range(min(n_swa, heads)))),), True)
    limit = limits[:tp]
    c = layout.largest_chunk_within(n, num_new, limit)
    fits = [k for k in range(num_new + 1) if all(p <= lim for p, lim in zip(layout.pages_per_rank(n, k), limit))]
    assert c == (max(fits) if fits else 0)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(1, 8), st.sampled_from([1, 2, 4]), st.integers(1, 40), st.integers(0, 20),
       st.integers(1, 120), st.integers(1, 120), st.integers(1, 130))
def test_one_token_steps_never_exceed_the_lifetime_peak(bs, heads, window, sink, prompt, max_new, chunk):
    """So a chunk capped to the cache is never empty once add_request accepted the request."""
    layout = PageLayout(bs, heads, 1, ((AttentionType(window, sink), (0,)),), True)
    peak = layout.peak_pages_per_rank(prompt, max_new, chunk)
    for n in range(prompt + max_new - 1):
        assert layout.pages_per_rank(n, 1)[0] <= peak[0]
        # and the projection's bound holds at every one-token step
        f, r = layout.rank_head_counts()[0]
        assert bs * layout.pages_per_rank(n, 1)[0] <= f * (n + bs) + r * layout.recycling_bounds(
            prompt + max_new - 2)[0]


# -- the progress property over random workloads -----------------------------------------------
job = st.tuples(
    st.integers(1, 70),    # prompt length
    st.integers(1, 120),   # max_tokens
    st.integers(0, 8),     # arrival step
    st.integers(0, 3),     # prompt family: requests of one family share a prefix
    st.sampled_from([None, None, 3, 12]),  # abort this many steps after arrival
    st.sampled_from([None, None, 5, 17]),  # sample EOS after this many outputs
)
engine_shape = st.fixed_dictionaries({
    "block_size": st.sampled_from([3, 4, 8]),
    "window": st.integers(1, 30),
    "sink": st.integers(0, 9),
    "chunk": st.sampled_from([1, 2, 5, 16, 64, 256]),
    "blocks": st.integers(6, 40),
    "prefix_caching": st.booleans(),
    "swa_heads": st.sampled_from([[0], [0, 3], [0, 1, 2, 3]]),
    "max_num_seqs": st.integers(1, 6),
})


def run_workload(cfg, jobs, seed):
    rng = random.Random(seed)
    rm = ResourceManagerV1(cfg)
    families = [[rng.randrange(3, 250) for _ in range(300)] for _ in range(4)]
    eos_after = {}
    pending = list(enumerate(jobs))
    total_tokens = sum(p + m for p, m, *_ in jobs)

    def sample(request):
        after = eos_after.get(request.request_id)
        return EOS if after is not None and len(request.output_token_ids) + 1 >= after else 9

    for t in range(20 * total_tokens + 200):
        for item in list(pending):
            i, (plen, max_tokens, arrive, family, abort, eos) = item
            if arrive <= t:
                pending.remove(item)
                ids = families[family][:plen // 2] + [rng.randrange(3, 250) for _ in range(plen - plen // 2)]
                req = Request(f"r{i}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=eos is None),
                              eos_token_id=EOS)
                eos_after[req.request_id] = eos
                try:
                    rm.add_request(req)
                except ValueError:
                    pass  # could never fit this cache: rejected up front, never admitted
        for i, (plen, max_tokens, arrive, family, abort, eos) in enumerate(jobs):
            if abort is not None and t == arrive + abort:
                rm.abort_request(f"r{i}")
        fake_step(rm, sample)
        if not pending and not rm.has_unfinished_requests():
            break
    else:
        raise AssertionError(f"no progress: running {rm.running}, waiting {list(rm.waiting)}")
    cm = rm.cache_manager
    cm.clear_prefix_cache()
    assert cm.num_free_pages == cm.num_total_pages
    return rm


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode,tp", [("head_wise_recycle_on", 1), ("head_wise_recycle_on", 2),
                                     ("head_wise_recycle_off", 1), ("1d", 1)])
def test_random_workloads_always_progress(policy, mode, tp):
    @settings(max_examples=60 if mode == "head_wise_recycle_on" else 8, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(engine_shape, st.lists(job, min_size=1, max_size=10), st.integers(0, 2 ** 16))
    def run(shape, jobs, seed):
        cfg = config(policy, mode, block_size=shape["block_size"], num_gpu_blocks_override=shape["blocks"],
                     max_num_batched_tokens=shape["chunk"], max_num_seqs=shape["max_num_seqs"],
                     max_model_len=256, tensor_parallel_size=tp, enable_prefix_caching=shape["prefix_caching"],
                     head_wise_swa_config={"sliding_window": shape["window"], "sink_size": shape["sink"],
                                           "swa_kv_heads": shape["swa_heads"]})
        rm = run_workload(cfg, jobs, seed)
        if policy != "on_demand":  # neither reservation policy ever preempts a request it admitted
            assert rm.num_preemptions_total == 0 and rm.recomputed_tokens_total == 0

    run()


@pytest.mark.parametrize("policy", POLICIES)
def test_tight_caches_with_a_late_preemption_always_progress(policy):
    """The reproduction's family: a short prompt that decodes long beside a long prompt, in a cache
    barely larger than their peaks, with whole-prompt chunks (so a recompute chunk can exceed it)."""
    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(st.sampled_from([4, 8, 16]), st.integers(1, 40), st.integers(0, 9), st.integers(1, 20),
           st.integers(50, 300), st.integers(50, 300), st.integers(20, 200), st.integers(0, 3), st.booleans())
    def run(bs, window, sink, px, mx, pa, ma, extra, prefix_caching):
        swa = {"sliding_window": window, "sink_size": sink, "swa_kv_heads": [0]}
        layout = PageLayout(bs, 4, 1, ((AttentionType(window, sink), (0,)),), True)
        peak = max(max(layout.peak_pages_per_rank(p, m, 2048)) for p, m in ((px, mx), (pa, ma)))
        cfg = config(policy, block_size=bs, num_gpu_blocks_override=-(-peak // 4) + extra, max_model_len=640,
                     max_num_batched_tokens=2048, enable_prefix_caching=prefix_caching, head_wise_swa_config=swa)
        rm = run_workload(cfg, [(px, mx, 0, 0, None, None), (pa, ma, 1, 1, None, None)], 0)
        if policy != "on_demand":
            assert rm.num_preemptions_total == 0

    run()


@pytest.mark.parametrize("mode,tp", [("1d", 1), ("head_wise_recycle_on", 1), ("head_wise_recycle_on", 2)])
def test_projected_admission_never_preempts_while_decodes_grow(mode, tp):
    """Staggered requests with long outputs in a small cache: full heads keep growing through decode,
    so admitting on today's free pages alone would overcommit; the projected curves must not."""
    @settings(max_examples=25, deadline=None, derandomize=True)
    @given(st.sampled_from([2, 4, 8]), st.integers(8, 30), st.integers(1, 40),
           st.lists(st.tuples(st.integers(1, 30), st.integers(20, 150), st.integers(0, 120)), min_size=2, max_size=12))
    def run(bs, blocks, window, jobs):
        cfg = config("projected", mode, block_size=bs, num_gpu_blocks_override=blocks, max_num_batched_tokens=32,
                     max_num_seqs=16, max_model_len=256, tensor_parallel_size=tp, enable_prefix_caching=False,
                     head_wise_swa_config={"sliding_window": window, "sink_size": 1, "swa_kv_heads": [0, 3]})
        rm = run_workload(cfg, [(p, m, t, 0, None, None) for p, m, t in jobs], 0)
        assert rm.num_preemptions_total == 0

    run()


# -- several sliding types, each recycling with its own window and sink (design §17) ---------------------
def several_types_layout(bs, heads, tp, types):
    """A PageLayout whose slot h < len(types) slides with types[h] (window, sink); the rest keep every page."""
    from fastdeploy.cache_manager.slots import AttentionType

    groups = {}
    for h, (window, sink) in enumerate(types[:heads]):
        groups.setdefault(AttentionType(window, sink), []).append(h)
    return PageLayout(bs, heads, tp, recycle=True, sliding=tuple((k, tuple(v)) for k, v in groups.items()))


sliding_types = st.lists(st.tuples(st.integers(1, 40), st.integers(0, 20)), min_size=2, max_size=4)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.integers(1, 8), st.sampled_from([2, 4]), sliding_types, st.integers(0, 200), st.integers(0, 300),
       st.lists(st.integers(0, 200), min_size=2, max_size=2))
def test_largest_chunk_within_is_the_largest_chunk_that_fits_with_several_sliding_types(bs, heads, types, n, num_new,
                                                                                       limits):
    tp = 2 if heads >= 2 else 1
    layout = several_types_layout(bs, heads, tp, types)
    limit = limits[:tp]
    c = layout.largest_chunk_within(n, num_new, limit)
    fits = [k for k in range(num_new + 1) if all(p <= lim for p, lim in zip(layout.pages_per_rank(n, k), limit))]
    assert c == (max(fits) if fits else 0)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.integers(1, 8), sliding_types, st.integers(1, 120), st.integers(1, 120), st.integers(1, 130))
def test_one_token_steps_with_several_sliding_types_stay_under_the_peak_and_the_projection_bound(
        bs, types, prompt, max_new, chunk):
    """Each type's pages are counted by its own window: the sum over types never exceeds the lifetime peak
    (add_request's check) nor the projection's linear bound f * (n + bs) + sum_k r_k * y_k."""
    layout = several_types_layout(bs, 4, 1, types)
    peak = layout.peak_pages_per_rank(prompt, max_new, chunk)
    counts = layout.rank_head_counts()[0]
    bounds = layout.recycling_bounds(prompt + max_new - 2)
    for n in range(prompt + max_new - 1):
        need = layout.pages_needed(n, 1)
        assert layout.pages_per_rank(n, 1)[0] == sum(c * p for c, p in zip(counts, need)) <= peak[0]
        assert bs * layout.pages_per_rank(n, 1)[0] <= counts[0] * (n + bs) + sum(
            r * y for r, y in zip(counts[1:], bounds))
        for k, (kind, _) in enumerate(layout.sliding):  # each type's column follows its own retention rule
            from fastdeploy.cache_manager.head_wise import num_dead_blocks, table_length

            assert need[1 + k] == table_length(n + 1, bs) - num_dead_blocks(n, kind.window, kind.sink, bs)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("tp", [1, 2])
def test_random_workloads_with_several_sliding_types_always_progress(policy, tp):
    """Admission with several recycling types neither deadlocks (an idle cache with a waiting request
    fails fake_step) nor over-admits (the reservation policies never preempt; check_integrity runs
    the projection's fit every step)."""
    several = []

    @settings(max_examples=20, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
    @given(engine_shape, st.lists(st.tuples(st.integers(1, 30), st.integers(0, 9)), min_size=4, max_size=4),
           st.lists(job, min_size=1, max_size=10), st.integers(0, 2 ** 16))
    def run(shape, types, jobs, seed):
        heads = [h for h in range(4) if h in shape["swa_heads"] or h == 1]
        spec = {"sliding_window": 8, "sink_size": 0, "swa_kv_heads": [heads, [0, 3]],
                "head_windows": [[types[h][0] for h in heads], [types[0][0], shape["window"]]],
                "head_sinks": [[types[h][1] for h in heads], [types[0][1], shape["sink"]]]}
        cfg = config(policy, block_size=shape["block_size"], num_gpu_blocks_override=shape["blocks"],
                     max_num_batched_tokens=shape["chunk"], max_num_seqs=shape["max_num_seqs"], max_model_len=256,
                     tensor_parallel_size=tp, enable_prefix_caching=shape["prefix_caching"], head_wise_swa_config=spec)
        rm = run_workload(cfg, jobs, seed)
        several.append(len(rm.layout.recycling_groups) > 1)
        if policy != "on_demand":
            assert rm.num_preemptions_total == 0 and rm.recomputed_tokens_total == 0

    run()
    assert sum(several) > len(several) // 2  # most examples recycle several types at once
