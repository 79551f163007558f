"""ResourceManagerV1 driven by a fake step that only marks tokens computed (no model)."""

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastdeploy.cache_manager.head_wise import dead_block_range, predicted_concurrency
from fastdeploy.engine.request import Request, RequestStatus, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

SWA = {"sliding_window": 20, "sink_size": 5, "swa_kv_heads": [0]}
EOS = 2


def request(rid, prompt_len, max_tokens, **params):
    params.setdefault("ignore_eos", True)
    return Request(rid, [7] * prompt_len, SamplingParams(max_tokens=max_tokens, **params), eos_token_id=EOS)


def step(rm, token=9):
    """One scheduler step with a model that samples `token` wherever a chunk ends a request."""
    batch = rm.schedule()
    assert_no_dead_page_held(rm)
    rm.update_from_output(batch, [token if s.samples else None for s in batch.requests])
    rm.check_integrity()
    return batch


def assert_no_dead_page_held(rm):
    """Right after schedule(), every running request has returned every page that left its window."""
    groups = rm.layout.recycling_groups
    if not groups:
        return
    (kind, _), = groups
    for r in rm.running:
        dead = dead_block_range(r.num_computed_tokens, kind.window, kind.sink, rm.block_size)
        upto = rm.kv_cache_manager.recycled_upto(r.request_id)
        assert upto == [dead.stop], (r.request_id, upto, dead)


def run_to_completion(rm, limit=100_000):
    for _ in range(limit):
        if not rm.has_unfinished_requests():
            return
        step(rm)
    raise AssertionError("scheduler did not finish its requests")


def test_recycle_writes_minus_one_for_dead_swa_blocks_only(make_config):
    cfg = make_config(num_gpu_blocks_override=64, head_wise_swa_config=SWA, max_num_batched_tokens=64)
    rm = ResourceManagerV1(cfg)
    rm.add_request(request("a", 60, 30))
    step(rm)  # prefill 60 tokens; nothing dead yet on the processed basis (n=0 before the step)
    row = rm.kv_cache_manager.table("a")
    assert -1 not in row[0]
    step(rm)  # n=60 now: blocks [1, (60-20+1)//16) = [1, 2) of head 0 are dead
    assert row[0][1] == -1 and row[0][0] != -1 and row[0][2] != -1
    assert all(-1 not in r for r in row[1:])
    assert rm.kv_cache_manager.swa_pages_recycled_total == 1


def test_full_heads_reuse_pages_recycled_by_the_swa_head(make_config):
    # 5 blocks = 5 pages per head list. The request caches 96 tokens = 6 pages per full head, so it
    # fits only because the SWA head's out-of-window pages are recycled first and then borrowed.
    spec = {"sliding_window": 8, "sink_size": 0, "swa_kv_heads": [0]}
    kwargs = dict(num_gpu_blocks_override=5, head_wise_swa_config=spec, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="needs up to 24 KV pages"):
        ResourceManagerV1(make_config("head_wise_recycle_off", **kwargs)).add_request(request("a", 64, 33))
    rm = ResourceManagerV1(make_config("head_wise_recycle_on", **kwargs))
    req = request("a", 64, 33)
    rm.add_request(req)
    borrowed = set()
    while rm.has_unfinished_requests():
        step(rm)
        if rm.kv_cache_manager.holds("a"):
            borrowed.update(p for row in rm.kv_cache_manager.table("a")[1:] for p in row if p % 4 == 0)
    assert len(req.output_token_ids) == 33
    assert borrowed, "full heads never used a page from the SWA head's list"
    assert rm.kv_cache_manager.swa_pages_recycled_total >= 5


def test_recycle_off_keeps_swa_pages_until_the_request_ends(make_config):
    cfg = make_config("head_wise_recycle_off", num_gpu_blocks_override=64, head_wise_swa_config=SWA)
    rm = ResourceManagerV1(cfg)
    rm.add_request(request("a", 100, 20))
    for _ in range(10):
        step(rm)
    assert all(-1 not in row for row in rm.kv_cache_manager.table("a"))
    assert rm.kv_cache_manager.swa_pages_recycled_total == 0


