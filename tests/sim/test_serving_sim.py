"""The serving simulator: step-time arithmetic, and the real scheduler driven on a virtual clock."""

import dataclasses
import json
import math
import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

import bench_recycling  # noqa: E402
import seed_t53  # noqa: E402  (tests/sim: the one-off study of the published measurement)
from serving_sim.hardware import PRESETS, Hardware  # noqa: E402
from serving_sim.simulator import (Scenario, ceiling, make_fd_config, run_arm, run_scenarios,  # noqa: E402
                                   simulate)
from serving_sim.step_model import ModelShape, StepModel, attended_pairs, keys_read  # noqa: E402
from serving_sim.workload import Workload  # noqa: E402

from fastdeploy.cache_manager.head_wise import predicted_concurrency  # noqa: E402
from fastdeploy.model_executor.models.tiny_preset import TINY_PRESET_CONFIG  # noqa: E402

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

ERNIE_JSON = os.path.join(REPO_ROOT, "benchmarks", "models", "ernie-4.5-21b-a3b.json")
# 1 B/s and 1 FLOP/s per unit: step seconds equal the bytes or FLOPs counted by hand.
UNIT_HW = Hardware("unit", 1.0, 1.0, 0)
# Two layers, two KV heads of dim 4, dense MLP: small enough to count every byte by hand.
HAND_CONFIG = {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 2,
               "head_dim": 4, "vocab_size": 10, "intermediate_size": 16, "tie_word_embeddings": False}


# -- step model ----------------------------------------------------------------------------------
def test_decode_step_cost_matches_hand_count():
    shape = ModelShape.from_config(HAND_CONFIG)
    # per layer: attention 8 * (2*8 + 2*8) = 256, MLP 3 * 8 * 16 = 384; LM head 10 * 8 = 80
    assert shape.always_read_params == 2 * (256 + 384)
    assert shape.total_params == 1280 + 2 * 80
    model = StepModel(shape, UNIT_HW, overhead_s=0.5, num_swa_heads=0, window=4, sink=0)
    cost = model.cost([(5, 1, True)])  # one decode at position 5: each head reads keys 0..5
    kv_token_head = 2 * 2 * 4 * 2  # layers x (K, V) x head_dim x bf16
    assert cost.bytes == (1280 + 80) * 2 + 2 * 6 * kv_token_head + 1 * 2 * kv_token_head
    # 2 FLOPs per parameter (LM head included: the token samples) + 4 * head_dim per query-key pair,
    # per layer, per query head (one per KV head here), for 2 heads x 6 keys.
    assert cost.flops == 2 * (1280 + 80) + (2 * 1 * 4 * 4) * 2 * 6
    assert cost.seconds == max(cost.flops, cost.bytes) + 0.5


def test_prefill_chunk_without_sampling_skips_the_lm_head():
    shape = ModelShape.from_config(HAND_CONFIG)
    model = StepModel(shape, UNIT_HW, overhead_s=0.0, num_swa_heads=0, window=4, sink=0)
    with_head, without = model.cost([(0, 3, True)]), model.cost([(0, 3, False)])
    assert with_head.bytes - without.bytes == 80 * 2
    assert with_head.flops - without.flops == 2 * 80
    # 3 tokens, causal pairs 1 + 2 + 3 = 6 per head.
    assert without.flops == 2 * 1280 * 3 + 32 * 2 * 6


@pytest.mark.parametrize("window,sink", [(None, 0), (1, 0), (3, 0), (3, 2), (5, 7), (4, 1)])
def test_key_counts_follow_the_swa_rule(window, sink):
    def visible(t):  # docs/retention_rule.md: key j <= t is seen iff j < S or j > t - W
        return {j for j in range(t + 1) if window is None or j < sink or j > t - window}

    for start in range(12):
        for count in range(1, 6):
            queries = range(start, start + count)
            assert attended_pairs(start, count, window, sink) == sum(len(visible(t)) for t in queries)
            assert keys_read(start, count, window, sink) == len(set().union(*(visible(t) for t in queries)))


