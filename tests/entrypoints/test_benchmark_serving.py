"""benchmark_serving: its random dataset, its metric math, and a short run against the real server."""

import os
import subprocess
import sys

import numpy as np
import pytest

from fastdeploy.entrypoints.openai.server_process import ApiServerProcess, free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

import bench_head_wise_swa  # noqa: E402
import benchmark_serving  # noqa: E402
from backend_request_func import RequestFuncOutput, _is_token_chunk  # noqa: E402
from benchmark_serving import calculate_metrics, sample_random_requests  # noqa: E402


# ----------------------------------------------------------------------------- dataset


def test_random_token_prompts_have_exact_lengths_and_regular_ids():
    requests = sample_random_requests(20, 48, 7, 0.0, vocab_size=259, seed=1)
    assert [len(r.prompt) for r in requests] == [48] * 20
    assert all(r.prompt_len == 48 and r.expected_output_len == 7 for r in requests)
    ids = np.concatenate([r.prompt for r in requests])
    assert ids.min() >= benchmark_serving.FIRST_REGULAR_TOKEN_ID and ids.max() < 259


def test_random_range_ratio_varies_lengths_within_bounds_and_prompt_len_stays_exact():
    requests = sample_random_requests(200, 100, 40, 0.5, vocab_size=1000, seed=3)
    assert all(len(r.prompt) == r.prompt_len for r in requests)
    assert all(50 <= r.prompt_len <= 150 and 20 <= r.expected_output_len <= 60 for r in requests)
    assert len({r.prompt_len for r in requests}) > 10


def test_random_prompts_are_reproducible_for_a_seed_and_differ_across_seeds():
    def prompts(seed):
        return [r.prompt for r in sample_random_requests(5, 16, 4, 0.3, vocab_size=259, seed=seed)]

    assert prompts(7) == prompts(7)
    assert prompts(7) != prompts(8)


def test_chat_prompts_are_single_byte_ascii_of_exact_length():
    requests = sample_random_requests(10, 33, 4, 0.0, vocab_size=259, seed=0, as_text=True)
    for r in requests:
        assert isinstance(r.prompt, str)
        assert len(r.prompt.encode("utf-8")) == r.prompt_len == 33
        assert r.prompt.isascii() and r.prompt.isprintable() and " " not in r.prompt


def test_bad_dataset_settings_raise_a_benchmark_error():
    with pytest.raises(benchmark_serving.BenchmarkError, match="range-ratio"):
        sample_random_requests(1, 8, 8, 1.0, vocab_size=259, seed=0)
    with pytest.raises(benchmark_serving.BenchmarkError, match="vocab"):
        sample_random_requests(1, 8, 8, 0.0, vocab_size=3, seed=0)


# ----------------------------------------------------------------------------- metrics


def _output(ttft, latency, tokens, itl, prompt_len, success=True):
    return RequestFuncOutput(success=success, ttft=ttft, latency=latency, output_tokens=tokens,
                             itl=itl, prompt_len=prompt_len)


def test_metrics_compute_tpot_percentiles_and_throughput_from_successful_requests():
    outputs = [
        _output(0.1, 1.0, 10, [0.1] * 9, prompt_len=5),      # TPOT 0.9 / 9 = 100 ms
        _output(0.3, 0.75, 4, [0.15] * 3, prompt_len=7),     # TPOT 0.45 / 3 = 150 ms
        _output(0.2, 0.2, 1, [], prompt_len=9),              # one token: no TPOT
        _output(0.0, 0.0, 0, [], prompt_len=100, success=False),
    ]
    m = calculate_metrics(outputs, 2.0, ["ttft", "tpot", "itl", "e2el"], [50, 90, 99.9])
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (21, 15)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(7.5)
    assert m["total_token_throughput"] == pytest.approx(18.0)
    assert m["mean_tpot_ms"] == pytest.approx(125.0)
    assert m["median_tpot_ms"] == pytest.approx(125.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["p90_ttft_ms"] == pytest.approx(280.0)  # linear interpolation over 100, 200, 300
    assert m["mean_itl_ms"] == pytest.approx((9 * 100 + 3 * 150) / 12)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["p99.9_itl_ms"] == pytest.approx(150.0)
    assert m["mean_e2el_ms"] == pytest.approx((1000 + 750 + 200) / 3)


def test_metrics_of_a_run_where_everything_failed_are_zero_not_nan():
    m = calculate_metrics([_output(0, 0, 0, [], 4, success=False)], 1.0, ["ttft", "tpot"], [99])
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] == 0.0 and m["p99_tpot_ms"] == 0.0