def test_chunked_prefill_respects_the_token_budget(make_config):
    cfg = make_config(num_gpu_blocks_override=64, head_wise_swa_config=SWA, max_num_batched_tokens=32)
    rm = ResourceManagerV1(cfg)
    rm.add_request(request("long", 100, 4))
    rm.add_request(request("short", 10, 4))
    sizes = []
    while rm.running or rm.waiting:
        batch = step(rm)
        assert batch.num_tokens <= 32
        sizes.append([(s.request.request_id, s.num_tokens) for s in batch.requests])
    assert sizes[:4] == [[("long", 32)], [("long", 32)], [("long", 32)], [("long", 4), ("short", 10)]]


def test_decodes_are_scheduled_before_new_prefills(make_config):
    cfg = make_config(num_gpu_blocks_override=64, head_wise_swa_config=SWA, max_num_batched_tokens=8)
    rm = ResourceManagerV1(cfg)
    rm.add_request(request("a", 4, 5))
    step(rm)
    rm.add_request(request("b", 20, 5))
    batch = step(rm)
    assert [(s.request.request_id, s.num_tokens) for s in batch.requests] == [("a", 1), ("b", 7)]


def test_max_num_seqs_limits_running_requests(make_config):
    cfg = make_config(num_gpu_blocks_override=256, head_wise_swa_config=SWA, max_num_seqs=3)
    rm = ResourceManagerV1(cfg)
    for i in range(6):
        rm.add_request(request(f"r{i}", 8, 3))
    step(rm)
    assert len(rm.running) == 3 and len(rm.waiting) == 3
    run_to_completion(rm)


@pytest.mark.parametrize("mode", ["1d", "head_wise_recycle_off", "head_wise_recycle_on"])
def test_on_demand_admission_preempts_the_latest_request_first(make_config, mode):
    # Without prefix caching: a re-admitted request must start at 0 for the admission bookkeeping below.
    cfg = make_config(mode, reserve=False, num_gpu_blocks_override=12, head_wise_swa_config=SWA,
                      max_num_batched_tokens=64, enable_prefix_caching=False)
    rm = ResourceManagerV1(cfg)
    for i in range(3):
        rm.add_request(request(f"r{i}", 40, 60))
    preempted, admitted_at = [], {}
    for t in range(500):
        if not rm.has_unfinished_requests():
            break
        running_before = {r.request_id: admitted_at[r.request_id] for r in rm.running}
        batch = step(rm)
        preempted += [r.request_id for r in batch.preempted]
        for victim in batch.preempted:
            # LIFO: a victim was admitted after every request that stays running.
            survivors = [admitted_at[r.request_id] for r in rm.running if r.request_id in running_before]
            assert all(running_before[victim.request_id] > s for s in survivors)
        for s in batch.requests:
            if s.start == 0:
                admitted_at[s.request.request_id] = len(admitted_at) + t * 1000
    assert not rm.has_unfinished_requests()
    assert preempted, "the page budget was meant to force preemption"
    assert rm.num_preemptions_total == len(preempted)
    assert preempted[0] == "r2"  # the last admitted goes first
    assert rm.cache_manager.num_free_pages == rm.cache_manager.num_total_pages


def test_preempted_request_recomputes_prompt_and_outputs(make_config):
    # Without prefix caching (with it, the victim resumes from its own cached blocks:
    # tests/cache_manager/test_prefix_caching_policy.py).
    cfg = make_config("head_wise_recycle_on", reserve=False, num_gpu_blocks_override=12,
                      head_wise_swa_config=SWA, max_num_batched_tokens=64, enable_prefix_caching=False)
    rm = ResourceManagerV1(cfg)
    reqs = [request(f"r{i}", 40, 60) for i in range(3)]
    for r in reqs:
        rm.add_request(r)
    victim = None
    while victim is None:
        batch = step(rm)
        victim = batch.preempted[0] if batch.preempted else None
    generated = len(victim.output_token_ids)
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    assert not rm.kv_cache_manager.holds(victim.request_id)
    while victim.status != RequestStatus.RUNNING:
        batch = step(rm)
    first = [s for s in batch.requests if s.request is victim][0]
    assert first.start == 0 and first.num_tokens > 0
    while len(victim.output_token_ids) == generated:  # recompute prompt + outputs before sampling again
        batch = step(rm)
    chunk = [s for s in batch.requests if s.request is victim][0]
    assert chunk.start + chunk.num_tokens == 40 + generated
    run_to_completion(rm)
    assert len(victim.output_token_ids) == 60