def test_swa_heads_read_fewer_bytes_only_past_the_window():
    shape = ModelShape.from_config(json.load(open(ERNIE_JSON)))
    full = StepModel(shape, PRESETS["A800-80GB"], 0.0, num_swa_heads=0, window=4096, sink=64)
    swa = StepModel(shape, PRESETS["A800-80GB"], 0.0, num_swa_heads=4, window=4096, sink=64)
    short, long = [(1000, 1, True)] * 8, [(12000, 1, True)] * 8
    assert swa.cost(short).bytes == full.cost(short).bytes
    saved = full.cost(long).bytes - swa.cost(long).bytes
    # 8 requests x 4 heads x (12001 - 4096 - 64) keys no longer read.
    assert saved == 8 * 4 * shape.num_layers * (12001 - 4096 - 64) * swa.kv_bytes_per_token_pair


def test_moe_weights_read_grow_with_the_distinct_experts_a_batch_touches():
    shape = ModelShape.from_config(json.load(open(ERNIE_JSON)))
    assert shape.expected_distinct_experts(1) == pytest.approx(6)
    assert shape.expected_distinct_experts(4096) == pytest.approx(64)
    model = StepModel(shape, PRESETS["H200"], 0.0, 0, 4096, 0)
    assert model.cost([(100, 1, True)]).bytes < model.cost([(100, 1, True)] * 64).bytes


def test_ernie_config_has_the_published_size():
    shape = ModelShape.from_config(json.load(open(ERNIE_JSON)))
    assert 21e9 < shape.total_params < 22.5e9  # "21B"
    assert 2.8e9 < shape.active_params_per_token + shape.lm_head_params < 3.5e9  # "A3B"
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.moe_layers) == (28, 4, 128, 27)


# -- simulator -----------------------------------------------------------------------------------
@pytest.fixture
def tiny_model(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY_PRESET_CONFIG))
    return str(path)


def tiny_scenario(model, **kw):
    args = dict(name="tiny", model_config=model, hardware=PRESETS["A800-80GB"],
                workload=Workload(24, 300, 200, request_rate=50.0, seed=3), swa_heads=1, window=64, sink=16,
                block_size=16, num_gpu_blocks_override=160, max_num_seqs=64, max_num_batched_tokens=256,
                overhead_ms=1.0)
    args.update(kw)
    return Scenario(**args)


@pytest.mark.parametrize("admission", ["reserve", "on-demand"])
@pytest.mark.parametrize("recycle", [False, True])
def test_every_request_finishes_with_its_length_and_all_pages_come_back(tiny_model, recycle, admission):
    sc = tiny_scenario(tiny_model, admission=admission, workload=Workload(
        30, 300, 200, request_rate=math.inf, range_ratio=0.5, seed=1))
    settings = sc.settings()
    requests = sc.workload.requests()
    result = simulate(make_fd_config(settings, recycle), sc.step_model(settings), requests)
    # simulate() itself raises if a page is still held at the end or the free lists are inconsistent.
    assert result.num_requests == 30 and all(not math.isnan(t) for t in result.done_times)
    assert result.output_tokens == sum(r.output_len for r in requests)
    assert all(0 < ttft <= e2el for ttft, e2el in zip(result.ttft, result.e2el))
    assert result.peak_pages_used <= result.pages_total
    assert (result.swa_pages_recycled > 0) == recycle
    if admission == "reserve":
        assert result.preemptions == 0 and result.recomputed_tokens == 0


def test_recycling_gain_is_real_and_bounded_by_the_concurrency_ceiling(tiny_model):
    # A burst of many identical requests: memory bounds concurrency in both arms.
    sc = tiny_scenario(tiny_model, swa_heads=4, workload=Workload(60, 300, 200, seed=0))
    (row, off, on), = run_scenarios([sc])
    assert row["peak_running_off"] == row["predicted_running_off"]
    assert row["peak_running_on"] == row["predicted_running_on"]
    assert 1.05 < row["gain"] <= row["ceiling"] * 1.05


