"""benchmark_serving: its datasets, its metric math (upstream's formulas), and short runs against
the real server with upstream's backends, datasets and request yaml."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fastdeploy.entrypoints.openai.server_process import ApiServerProcess, free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))

import bench_recycling  # noqa: E402
import recycling_server  # noqa: E402
import benchmark_serving  # noqa: E402
from backend_request_func import RequestFuncInput, RequestFuncOutput, chat_payload, completions_payload  # noqa: E402
from benchmark_dataset import (  # noqa: E402
    FIRST_REGULAR_TOKEN_ID,
    DatasetError,
    sample_eb,
    sample_eb_chat,
    sample_random_ids,
    sample_random_text,
)
from benchmark_serving import calculate_metrics  # noqa: E402

DATASETS = os.path.join(REPO_ROOT, "benchmarks", "datasets")
REQUEST_YAML = os.path.join(REPO_ROOT, "benchmarks", "yaml", "request_yaml")
ALL_SECTIONS = "ttft,s_ttft,tpot,itl,s_itl,e2el,s_e2el,s_decode,input_len,s_input_len,output_len"


# ----------------------------------------------------------------------------- datasets


def test_random_token_prompts_have_exact_lengths_and_regular_ids():
    requests = sample_random_ids(20, 48, 7, 0.0, vocab_size=259, seed=1)
    assert [len(r.prompt) for r in requests] == [48] * 20
    assert all(r.prompt_len == 48 and r.expected_output_len == 7 and r.fixed_output_len for r in requests)
    ids = np.concatenate([r.prompt for r in requests])
    assert ids.min() >= FIRST_REGULAR_TOKEN_ID and ids.max() < 259


def test_random_range_ratio_varies_lengths_within_bounds_and_prompt_len_stays_exact():
    requests = sample_random_ids(200, 100, 40, 0.5, vocab_size=1000, seed=3)
    assert all(len(r.prompt) == r.prompt_len for r in requests)
    assert all(50 <= r.prompt_len <= 150 and 20 <= r.expected_output_len <= 60 for r in requests)
    assert len({r.prompt_len for r in requests}) > 10


def test_random_prompts_are_reproducible_for_a_seed_and_differ_across_seeds():
    def prompts(seed):
        return [r.prompt for r in sample_random_ids(5, 16, 4, 0.3, vocab_size=259, seed=seed)]

    assert prompts(7) == prompts(7)
    assert prompts(7) != prompts(8)
    assert sample_random_text(3, 20, 8, 0.1, seed=5) == sample_random_text(3, 20, 8, 0.1, seed=5)


def test_upstream_random_dataset_is_words_in_one_user_message_with_fixed_output():
    requests = sample_random_text(50, 20, 10, 0.5, seed=0)
    for r in requests:
        assert len(r.prompt.split()) == r.prompt_len and 10 <= r.prompt_len <= 30
        assert 5 <= r.expected_output_len <= 15
        assert r.history_QA == [{"role": "user", "content": r.prompt}] and r.random_flag


def test_eb_and_ebchat_samples_read_as_upstream_reads_them_and_oversample():
    eb = sample_eb(os.path.join(DATASETS, "eb_sample.jsonl"), 6)
    assert len(eb) == 6 and eb[0].prompt.startswith("Write") and eb[0].expected_output_len == 32
    assert eb[0].prompt_len == 46 and eb[0].history_QA == []
    chat = sample_eb_chat(os.path.join(DATASETS, "ebchat_sample.jsonl"), 3)
    assert chat[2].history_QA[-1]["content"] == chat[2].prompt == "Tell me about caches."
    assert [r.expected_output_len for r in chat] == [24, 32, 40]
    with pytest.raises(DatasetError, match="--dataset-path"):
        sample_eb_chat(None, 1)


def test_bad_dataset_settings_raise_a_dataset_error():
    with pytest.raises(DatasetError, match="range-ratio"):
        sample_random_ids(1, 8, 8, 1.0, vocab_size=259, seed=0)
    with pytest.raises(DatasetError, match="vocab"):
        sample_random_ids(1, 8, 8, 0.0, vocab_size=3, seed=0)


# ----------------------------------------------------------------------------- payloads


def _input(**kw):
    base = dict(no=1, prompt="hi", history_QA=[{"role": "user", "content": "hi"}], hyper_parameters={},
                api_url="http://x/v1/chat/completions", prompt_len=2, output_len=12, model="m")
    return RequestFuncInput(**{**base, **kw})


def test_chat_payload_is_upstreams_with_yaml_merged_and_random_length_fixed():
    yaml_params = {"max_tokens": 1024, "metadata": {"min_tokens": 1}, "top_p": 0.8}
    payload = chat_payload(_input(hyper_parameters=yaml_params, random_flag=True, ignore_eos=True))
    assert payload["messages"] == [{"role": "user", "content": "hi"}] and payload["stream"] is True
    assert payload["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert payload["max_tokens"] == 12 and payload["metadata"] == {"min_tokens": 12}  # random wins over yaml
    assert payload["top_p"] == 0.8 and payload["ignore_eos"] is True and payload["collect_metrics"] is False
    assert yaml_params["metadata"] == {"min_tokens": 1}  # the shared yaml dict is not mutated
    assert chat_payload(_input(hyper_parameters=yaml_params))["max_tokens"] == 1024  # yaml wins over dataset


def test_completions_payload_sends_no_max_tokens_unless_the_yaml_or_random_ids_does():
    assert "max_tokens" not in completions_payload(_input())
    assert completions_payload(_input(hyper_parameters={"max_tokens": 64}))["max_tokens"] == 64
    fixed = completions_payload(_input(prompt=[5, 6, 7], fixed_output_len=True))
    assert fixed["prompt"] == [5, 6, 7] and fixed["max_tokens"] == 12 and fixed["metadata"]["min_tokens"] == 12


# ----------------------------------------------------------------------------- metrics


def _output(ttft, latency, tokens, itl, arrivals, prompt_tokens, cached=0, success=True):
    return RequestFuncOutput(success=success, ttft=ttft, latency=latency, output_tokens=tokens, itl=itl,
                             arrival_time=arrivals, prompt_tokens=prompt_tokens, prompt_len=cached)


def test_metrics_follow_upstreams_formulas():
    outputs = [
        _output(0.1, 1.0, 10, [0.1] * 9, [0.05 + 0.1 * i for i in range(10)], 5, cached=4),  # TPOT 100 ms
        _output(0.3, 0.75, 4, [0.15] * 3, [0.2, 0.35, 0.5, 0.65], 7),                         # TPOT 150 ms
        _output(0.2, 0.2, 1, [], [0.1], 9),                                                   # one token
        _output(0.0, 0.0, 0, [], [], 100, success=False),
    ]
    names = ["ttft", "s_ttft", "tpot", "itl", "s_itl", "e2el", "s_e2el", "s_decode", "input_len", "s_input_len",
             "output_len"]
    m = calculate_metrics(outputs, 2.0, names, [50, 90, 99.9])
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (21, 15)
    assert m["request_throughput"] == pytest.approx(1.5) and m["output_throughput"] == pytest.approx(7.5)
    assert m["mean_tpot_ms"] == pytest.approx(125.0)
    assert m["p90_ttft_ms"] == pytest.approx(280.0)  # linear interpolation over 100, 200, 300
    assert m["mean_itl_ms"] == pytest.approx((9 * 100 + 3 * 150) / 12)
    # S_TTFT is the second chunk's arrival_time (upstream); a one-token request falls back to its first.
    assert m["mean_s_ttft_ms"] == pytest.approx((150 + 350 + 100) / 3)
    assert m["mean_s_e2el_ms"] == pytest.approx((950 + 650 + 100) / 3)
    # S_decode: tokens after the first over the span from the second arrival to the last.
    assert m["mean_s_decode"] == pytest.approx((9 / 0.8 + 3 / 0.3) / 2)
    assert m["mean_input_len"] == pytest.approx(4 / 3) and m["mean_s_input_len"] == pytest.approx(7.0)
    assert m["p99.9_itl_ms"] == pytest.approx(150.0)


def test_goodput_counts_requests_meeting_every_slo():
    outputs = [_output(0.1, 1.0, 10, [], [0.1, 0.2], 5), _output(0.6, 1.0, 10, [], [0.1, 0.2], 5)]
    m = calculate_metrics(outputs, 2.0, [], [], goodput=benchmark_serving.parse_goodput(["ttft:500", "tpot:100"]))
    assert m["request_goodput:"] == pytest.approx(0.5)  # the second misses the TTFT SLO
    with pytest.raises(benchmark_serving.BenchmarkError, match="goodput"):
        benchmark_serving.parse_goodput(["itl:5"])


def test_metrics_of_a_run_where_everything_failed_are_zero_not_nan():
    m = calculate_metrics([_output(0, 0, 0, [], [], 4, success=False)], 1.0, ["ttft", "s_ttft"], [99])
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] == 0.0 and m["p99_s_ttft_ms"] == 0.0


# ----------------------------------------------------------------------------- A/B configs


@pytest.mark.parametrize("name", ["swa_1of4", "swa_4of4"])
def test_shipped_ab_configs_are_memory_bound(name, monkeypatch):
    args = bench_recycling.parse_args(
        ["--engine", "server", "--config", os.path.join(REPO_ROOT, "benchmarks", "yaml", f"{name}.yaml")])
    server, workload = recycling_server.load_settings(args)
    prediction = recycling_server.predict(server, workload)
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
         "--random-range-ratio", "0", "--disable-tqdm", "--max-concurrency", "4", "--metric-percentiles", "50,99",
         "--percentile-metrics", ALL_SECTIONS, *extra])
    return benchmark_serving.run_benchmark(args)


def _assert_server_side_times_fit_inside_the_client_ones(result):
    assert 0 < result["mean_s_ttft_ms"] <= result["mean_s_e2el_ms"] <= result["mean_e2el_ms"]
    assert result["mean_s_decode"] > 0 and result["mean_s_itl_ms"] > 0


def test_completions_random_ids_against_the_live_server_have_exact_lengths(live_server_url):
    result = _run(live_server_url, "--backend", "openai", "--dataset-name", "random-ids")
    assert result["failed"] == 0, result["errors"]
    assert result["completed"] == 8 and result["output_lens"] == [8] * 8
    assert result["infer_input_lens"] == [32] * 8 and result["total_output_tokens"] == 64
    # One chunk per token: one client gap per token after the first.
    assert all(len(gaps) == 7 for gaps in result["itls"])
    assert all(0 < ttft for ttft in result["ttfts"])
    _assert_server_side_times_fit_inside_the_client_ones(result)


def test_upstream_random_chat_against_the_live_server_fixes_output_lengths(live_server_url):
    result = _run(live_server_url, "--backend", "openai-chat", "--dataset-name", "random",
                  "--request-rate", "20", "--burstiness", "0.5", "--random-range-ratio", "0.25")
    assert result["failed"] == 0, result["errors"]
    assert all(6 <= n <= 10 for n in result["output_lens"])  # metadata.min_tokens = max_tokens
    assert all(n > 24 for n in result["infer_input_lens"])  # the chat template adds tokens around the words
    _assert_server_side_times_fit_inside_the_client_ones(result)


def test_ebchat_with_a_request_yaml_saves_upstreams_result_json(live_server_url, tmp_path):
    result = _run(live_server_url, "--backend", "openai-chat", "--dataset-name", "EBChat",
                  "--dataset-path", os.path.join(DATASETS, "ebchat_sample.jsonl"),
                  "--hyperparameter-path", os.path.join(REQUEST_YAML, "fixed_32.yaml"), "--num-prompts", "4",
                  "--save-result", "--result-dir", str(tmp_path), "--metadata", "run=test",
                  "--json", str(tmp_path / "ours.json"))
    assert result["failed"] == 0, result["errors"]
    assert result["output_lens"] == [32] * 4  # the yaml's max_tokens / metadata.min_tokens
    # The role chunk, then 32 token chunks: 32 gaps per request, as upstream's client counts them.
    assert [len(gaps) for gaps in result["itls"]] == [32] * 4
    (saved,) = [p for p in tmp_path.iterdir() if p.name.startswith("openai-chat-infqps-concurrency4-")]
    record = json.loads(saved.read_text())
    for key in ("date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
                "max_concurrency", "duration", "completed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "request_goodput:", "output_throughput", "total_token_throughput",
                "input_lens", "infer_input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors",
                "mean_s_ttft_ms", "p99_s_e2el_ms", "median_s_decode", "mean_input_len"):
        assert key in record, key
    assert record["run"] == "test" and record["request_rate"] == "inf"
    assert json.loads((tmp_path / "ours.json").read_text())["completed"] == 4


def test_without_usage_the_client_counts_token_chunks_not_the_chat_role_chunk(live_server_url):
    import asyncio
    import urllib.request

    from backend_request_func import async_request_eb_openai_chat_completions

    with urllib.request.urlopen(f"{live_server_url}/v1/models") as resp:
        model = json.load(resp)["data"][0]["id"]
    request = RequestFuncInput(no=1, prompt="hi", history_QA=[{"role": "user", "content": "hi"}],
                               hyper_parameters={"stream_options": {"include_usage": False}, "temperature": 0},
                               api_url=f"{live_server_url}/v1/chat/completions", prompt_len=0, output_len=6,
                               model=model, ignore_eos=True)
    output = asyncio.run(async_request_eb_openai_chat_completions(request))
    assert output.success, output.error
    assert output.output_tokens == 6 and len(output.arrival_time) == 7  # role chunk + six tokens
    assert output.arrival_time[0] == output.arrival_time[1]  # S_TTFT (arrival_time[1]) is the first token's


def test_a_repeated_prompt_reports_cached_tokens(live_server_url):
    args = ["--backend", "openai", "--dataset-name", "EB", "--dataset-path", os.path.join(DATASETS, "eb_sample.jsonl"),
            "--hyperparameter-path", os.path.join(REQUEST_YAML, "fixed_32.yaml"), "--num-prompts", "1"]
    _run(live_server_url, *args)
    again = _run(live_server_url, *args)  # the probe and the run repeat the same 46-byte prompt
    assert again["mean_input_len"] >= 32  # whole 16-token blocks of the prompt came from the prefix cache


def test_benchmark_reports_an_unreachable_server_without_a_traceback():
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "benchmark_serving.py"),
         "--port", str(free_port()), "--num-prompts", "1"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "cannot reach the server" in proc.stderr
    assert "Traceback" not in proc.stderr