def test_reservation_admission_never_preempts(make_config):
    cfg = make_config(num_gpu_blocks_override=12, head_wise_swa_config=SWA, max_num_batched_tokens=64)
    rm = ResourceManagerV1(cfg)
    for i in range(5):
        rm.add_request(request(f"r{i}", 40, 60))
    run_to_completion(rm)
    assert rm.num_preemptions_total == 0


def test_abort_is_idempotent_and_frees_pages(make_config):
    cfg = make_config(num_gpu_blocks_override=64, head_wise_swa_config=SWA)
    rm = ResourceManagerV1(cfg)
    rm.add_request(request("a", 100, 50))
    rm.add_request(request("b", 10, 5))
    for _ in range(5):
        step(rm)
    assert rm.abort_request("a").status == RequestStatus.ABORTED
    assert rm.abort_request("a") is None
    assert rm.abort_request("never-existed") is None
    rm.check_integrity()
    run_to_completion(rm)
    assert rm.cache_manager.num_free_pages == rm.cache_manager.num_total_pages


def test_abort_of_a_waiting_request(make_config):
    cfg = make_config(num_gpu_blocks_override=64, head_wise_swa_config=SWA, max_num_seqs=1)
    rm = ResourceManagerV1(cfg)
    rm.add_request(request("a", 10, 5))
    rm.add_request(request("b", 10, 5))
    step(rm)
    assert rm.abort_request("b").finish_reason == "abort"
    run_to_completion(rm)


def test_stop_conditions_eos_min_tokens_and_length(make_config):
    cfg = make_config(num_gpu_blocks_override=64, head_wise_swa_config=SWA)
    rm = ResourceManagerV1(cfg)
    eos = request("eos", 5, 10, ignore_eos=False)
    held = request("min", 5, 10, ignore_eos=False, min_tokens=3)
    rm.add_request(eos)
    rm.add_request(held)
    for _ in range(4):
        batch = rm.schedule()
        rm.update_from_output(batch, [EOS if s.samples else None for s in batch.requests])
    assert eos.finish_reason == "stop" and len(eos.output_token_ids) == 1
    assert held.finish_reason == "stop" and len(held.output_token_ids) == 3
    length = request("len", 5, 2)
    rm.add_request(length)
    run_to_completion(rm)
    assert length.finish_reason == "length" and len(length.output_token_ids) == 2


def test_bad_requests_are_rejected_with_clear_errors(make_config):
    cfg = make_config(num_gpu_blocks_override=4, head_wise_swa_config=SWA, max_model_len=256)
    rm = ResourceManagerV1(cfg)
    with pytest.raises(ValueError, match="empty prompt"):
        rm.add_request(request("e", 0, 4))
    with pytest.raises(ValueError, match="max_tokens must be set"):
        rm.add_request(request("unbounded", 4, None))
    with pytest.raises(ValueError, match="exceeds max_model_len=256"):
        rm.add_request(request("long", 250, 10))
    with pytest.raises(ValueError, match="needs up to .* KV pages"):
        rm.add_request(request("huge", 200, 10))
    rm.add_request(request("ok", 8, 4))
    with pytest.raises(ValueError, match="already in use"):
        rm.add_request(request("ok", 8, 4))


def test_update_requires_a_token_where_a_chunk_ends(make_config):
    cfg = make_config(num_gpu_blocks_override=16, head_wise_swa_config=SWA)
    rm = ResourceManagerV1(cfg)
    rm.add_request(request("a", 8, 4))
    batch = rm.schedule()
    with pytest.raises(ValueError, match="no token was sampled"):
        rm.update_from_output(batch, [None])


# -- property-based: random arrivals, lengths, aborts, tight budgets, every mode -----------------
workload = st.lists(
    st.tuples(st.integers(1, 90), st.integers(1, 40), st.integers(0, 6), st.booleans()),
    min_size=1, max_size=12)


