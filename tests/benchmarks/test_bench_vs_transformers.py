"""benchmarks/bench_vs_transformers.py without a model: the arithmetic behind its fractions of the
machine's limits, its cases and the engine settings that must hold the largest case at once. (The
script itself loads a real model twice; its `--quick` run is a recipe in docs/benchmarks.md.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The repository root, so `benchmarks` is the repo's folder rather than tests/benchmarks.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import bench_vs_transformers as bench  # noqa: E402

LIMITS = {"gemm_peak_gflops": 100.0, "read_bandwidth_gbs": 10.0}


def test_gemm_fraction_counts_every_processed_token_and_the_lm_head_per_output_token():
    case = {"requests": 2, "input_len": 10, "output_len": 5}
    outputs = [[1] * 5, [2] * 5]
    m = bench.side_metrics(2.0, outputs, case, LIMITS, (1000, 100), weight_bytes=4400)
    # (20 prompt + 10 output tokens) x 2 x 1000 + 10 x 2 x 100 = 62000 FLOP in 2 s at a 1e11 FLOP/s peak.
    assert m["gemm_fraction"] == pytest.approx(62000 / 2.0 / 1e11)
    assert m["output_tok_s"] == pytest.approx(5.0) and m["total_tok_s"] == pytest.approx(15.0)
    assert "bandwidth_fraction" not in m  # only single-stream decode is bound by reading the weights


def test_single_stream_bandwidth_fraction_reads_the_weights_as_held_once_per_token():
    case = {"requests": 1, "input_len": 4, "output_len": 8}
    m = bench.side_metrics(4.0, [[0] * 8], case, LIMITS, (1000, 100), weight_bytes=4 * 1100)
    assert m["bandwidth_fraction"] == pytest.approx(4 * 1100 * 2.0 / 1e10)  # float32 copies
    blocks = bench.side_metrics(4.0, [[0] * 8], case, LIMITS, (1000, 100), weight_bytes=900)
    assert blocks["bandwidth_fraction"] == pytest.approx(900 * 2.0 / 1e10)  # a GGUF file's blocks
    assert blocks["gemm_fraction"] == m["gemm_fraction"]  # the same model FLOPs either way


def test_cases_have_the_asked_shapes_and_regular_token_ids():
    args = bench.parse_args(["--concurrency", "1", "3", "--input-len", "16", "--output-len", "4",
                             "--prefill-prompts", "2", "--prefill-len", "64", "--prefill-output-len", "1"])
    cases = bench.make_cases(args, vocab_size=1000)
    assert [(c["requests"], c["input_len"], c["output_len"]) for c in cases] == [(1, 16, 4), (3, 16, 4), (2, 64, 1)]
    for c in cases:
        assert len(c["prompts"]) == c["requests"] and all(len(p) == c["input_len"] for p in c["prompts"])
        assert all(bench.FIRST_PROMPT_ID <= t < 1000 for p in c["prompts"] for t in p)
    kwargs = bench.engine_kwargs(args, cases)
    # The largest case runs at once: 3 x ceil(20 / 64) = 3 blocks, 2 x ceil(65 / 64) = 4 blocks.
    assert kwargs["max_num_seqs"] == 3 and kwargs["num_gpu_blocks_override"] >= 4
    assert kwargs["max_model_len"] >= 65 and kwargs["enable_prefix_caching"] is False


def test_quick_is_short_and_bad_sizes_are_refused():
    quick = bench.parse_args(["--quick"])
    assert max(quick.concurrency) <= 4 and quick.output_len <= 8 and quick.prefill_len <= 256
    with pytest.raises(SystemExit):
        bench.parse_args(["--concurrency", "0"])


def test_machine_limits_are_measured_positive():
    assert bench.gemm_peak_gflops(n=128, repeats=2) > 0


def test_rounds_report_each_sides_median_round_and_every_rounds_ratio():
    seconds = {"engine": [2.0, 1.0, 4.0], "transformers": [3.0, 6.0, 4.0]}
    median, ratios = bench.rounds_summary(seconds)
    assert median == {"engine": 2.0, "transformers": 4.0}
    # Round by round, the same tokens in each side's time: 3/2, 6/1, 4/4.
    assert ratios == {"engine": [1.5, 6.0, 1.0]}
    assert bench.rounds_summary({"engine": [1.0, 3.0], "transformers": [2.0, 2.0]})[0]["engine"] == 1.0
    assert bench.parse_args([]).rounds == 3 and bench.parse_args(["--quick"]).rounds == 1
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])
