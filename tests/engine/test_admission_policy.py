"""Admission policies: how they are chosen, and what projected admission buys without preempting."""

import pytest

from fastdeploy.config import ADMISSION_POLICIES, DEFAULT_ADMISSION_POLICY
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.driver import fake_step
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

EOS = 2


def build(monkeypatch, policy_env=None, legacy_env=None, **kwargs):
    monkeypatch.delenv("FD_ADMISSION_POLICY", raising=False)
    monkeypatch.delenv("FD_RESERVE_OUTPUT_PAGES", raising=False)
    if policy_env is not None:
        monkeypatch.setenv("FD_ADMISSION_POLICY", policy_env)
    if legacy_env is not None:
        monkeypatch.setenv("FD_RESERVE_OUTPUT_PAGES", legacy_env)
    kwargs.setdefault("num_gpu_blocks_override", 64)
    return EngineArgs(**kwargs).create_engine_config()


def test_policy_comes_from_the_arg_then_the_env_then_the_legacy_flag_then_the_default(monkeypatch):
    assert build(monkeypatch).admission_policy == DEFAULT_ADMISSION_POLICY
    assert build(monkeypatch, legacy_env="0").admission_policy == "on_demand"
    assert build(monkeypatch, legacy_env="1").admission_policy == "reserve"
    assert build(monkeypatch, policy_env="projected", legacy_env="0").admission_policy == "projected"
    assert build(monkeypatch, policy_env="on-demand").admission_policy == "on_demand"
    assert build(monkeypatch, policy_env="reserve", admission_policy="projected").admission_policy == "projected"
    assert build(monkeypatch, admission_policy="reserve").reserve_output_pages


def test_an_unknown_policy_is_a_start_up_error_naming_the_choices(monkeypatch):
    with pytest.raises(ValueError, match="FD_ADMISSION_POLICY.*reserve, on_demand, projected.*'greedy'"):
        build(monkeypatch, policy_env="greedy")


def test_cli_flag_parses_to_the_engine_arg():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--admission-policy", "projected"]))
    assert args.admission_policy == "projected"
    assert set(ADMISSION_POLICIES) == {"reserve", "on_demand", "projected"}


def request(rid, prompt_len, max_tokens, token=7):
    return Request(rid, [token] * prompt_len, SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=EOS)


def step(rm):
    return fake_step(rm, check=True)


def test_projected_admits_a_request_whose_curve_fits_beside_staggered_ones(monkeypatch):
    """Full heads only, block 1 (the bound is exact): 4 pages per token. r1 is 90 tokens into a
    100-token life, r2 40 tokens in; a newcomer x of the same shape needs their 400 + 400 + 400 peak
    pages under reservation, but their curves only ever need 400 + 4 * 51 + 4 * 10 at once (just
    before r1 ends), so projected admission lets x in at once, and nobody is ever preempted."""
    admitted_at = {}
    for policy in ("reserve", "projected"):
        rm = ResourceManagerV1(build(monkeypatch, policy_env=policy, block_size=1, num_gpu_blocks_override=250,
                                     max_model_len=128, max_num_seqs=8))
        rm.add_request(request("r1", 1, 100))
        for t in range(400):
            if t == 50:
                rm.add_request(request("r2", 1, 100))
            if t == 90:
                rm.add_request(request("x", 1, 100))
            step(rm)
            if policy not in admitted_at and any(r.request_id == "x" for r in rm.running):
                admitted_at[policy] = t
        assert not rm.has_unfinished_requests() and rm.num_preemptions_total == 0
    assert admitted_at["projected"] == 90
    assert admitted_at["reserve"] >= 99  # only once r1 has finished


def test_projected_fills_the_cache_when_every_head_slides(monkeypatch):
    """Every KV head slides: a request's decode needs only window + sink pages, its prefill chunk more
    for a step. Reservation holds the prefill peak for the whole life; projected admission reserves
    the decode need and lends the chunk's extra pages from the unreserved rest."""
    swa = {"sliding_window": 200, "sink_size": 5, "swa_kv_heads": [0, 1, 2, 3]}
    seen = {}
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    for policy in ("reserve", "projected"):
        rm = ResourceManagerV1(build(monkeypatch, policy_env=policy, block_size=8, num_gpu_blocks_override=300,
                                     max_num_batched_tokens=64, max_num_seqs=64, max_model_len=512,
                                     head_wise_swa_config=swa))
        for i in range(24):
            rm.add_request(request(f"r{i}", 250, 200, token=3 + i))  # distinct prompts: no prefix hits
        peak_running = peak_used = 0
        while rm.has_unfinished_requests():
            step(rm)
            cm = rm.cache_manager
            peak_running = max(peak_running, len(rm.running))
            peak_used = max(peak_used, cm.num_total_pages - cm.num_free_pages)
        assert rm.num_preemptions_total == 0
        seen[policy] = (peak_running, peak_used / rm.cache_manager.num_total_pages)
    assert seen["projected"][0] > seen["reserve"][0]
    assert seen["projected"][1] >= 0.9 > seen["reserve"][1], seen


def brute_force_peaks(rm, curves):
    """Per rank, the most the curves' U(t) sum to at any step (what PageCurves.fit bounds in closed form)."""
    peaks = [0] * len(rm.kv_cache_manager.capacity)
    for t in range(max(c[0] for c in curves)):
        total = [0] * len(rm.kv_cache_manager.capacity)
        for steps, x, y, decoding, rounding in curves:
            if t < steps:
                xt = min(x + t, x + steps - 1 - rounding) if decoding else x
                total = [a + f * xt + r * y for a, (f, r) in zip(total, rm.admission.curves.head_counts)]
        peaks = [max(p, a) for p, a in zip(peaks, total)]
    return peaks


def test_the_closed_form_curve_check_equals_summing_every_step(monkeypatch):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    swa = {"sliding_window": 20, "sink_size": 3, "swa_kv_heads": [0, 3]}
    managers = [ResourceManagerV1(build(monkeypatch, policy_env="projected", block_size=bs, num_gpu_blocks_override=30,
                                        tensor_parallel_size=tp, head_wise_swa_config=swa))
                for bs, tp in ((4, 1), (8, 2), (1, 1))]
    curve = st.tuples(st.integers(1, 60), st.integers(0, 200), st.integers(0, 40), st.booleans(), st.integers(0, 7))

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(st.sampled_from(managers), st.lists(curve, min_size=1, max_size=10), st.data())
    def run(rm, curves, data):
        curves = [(s, x, y, d, min(e, rm.block_size - 1) if d else 0) for s, x, y, d, e in curves]
        peaks = brute_force_peaks(rm, curves)
        assert rm.admission.curves.fit(curves, peaks)  # fits exactly at its peak...
        loaded = [i for i, p in enumerate(peaks) if p > 0]  # a free page count is never negative
        if not loaded:
            return
        rank = data.draw(st.sampled_from(loaded))
        tighter = [p - (i == rank) for i, p in enumerate(peaks)]
        assert not rm.admission.curves.fit(curves, tighter)  # ...and not one unit below it on any loaded rank

    run()
