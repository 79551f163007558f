"""The chunk rule (PageLayout.chunk_for through ResourceManagerV1._step_chunk): a prefill chunk fills the
step's budget, and is cut to the window only in a step where the cut admits more waiting requests.

Two requests of 32 prompt tokens (4 outputs) arrive together; block size 4, 4 KV heads, window 8, a
budget of 64 tokens, so a whole prompt is one chunk and the cut chunk is 8 tokens (two blocks). With
enough blocks both run whole prompts at once; with fewer, only the cut lets the second one in, and once
no request waits the chunks fill the budget again.
"""

import pytest

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.driver import fake_step
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1
from fastdeploy.envs import override

BUDGET, CUT = 64, 8


def manager(blocks, policy, swa_heads=(0, 1, 2, 3)):
    swa = {"sliding_window": 8, "sink_size": 0, "swa_kv_heads": list(swa_heads)}
    with override(FD_HEAD_WISE_KV_CACHE="1", FD_HEAD_WISE_SWA_RECYCLE="1", FD_ADMISSION_POLICY=policy):
        config = EngineArgs(block_size=4, num_gpu_blocks_override=blocks, max_model_len=64,
                            max_num_batched_tokens=BUDGET, enable_prefix_caching=False,
                            head_wise_swa_config=swa).create_engine_config()
    rm = ResourceManagerV1(config)
    assert rm.cut_chunk == CUT
    for rid in ("a", "b"):
        rm.add_request(Request(rid, list(range(3, 35)), SamplingParams(max_tokens=4, ignore_eos=True),
                               eos_token_id=2))
    return rm


def step(rm):
    batch = fake_step(rm, check=True)
    return [(s.request.request_id, s.start, s.num_tokens) for s in batch.requests]


@pytest.mark.parametrize("policy, blocks", [("projected", 16), ("reserve", 16), ("on_demand", 20)])
def test_a_chunk_fills_the_budget_where_pages_are_to_spare(policy, blocks):
    # Both whole prompts fit (on-demand admission also wants FD_ENC_DEC_BLOCK_NUM blocks of headroom): no
    # request waits on pages, so nothing is cut, though every head slides (the old rule capped every chunk
    # at the window wherever sliding heads were the majority).
    rm = manager(blocks, policy)
    assert step(rm) == [("a", 0, 32), ("b", 0, 32)]
    assert rm.max_chunk == BUDGET and rm.cut_chunk_steps_total == 0


@pytest.mark.parametrize("policy, blocks", [("projected", 12), ("reserve", 10), ("on_demand", 14)])
def test_a_chunk_is_cut_in_the_step_where_the_cut_admits_a_waiting_request(policy, blocks):
    # Whole 32-token first chunks would leave b waiting on pages; 8-token ones let both run now.
    rm = manager(blocks, policy)
    assert step(rm) == [("a", 0, CUT), ("b", 0, CUT)]
    assert rm.cut_chunk_steps_total == 1 and not rm.waiting
    step(rm)  # nothing waits any more: the budget again
    assert rm.max_chunk == BUDGET and rm.cut_chunk_steps_total == 1


@pytest.mark.parametrize("policy", ["projected", "reserve"])
def test_the_cut_applies_where_sliding_heads_are_a_minority(policy):
    # One sliding head of four (the old rule never cut there): at 15 blocks b fits only beside a's cut chunks.
    rm = manager(15, policy, swa_heads=(0,))
    assert step(rm) == [("a", 0, CUT), ("b", 0, CUT)]
    assert manager(16, policy, swa_heads=(0,)).schedule().requests[0].num_tokens == 32  # one block more: no cut


def test_no_cut_where_the_cut_would_admit_nobody():
    # 8 blocks: under reservation b's lifetime peak does not fit beside a's even with cut chunks.
    rm = manager(8, "reserve")
    assert step(rm) == [("a", 0, 32)]
    assert rm.max_chunk == BUDGET and [r.request_id for r in rm.waiting] == ["b"]


def test_a_reserved_request_keeps_the_chunk_its_reservation_assumed():
    # Under reservation the peak reserved for a request assumed its admission step's chunk; later chunks
    # stay within it even after the queue empties.
    rm = manager(10, "reserve")
    step(rm)
    assert step(rm) == [("a", CUT, CUT), ("b", CUT, CUT)]
    assert rm.max_chunk == BUDGET


def test_the_rules_dry_runs_and_the_admission_fit_a_newcomers_curve_once_per_step(monkeypatch):
    # a and b run; c arrives. The dry runs with cut and with whole chunks and the admission itself all ask
    # whether c's curve fits beside the two running curves: one O(n log n) fit answers all three.
    from fastdeploy.engine.sched.projected_admission import PageCurves

    rm = manager(16, "projected")
    step(rm)
    rm.add_request(Request("c", [3, 4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True), eos_token_id=2))
    fitted = []
    real_fit = PageCurves.fit
    monkeypatch.setattr(PageCurves, "fit", lambda self, curves, limits=None: fitted.append(len(curves))
                        or real_fit(self, curves, limits))
    assert [s.request.request_id for s in rm.schedule().requests] == ["a", "b", "c"]
    assert fitted == [3]
