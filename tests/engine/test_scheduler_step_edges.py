"""One scheduler step at its edges: the last token of the budget, a request aborted mid-step, a block
registered the step it is completed, and the finished state."""

from fastdeploy.engine.request import Request, RequestStatus, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

SWA = {"sliding_window": 20, "sink_size": 5, "swa_kv_heads": [0]}


def request(rid, prompt, max_tokens):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=2)


def manager(make_config, **kwargs):
    kwargs.setdefault("num_gpu_blocks_override", 32)
    return ResourceManagerV1(make_config("1d", head_wise_swa_config=SWA, **kwargs))


def step(rm):
    batch = rm.schedule()
    assert all(s.num_tokens > 0 for s in batch.requests), "a request scheduled with no tokens"
    rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
    rm.check_integrity()
    return {s.request.request_id: s.num_tokens for s in batch.requests}


def test_the_last_token_of_the_budget_is_used_by_a_decode_and_then_by_an_admission(make_config):
    rm = manager(make_config, max_num_batched_tokens=3)
    rm.add_request(request("a", [5], 10))
    assert step(rm) == {"a": 1}
    rm.add_request(request("b", [6], 10))
    assert step(rm) == {"a": 1, "b": 1}
    rm.add_request(request("c", [7, 7, 7], 10))
    # Two decodes take 2 of the 3 tokens; the last one starts c's prompt.
    assert step(rm) == {"a": 1, "b": 1, "c": 1}
    assert step(rm) == {"a": 1, "b": 1, "c": 1}
    assert step(rm) == {"a": 1, "b": 1, "c": 1}  # c's prompt done: it samples its first token
    assert [len(rm.requests[r].output_token_ids) for r in "abc"] == [5, 4, 1]


def test_a_request_aborted_between_schedule_and_update_does_not_stop_the_others(make_config):
    rm = manager(make_config)
    for rid in "abc":
        rm.add_request(request(rid, [5, 6], 4))
    batch = rm.schedule()
    rm.abort_request("a")
    progressed = rm.update_from_output(batch, [9] * 3)
    assert [r.request_id for r in progressed] == ["b", "c"]
    assert [rm.requests[r].num_computed_tokens for r in "bc"] == [2, 2]
    rm.check_integrity()


def test_finished_requests_are_marked_finished(make_config):
    rm = manager(make_config)
    r = request("r", [5, 6], 2)
    rm.add_request(r)
    step(rm)
    step(rm)
    assert r.status is RequestStatus.FINISHED and r.is_finished and r.finish_reason == "length"


def test_a_block_is_cached_the_step_its_last_token_is_computed(make_config):
    rm = manager(make_config)
    prompt = [3 + i for i in range(16)]
    rm.add_request(request("a", prompt, 1))  # computes exactly one block, then finishes
    step(rm)
    b = request("b", prompt + [40] * 16, 1)
    rm.add_request(b)
    starts = {}
    while rm.has_unfinished_requests():
        batch = rm.schedule()
        starts.update({s.request.request_id: s.start for s in batch.requests})
        rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
    assert starts["b"] == 16 and b.num_cached_tokens == 16
    # Two blocks computed in one chunk: both are cached at once.
    rm.add_request(request("c", [50 + i for i in range(32)], 1))
    step(rm)
    rm.add_request(request("d", [50 + i for i in range(32)] + [1], 1))
    batch = rm.schedule()
    assert [s.start for s in batch.requests] == [32]


def test_sampled_logprobs_are_kept_with_their_tokens(make_config):
    rm = manager(make_config)
    r = request("r", [5, 6], 2)
    rm.add_request(r)
    for lp in ({9: -0.5}, {9: -0.25}):
        batch = rm.schedule()
        rm.update_from_output(batch, [9], [lp])
    assert r.output_token_ids == [9, 9] and r.output_logprobs == [{9: -0.5}, {9: -0.25}]


def test_pages_recycled_in_one_step_by_several_requests_are_all_counted(make_config):
    # All four heads slide with W = 17, no sink: prompt 16 + 33 outputs recycles block 0 of each head
    # (4 pages) at 32 processed tokens. Two requests in lockstep recycle in the same step.
    rm = ResourceManagerV1(make_config("head_wise_recycle_on", num_gpu_blocks_override=8, enable_prefix_caching=False,
                                       head_wise_swa_config={"sliding_window": 17, "sink_size": 0,
                                                             "swa_kv_heads": [0, 1, 2, 3]}))
    for rid in "ab":
        rm.add_request(request(rid, [5 + len(rid)] * 16, 33))
    while rm.has_unfinished_requests():
        step(rm)
    assert rm.kv_cache_manager.swa_pages_recycled_total == 2 * 4


def test_a_request_filling_max_model_len_exactly_is_accepted_and_waits(make_config):
    rm = manager(make_config, max_model_len=64)
    r = request("r", [5] * 40, 24)  # 40 + 24 = 64
    rm.add_request(r)
    assert r.status is RequestStatus.WAITING
    one_token = request("one", [5], 1)
    rm.add_request(one_token)
    while rm.has_unfinished_requests():
        step(rm)
    assert len(r.output_token_ids) == 24 and len(one_token.output_token_ids) == 1