@pytest.mark.parametrize("mode,reserve,tp", [
    ("1d", False, 1), ("1d", True, 1),
    ("head_wise_recycle_off", False, 1), ("head_wise_recycle_on", False, 1),
    ("head_wise_recycle_on", True, 1), ("head_wise_recycle_on", False, 2), ("head_wise_recycle_on", True, 2),
])
def test_random_workloads_keep_integrity_and_free_everything(make_config, mode, reserve, tp):
    cfg = make_config(mode, reserve=reserve, num_gpu_blocks_override=14, tensor_parallel_size=tp,
                      max_num_batched_tokens=48, max_num_seqs=5,
                      head_wise_swa_config={"sliding_window": 13, "sink_size": 3, "swa_kv_heads": [0, 3]})

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(workload)
    def run(jobs):
        rm = ResourceManagerV1(cfg)
        pending = list(enumerate(jobs))
        for t in itertools.count():
            for i, (plen, out, arrive, abort) in list(pending):
                if arrive <= t:
                    pending.remove((i, (plen, out, arrive, abort)))
                    try:
                        rm.add_request(request(f"r{i}", plen, out))
                    except ValueError:
                        continue  # too big for this cache: rejected up front, never admitted
            for i, (plen, out, arrive, abort) in enumerate(jobs):
                if abort and t == arrive + 3:
                    rm.abort_request(f"r{i}")
            step(rm)
            if not pending and not rm.has_unfinished_requests():
                break
            assert t < 5000, "no progress"
        cm = rm.cache_manager
        assert cm.num_free_pages == cm.num_total_pages
        cm.check_integrity()

    run()


# -- capacity: peak running requests ON vs OFF matches the page-need prediction -------------------
@pytest.mark.parametrize("swa_heads", [[0], [0, 1, 2, 3]])
def test_peak_running_ratio_matches_prediction(make_config, swa_heads):
    spec = {"sliding_window": 32, "sink_size": 4, "swa_kv_heads": swa_heads}
    kwargs = dict(num_gpu_blocks_override=160, head_wise_swa_config=spec, max_num_seqs=64,
                  max_num_batched_tokens=64, max_model_len=1024)
    prompt, output = 192, 320
    peaks, steps = {}, {}
    for mode in ("head_wise_recycle_off", "head_wise_recycle_on"):
        rm = ResourceManagerV1(make_config(mode, **kwargs))
        for i in range(48):
            rm.add_request(request(f"r{i}", prompt, output))
        peak, n = 0, 0
        while rm.has_unfinished_requests():
            batch = rm.schedule()
            rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
            peak, n = max(peak, len(rm.running)), n + 1
        peaks[mode], steps[mode] = peak, n
    pred = predicted_concurrency(make_config("head_wise_recycle_on", **kwargs), prompt, output)
    assert peaks["head_wise_recycle_off"] == pred["running_off"]
    assert peaks["head_wise_recycle_on"] == pred["running_on"]
    assert pred["ceiling"] >= 1.2
    print(f"\nSWA heads {swa_heads}: peak running off={peaks['head_wise_recycle_off']} "
          f"on={peaks['head_wise_recycle_on']} predicted ceiling={pred['ceiling']:.3f}, "
          f"steps off/on={steps['head_wise_recycle_off'] / steps['head_wise_recycle_on']:.3f}")


def test_finished_requests_are_not_kept_alive_by_the_scheduler(make_config):
    import gc
    import weakref

    cfg = make_config(num_gpu_blocks_override=64, head_wise_swa_config=SWA, max_num_batched_tokens=64)
    rm = ResourceManagerV1(cfg)
    refs = []
    # Each request's last step brings its processed tokens to 83 (40 prompt + 43 outputs), the count
    # at which SWA block 3 leaves the window (W=20, block 16): it finishes due for recycling.
    for rid in "abc":
        r = request(rid, 40, 44)
        rm.add_request(r)
        refs.append(weakref.ref(r))
        del r
    run_to_completion(rm)
    assert rm.kv_cache_manager.swa_pages_recycled_total > 0
    gc.collect()
    assert [ref() for ref in refs if ref() is not None] == []  # the engine idles now: nothing may pin them