def test_stream_chunks_that_carry_no_token_do_not_count_as_tokens():
    assert _is_token_chunk("ab", {"text": "ab"})
    # A token whose bytes are not yet valid UTF-8 streams as empty text: still a token.
    assert _is_token_chunk("", {"text": "", "finish_reason": None})
    assert not _is_token_chunk("", {"text": "", "finish_reason": "length"})
    assert not _is_token_chunk("", {"delta": {"role": "assistant", "content": ""}})
    assert not _is_token_chunk(None, {"delta": {}, "finish_reason": None})


# ----------------------------------------------------------------------------- A/B configs


@pytest.mark.parametrize("name", ["swa_1of4", "swa_4of4"])
def test_shipped_ab_configs_are_memory_bound(name, monkeypatch):
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")  # predict() pins it; restored after the test
    args = bench_head_wise_swa.build_parser().parse_args(
        ["--config", os.path.join(REPO_ROOT, "benchmarks", "yaml", f"{name}.yaml")])
    server, workload = bench_head_wise_swa.load_settings(args)
    prediction = bench_head_wise_swa.predict(server, workload)
    assert prediction["ceiling"] >= 1.2
    assert prediction["running_on"] > prediction["running_off"] >= 1


# ----------------------------------------------------------------------------- live server


@pytest.fixture(scope="module")
def live_server_url(tmp_path_factory):
    server = ApiServerProcess(["--max-num-seqs", "8", "--max-model-len", "256", "--block-size", "16",
                               "--num-gpu-blocks-override", "64"], env={"FD_HEAD_WISE_KV_CACHE": "1"},
                              log_path=tmp_path_factory.mktemp("bench_server") / "server.log")
    try:
        server.wait_healthy(timeout_s=240)
        yield server.base_url
    finally:
        server.stop()


def _run(url, *extra):
    args = benchmark_serving.build_parser().parse_args(
        ["--base-url", url, "--num-prompts", "8", "--random-input-len", "32", "--random-output-len", "8",
         "--ignore-eos", "--disable-tqdm", "--max-concurrency", "4", "--metric-percentiles", "50,99",
         *extra])
    return benchmark_serving.run_benchmark(args)


def test_completions_benchmark_against_the_live_server_has_no_failures_and_exact_lengths(live_server_url):
    result = _run(live_server_url)
    assert result["failed"] == 0, result["errors"]
    assert result["completed"] == 8
    assert result["input_lens"] == [32] * 8
    assert result["output_lens"] == [8] * 8
    assert result["total_output_tokens"] == 64
    # The server may merge tokens whose bytes are not yet text into one chunk, so the
    # gap count varies; the timings must still add up inside each request's latency.
    for ttft, gaps, latency in zip(result["ttfts"], result["itls"], result["e2els"]):
        assert 0 < ttft and ttft + sum(gaps) <= latency and len(gaps) <= 7


def test_chat_benchmark_against_the_live_server_has_no_failures_and_exact_output_lengths(live_server_url):
    result = _run(live_server_url, "--backend", "openai-chat", "--request-rate", "20", "--burstiness", "0.5")
    assert result["failed"] == 0, result["errors"]
    assert result["output_lens"] == [8] * 8
    assert all(n >= 32 for n in result["input_lens"])  # the chat template adds tokens around the text


def test_benchmark_reports_an_unreachable_server_without_a_traceback():
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "benchmark_serving.py"),
         "--port", str(free_port()), "--num-prompts", "1"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "cannot reach the server" in proc.stderr
    assert "Traceback" not in proc.stderr
