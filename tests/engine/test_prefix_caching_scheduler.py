"""Scheduler + prefix cache under random workloads with heavy sharing, aborts and preemption.

Every step must keep check_integrity() true (refcounts = table references, free + cached + private
= total per rank, tombstones, eviction heaps); at the end nothing is referenced, every page is
obtainable, and clearing the cache returns every page to the free lists.
"""

import itertools

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

SWA = {"sliding_window": 13, "sink_size": 3, "swa_kv_heads": [0, 3]}
PREFIXES = [[11 + (i * 7) % 50 for i in range(80)], [61 + (i * 3) % 40 for i in range(80)]]

job = st.tuples(
    st.integers(0, 2),        # shared prefix: PREFIXES[0], PREFIXES[1] or none
    st.integers(0, 64),       # how much of it
    st.lists(st.integers(3, 6), max_size=12),  # own suffix (tiny alphabet: more accidental sharing)
    st.integers(1, 30),       # max tokens
    st.integers(0, 4),        # arrival step
    st.sampled_from([None, 1, 4]),  # abort this many steps after arrival
    st.booleans(),            # next turn: extends the previous request's prompt + outputs
)


def test_hits_happen_in_the_workload_below(make_config):
    rm = ResourceManagerV1(make_config("head_wise_recycle_on", num_gpu_blocks_override=28, block_size=8,
                                       head_wise_swa_config=SWA))
    for i in range(3):
        rm.add_request(Request(f"r{i}", PREFIXES[0][:60] + [i + 3], SamplingParams(max_tokens=3, ignore_eos=True)))
        while rm.has_unfinished_requests():
            batch = rm.schedule()
            rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
    assert rm.stats()["prefix_cache_hit_tokens_total"] == 2 * 56


def test_a_request_scoring_its_prompt_skips_the_prefix_cache_and_is_not_counted_as_a_miss(make_config):
    rm = ResourceManagerV1(make_config("head_wise_recycle_on", num_gpu_blocks_override=28, block_size=8,
                                       head_wise_swa_config=SWA))
    for i, scored in enumerate((None, 0, None)):
        rm.add_request(Request(f"r{i}", PREFIXES[0][:60] + [i + 3],
                               SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=scored)))
        while rm.has_unfinished_requests():
            batch = rm.schedule()
            rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
    stats = rm.stats()
    # r1 computes all 61 positions and is no query; r2 finds r0's (and r1's) 56 cached tokens.
    assert stats["prefix_cache_query_requests_total"] == 2 and stats["prefix_cache_hit_requests_total"] == 1
    assert stats["prefix_cache_hit_tokens_total"] == 56 and stats["prefix_cache_query_tokens_total"] == 2 * 61


@pytest.mark.parametrize("mode,reserve,tp", [
    ("1d", False, 1), ("1d", True, 1), ("head_wise_recycle_off", False, 1),
    ("head_wise_recycle_on", False, 1), ("head_wise_recycle_on", True, 1), ("head_wise_recycle_on", False, 2),
])
def test_random_shared_prefix_workloads_keep_integrity_and_free_everything(make_config, mode, reserve, tp):
    cfg = make_config(mode, reserve=reserve, num_gpu_blocks_override=16, block_size=8, tensor_parallel_size=tp,
                      max_num_batched_tokens=40, max_num_seqs=5, max_model_len=256, head_wise_swa_config=SWA)

    seen = {"hits": 0, "preemptions": 0, "evictions": 0}

    @settings(max_examples=50, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(job, min_size=2, max_size=10))
    @example([(i % 2, 64, [3 + i], 30, 0, None, False) for i in range(5)])  # shared prompts outgrow the cache
    def run(jobs):
        rm = ResourceManagerV1(cfg)
        pending, last, done = list(enumerate(jobs)), None, {}
        for t in itertools.count():
            for i, (pre, plen, suffix, out, arrive, abort, follow) in list(pending):
                if arrive > t:
                    continue
                pending.remove((i, jobs[i]))
                prompt = PREFIXES[pre][:plen] if pre < 2 else []
                if follow and last is not None:
                    prompt = last.prompt_token_ids + last.output_token_ids + prompt[:8]
                prompt = prompt + suffix or [5]
                r = Request(f"r{i}", prompt, SamplingParams(max_tokens=out, ignore_eos=True), eos_token_id=2)
                try:
                    rm.add_request(r)
                except ValueError:
                    continue  # too big for this cache: rejected up front
                last = r
                if abort is not None:
                    done[f"r{i}"] = t + abort
            for rid, when in list(done.items()):
                if when == t:
                    rm.abort_request(rid)
            batch = rm.schedule()
            rm.update_from_output(batch, [3 + t % 4 if s.samples else None for s in batch.requests])
            rm.check_integrity()
            if not pending and not rm.has_unfinished_requests():
                break
            assert t < 5000, "no progress"
        cm = rm.cache_manager
        stats = rm.stats()
        seen["hits"] += stats["prefix_cache_hit_tokens_total"]
        seen["preemptions"] += stats["num_preemptions_total"]
        seen["evictions"] += stats["prefix_cache_evictions_total"]
        assert cm.num_free_pages == cm.num_total_pages
        assert all(not cm.references(rank, p) for rank, owners in enumerate(cm.owners()) for p in range(len(owners)))
        cm.clear_prefix_cache()
        cm.check_integrity()
        stats = cm.prefix_cache_stats()
        assert stats["prefix_cache_cached_pages"] == 0 and stats["prefix_cache_cached_blocks"] == 0
        assert all(o is None for owners in cm.owners() for o in owners)

    run()
    # The workload really exercised sharing, eviction and (without reservation) preemption.
    assert seen["hits"] > 0 and seen["evictions"] > 0, seen
    assert reserve or seen["preemptions"] > 0, seen