def test_fixed_lengths_ceiling_is_the_page_need_prediction(tiny_model):
    sc = tiny_scenario(tiny_model)
    pred = ceiling(sc.settings(), sc.workload)
    # By hand: 160 blocks x 4 KV heads = 640 pages; 300 + 200 tokens compute positions 0..498 = 32
    # blocks. OFF: 4 x 32 = 128 pages -> 5 requests. ON (head 0: W 64, S 16): the peak is the last
    # decode, where the SWA head holds block 0 (sink) and blocks [(498 - 63) // 16, 32) = 27..31,
    # 6 pages, next to 3 x 32 for the full heads -> 102 pages -> 6 requests.
    assert pred == {"running_off": 5, "running_on": 6, "ceiling": 1.2, "peak_pages_off": 128,
                    "peak_pages_on": 102, "pages_per_rank": 640}
    assert pred == predicted_concurrency(make_fd_config(sc.settings(), recycle=True), 300, 200)


def test_same_seed_same_result_other_seed_other_arrivals(tiny_model):
    def row(seed):
        return run_scenarios([tiny_scenario(tiny_model, workload=Workload(20, 300, 200, 20.0, 0.3, seed))])[0][0]

    assert row(5) == row(5)
    assert row(5)["throughput_on"] != row(6)["throughput_on"]


def test_steady_state_extrapolation_matches_a_full_run(tiny_model):
    sc = tiny_scenario(tiny_model, workload=Workload(160, 300, 200, request_rate=math.inf, seed=0))
    pred = ceiling(sc.settings(), sc.workload)
    for recycle, running in ((False, pred["running_off"]), (True, pred["running_on"])):
        full = run_arm(sc, recycle)
        short = run_arm(Scenario(**{**sc.__dict__, "max_sim_prompts": 1}), recycle, running)
        assert short.simulated_prompts < 160
        assert short.output_throughput == pytest.approx(full.output_throughput, rel=0.03)


def test_cli_writes_rows_and_plot(tiny_model, tmp_path, capsys):
    out, png = tmp_path / "rows.json", tmp_path / "plot.png"
    rc = bench_recycling.main(["--engine", "sim", "--model-config", tiny_model, "--num-prompts", "12", "--input-len", "200",
                                "--output-len", "100", "--window", "64", "--sink", "16", "--block-size", "16",
                                "--swa-heads", "2", "--num-gpu-blocks-override", "120", "--admission", "both",
                                "--jobs", "1", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [r["admission"] for r in rows] == ["reserve", "on-demand"]
    assert all({"name", "gain", "ceiling", "throughput_off", "throughput_on"} <= set(r) for r in rows)
    assert png.stat().st_size > 10_000
    assert "| GPU |" in capsys.readouterr().out


def test_identical_simulated_prompts_cannot_hit_a_prefix_cache(tiny_model):
    # Every simulated prompt is the same token; with the engine's prefix cache on they would share
    # their KV and fake a memory saving no random benchmark prompt gets.
    settings = tiny_scenario(tiny_model).settings()
    assert make_fd_config(settings, True).cache_config.enable_prefix_caching is False


# -- admission policies and what each arm reports (issue 17) --------------------------------------
def test_on_demand_preemption_recompute_is_counted_token_for_token(tiny_model):
    # A burst of long requests into a small pool: on-demand admission lets in more than fit and
    # preempts. Each request computes every position but its last sampled token once, so whatever
    # was computed beyond that was recomputed after a preemption.
    sc = tiny_scenario(tiny_model, admission="on-demand", num_gpu_blocks_override=90,
                       workload=Workload(16, 300, 200, request_rate=math.inf, seed=2))
    settings = sc.settings()
    requests = sc.workload.requests()
    result = simulate(make_fd_config(settings, False), sc.step_model(settings), requests)
    assert result.preemptions > 0
    once = sum(r.input_len + r.output_len - 1 for r in requests)
    assert result.recomputed_tokens == result.computed_tokens - once > 0
    if result.recomputed_tokens_scheduler is not None:  # the scheduler's own counter, where it has one
        assert result.recomputed_tokens_scheduler == result.recomputed_tokens


def test_time_averaged_occupancy_is_weighted_by_step_time(tiny_model):
    # One request arriving at t=0 runs from the first step to the last: exactly one on average.
    sc = tiny_scenario(tiny_model, workload=Workload(1, 300, 200, seed=0))
    settings = sc.settings()
    result = simulate(make_fd_config(settings, True), sc.step_model(settings), sc.workload.requests())
    assert result.mean_running == pytest.approx(1.0)
    assert 0 < result.mean_pages_used < result.peak_pages_used


def test_admission_policies_set_the_schedulers_flags(tiny_model):
    settings = tiny_scenario(tiny_model).settings()
    for admission, reserve in (("reserve", True), ("on-demand", False)):
        fd = make_fd_config(dataclasses.replace(settings, admission=admission), True)
        assert fd.reserve_output_pages is reserve


def test_projected_admission_never_preempts(tiny_model):
    sc = tiny_scenario(tiny_model, admission="projected")
    (row, off, on), = run_scenarios([sc])
    assert row["admission"] == "projected" and row["preemptions_on"] == 0


def test_rows_report_pages_preemptions_and_recompute_per_arm(tiny_model):
    (row, _, _), = run_scenarios([tiny_scenario(tiny_model, admission="on-demand")])
    for arm in ("off", "on"):
        assert 0 < row[f"mean_pages_fraction_{arm}"] <= row[f"peak_pages_fraction_{arm}"] <= 1
        assert row[f"preemptions_{arm}"] >= 0 and row[f"recomputed_tokens_{arm}"] >= 0


# -- the attention-read model: our skip kernel vs the 1-D masked kernel (issue 15) ----------------
def test_masked_kernel_reads_more_kv_than_skip_and_the_same_without_swa_heads():
    shape = ModelShape.from_config(json.load(open(ERNIE_JSON)))
    batch = [(12000, 1, True)] * 8 + [(0, 2048, False)]
    hw = PRESETS["A800-80GB"]
    skip = StepModel(shape, hw, 0.0, num_swa_heads=4, window=4096, sink=0, attention="skip")
    masked = StepModel(shape, hw, 0.0, num_swa_heads=4, window=4096, sink=0, attention="masked")
    assert masked.cost(batch).bytes > skip.cost(batch).bytes
    assert masked.cost(batch).flops > skip.cost(batch).flops
    # Masked reads a SWA head like a full head: exactly what an all-full model reads.
    full = StepModel(shape, hw, 0.0, num_swa_heads=0, window=4096, sink=0)
    assert masked.cost(batch) == full.cost(batch)
    no_swa = [StepModel(shape, hw, 0.0, num_swa_heads=0, window=4096, sink=0, attention=a) for a in ("skip", "masked")]
    assert no_swa[0].cost(batch) == no_swa[1].cost(batch)


# -- seed-t53: the submission's own configuration, fitted on one cell (issue 15) ------------------
def test_seed_t53_reduced_run_writes_one_row_per_measured_cell(tmp_path):
    out = tmp_path / "cells.json"
    assert seed_t53.main(["--scale", "16", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["name"] for r in rows] == ["throughput_off_128", "throughput_on_128", "throughput_off_1024",
                                         "throughput_on_1024", "ttft_change_1024"]
    assert [r["name"] for r in rows if r["fitted"]] == ["throughput_off_128"]
    fitted = rows[0]
    assert fitted["measured"] == seed_t53.MEASURED_THROUGHPUT[("off", 128)]
    assert abs(fitted["error"]) < 0.01  # the fit hits its cell
    for r in rows:
        assert r["error"] == pytest.approx(r["predicted"] / r["measured"] - 1)
    assert rows[-1]["measured"] == pytest.approx(1407 / 2708 - 1)


@pytest.mark.parametrize("parameter", seed_t53.FIT_PARAMETERS)
def test_fitted_parameters_stay_physical(parameter):
    setup = seed_t53.Setup(scale=16)
    fitted = seed_t53.fit(setup, parameter, rel_tol=0.02)
    assert 0 < fitted.efficiency <= 1 and fitted.overhead_ms >= 0
    # A target no physical value reaches is refused, not met with efficiency > 1 or overhead < 0.
    with pytest.raises(ValueError):
        seed_t53.fit(setup, parameter, target=1e7)


def test_decision_rows_skip_kernel_is_never_slower_than_masked_under_the_same_schedule():
    # Which keys a kernel reads changes step times; with every prompt there at t=0 it changes no
    # scheduling decision, so every skip row runs the masked row's schedule with shorter steps.
    rows = seed_t53.decision_rows(seed_t53.Setup(scale=16, efficiency=0.5, request_rate=math.inf),
                                  admissions=("on-demand",), prompts=(128,))
    by = {(r["attention"], r["swa_heads"]): r for r in rows}
    assert set(by) == {(a, h) for a in ("masked", "skip") for h in (1, 4)}
    for h in (1, 4):
        masked, skip = by[("masked", h)], by[("skip", h)]
        for arm in ("off", "on"):
            assert skip[f"steps_{arm}"] == masked[f"steps_{arm}"]
            assert skip[f"preemptions_{arm}"] == masked[f"preemptions_{arm}"]
            assert skip[f"throughput_{arm}"] > masked[f"throughput_{arm}"]


def test_admission_option_takes_a_policy_list():
    from serving_sim.cli import admissions as parse

    assert parse("both") == ("reserve", "on-demand")
    assert parse("all") == ("reserve", "on-demand", "projected")
    assert parse("on-demand,projected") == ("on-demand", "projected")
    with pytest.raises(Exception, match="unknown admission"):
        parse("reserve,fcfs")


def test_seed_t53_is_the_submissions_configuration():
    sc = seed_t53.Setup().scenario(128)
    w = sc.workload
    assert (sc.hardware.name, w.num_prompts, w.request_rate, w.seed, w.input_len) == ("A800-80GB", 128, 8.0, 42, 10600)
    assert w.num_prompts * w.output_len == pytest.approx(518_946, rel=1e-3)  # PR1's total output tokens
    assert (sc.swa_heads, sc.window, sc.sink, sc.admission, sc.attention) == (4, 4096, 0, "on-demand", "masked")
    assert (sc.max_model_len, sc.max_num_seqs, sc.max_num_batched_tokens) == (32768, 512, 32768)
    fd = make_fd_config(sc.settings(), recycle=True)
    assert fd.reserve_output_pages is False and fd.scheduler_config.max_num_batched_tokens == 32768


# -- models trained with sliding layers (Gemma-3-27B, gpt-oss-20b shapes) -------------------------
# (slots per block, full slots, sliding slots, lanes, sliding (layer, KV head) pairs, window): by hand.
# Gemma 3 27B: 62 layers of 16 KV heads, every sixth global (10 global, 52 sliding): 62 = 2 x 31 and both
# counts are even, so 2 lanes of 31 layers (5 global + 26 sliding each) x 16 heads = 496 slots.
# gpt-oss-20b: 24 layers of 8 KV heads alternating sliding / full: 12 lanes of one pair of layers.
SLIDING_SHAPES = {"Gemma-3-27B": (496, 80, 416, 2, 52 * 16, 1024), "gpt-oss-20b": (16, 8, 8, 12, 12 * 8, 128)}


def sliding_scenario(model: str, **kw) -> Scenario:
    from serving_sim.report import sliding_layer_scenarios

    sc = next(s for s in sliding_layer_scenarios() if s.name.startswith(model + " A800"))
    return dataclasses.replace(sc, **kw)


@pytest.mark.parametrize("model", sorted(SLIDING_SHAPES))
def test_sliding_layer_shapes_get_their_slot_layout_and_page_need(model):
    from fastdeploy.cache_manager.head_wise import PageLayout
    from fastdeploy.cache_manager.slots import AttentionType

    slots, full, sliding, lanes, pairs, window = SLIDING_SHAPES[model]
    sc = sliding_scenario(model, num_gpu_blocks_override=1000, max_model_len=4096 + 64)
    settings = sc.settings()
    on, off = make_fd_config(settings, True), make_fd_config(settings, False)
    assert settings.sliding_layers and not off.head_wise_kv_cache and on.swa_recycle_active
    layout = on.slot_layout
    assert (layout.slots_per_rank, layout.num_lanes) == (slots, lanes)
    assert layout.slots_of(AttentionType(window, 0)) == layout.sliding_slots and len(layout.sliding_slots) == sliding
    assert off.slot_layout == layout  # 1-D addresses the same pages; it only never recycles them
    # One-token steps to position 4094 (3968 + 128 - 1 cached): a full slot holds 64 blocks, a sliding one
    # the window's W / 64 blocks plus the one it straddles.
    need_on = PageLayout.from_config(on).peak_pages_per_rank(3968, 128, 1)
    need_off = PageLayout.from_config(off).peak_pages_per_rank(3968, 128, 1)
    assert need_off == [slots * 64]
    assert need_on == [full * 64 + sliding * (window // 64 + 1)]
    # The step model reads the window only for the sliding pairs, in both arms alike.
    assert sc.step_model(settings).num_swa_pairs == pairs


def test_sliding_layer_rows_report_the_page_need_and_run_more_requests_on():
    sc = sliding_scenario("gpt-oss-20b", workload=Workload(6, 1500, 40, math.inf), num_gpu_blocks_override=50,
                          max_num_batched_tokens=256)
    (row, off, on), = run_scenarios([sc])
    # 1500 + 39 cached tokens: 25 blocks per slot OFF. ON: 8 full slots x 25, and a sliding slot's need
    # peaks in a 256-token prefill chunk (a decode step needs 3 blocks): chunk starts s are multiples of 256,
    # so its keys [s - 127, s + 255] lie in blocks s/64 - 2 .. s/64 + 3, i.e. 6 blocks.
    assert row["peak_pages_per_request_off"] == 16 * 25
    assert row["peak_pages_per_request_on"] == 8 * 25 + 8 * 6
    assert row["sliding_layers"] == 12 and (row["window"], row["sink"]) == (128, 0)
    # 50 blocks x 16 slots = 800 pages: 2 requests fit OFF, 3 ON.
    assert (row["predicted_running_off"], row["predicted_running_on"]) == (2, 3)
    assert off.result.peak_running <= 2 < on.result.peak_running
    assert off.result.swa_pages_recycled == 0 < on.result.swa_pages_recycled


def test_one_scenario_of_a_sliding_layer_model_uses_its_layers_unless_heads_are_asked(tmp_path, capsys):
    gemma = os.path.join(REPO_ROOT, "benchmarks", "models", "gemma-3-27b.json")
    common = ["--engine", "sim", "--model-config", gemma, "--num-prompts", "3", "--input-len", "1500", "--output-len", "16",
              "--num-gpu-blocks-override", "120", "--jobs", "1"]
    out = tmp_path / "rows.json"
    assert bench_recycling.main(common + ["--json", str(out)]) == 0
    row, = json.loads(out.read_text())
    assert row["swa_heads"] is None and (row["sliding_layers"], row["window"], row["sink"]) == (52, 1024, 0)
    assert "| Gemma-3-27B |" in capsys.readouterr().out
    assert bench_recycling.main(common + ["--swa-heads", "1", "--json", str(out)]) == 0
    row, = json.loads(out.read_text())
    assert row["swa_heads"] == 1 and row["sliding_layers"] is None
