"""/metrics as prometheus_client writes it, read back with its parser, and the api_server launcher's
start-up failure path.

The launcher's happy path (start, wait healthy, stop) runs under every other test in this folder.
"""

import pytest

from fastdeploy.entrypoints.openai.metrics import ServerMetrics, parse_prometheus_text, prometheus_totals
from fastdeploy.entrypoints.openai.server_process import ApiServerProcess, ServerStartError, settings_to_flags

# A head-wise snapshot: 256 pages, 200 free of which 40 are evictable prefix-cache pages.
STATS = {"kv_pages_total": 256, "kv_pages_free": 200, "num_requests_running": 3, "num_requests_waiting": 1,
         "swa_pages_recycled_total": 17, "kv_pages_free_per_head": [50, 60, 40, 50],
         "prefix_cache_evictable_pages": 40, "prefix_cache_hit_tokens_total": 30,
         "prefix_cache_query_tokens_total": 120, "max_num_seqs": 8, "kv_pages_per_block": 1,
         "prefix_cache_hit_requests_total": 1, "prefix_cache_query_requests_total": 4}


def _rendered() -> str:
    metrics = ServerMetrics()
    for latency in (0.03, 0.3, 3.0):
        metrics.observe_finished(arrival=0.0, first_token=0.01, now=latency, num_output_tokens=4,
                                 finish_reason="length")
    metrics.observe_finished(arrival=0.0, first_token=None, now=0.2, num_output_tokens=0, finish_reason="abort")
    return metrics.render(STATS, num_in_flight=2)


def test_what_the_server_writes_reads_back_exactly():
    text = _rendered()
    series = parse_prometheus_text(text)
    totals = prometheus_totals(text)
    for key in ("kv_pages_total", "kv_pages_free", "num_requests_running", "swa_pages_recycled_total"):
        assert series["fastdeploy:" + key] == STATS[key]
    assert "# TYPE fastdeploy:swa_pages_recycled_total counter" in text
    assert "_created" not in text  # no creation-time series next to every counter and histogram
    assert series["fastdeploy:num_requests_in_flight"] == 2
    assert [series[f'fastdeploy:kv_pages_free_per_head{{head="{h}"}}'] for h in range(4)] == [50, 60, 40, 50]
    assert totals["fastdeploy:kv_pages_free_per_head"] == 200
    assert series['fastdeploy:request_success_total{finish_reason="length"}'] == 3
    assert totals["fastdeploy:request_success_total"] == 4

    hist = "fastdeploy:e2e_request_latency_seconds"
    buckets = [(k, v) for k, v in series.items() if k.startswith(hist + "_bucket")]
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
    assert series[f'{hist}_bucket{{le="0.05"}}'] == 1
    assert series[f'{hist}_bucket{{le="+Inf"}}'] == series[f"{hist}_count"] == 4
    assert series[f"{hist}_sum"] == pytest.approx(3.53)
    assert f"{hist}_bucket" not in totals and totals[f"{hist}_count"] == 4


def test_upstream_cache_and_batch_gauges_are_derived_from_the_page_counts():
    series = parse_prometheus_text(_rendered())
    up = {name: series["fastdeploy:" + name] for name in (
        "max_gpu_block_num", "available_gpu_block_num", "free_gpu_block_num", "available_gpu_resource",
        "gpu_cache_usage_perc", "batch_size", "max_batch_size", "available_batch_size", "hit_token_rate")}
    assert up["max_gpu_block_num"] == 256 and up["available_gpu_block_num"] == 200
    assert up["free_gpu_block_num"] == 160  # evictable cached pages are available, not free
    assert up["available_gpu_resource"] == pytest.approx(200 / 256)
    assert up["gpu_cache_usage_perc"] == pytest.approx(1 - 160 / 256)
    assert (up["batch_size"], up["max_batch_size"], up["available_batch_size"]) == (3, 8, 5)
    assert up["hit_token_rate"] == pytest.approx(0.25)
    assert series["fastdeploy:hit_req_rate"] == pytest.approx(0.25)


def test_in_one_d_mode_a_block_is_all_kv_heads_of_block_size_tokens():
    metrics = ServerMetrics()
    series = parse_prometheus_text(metrics.render({**STATS, "kv_pages_per_block": 4}, num_in_flight=0))
    assert series["fastdeploy:max_gpu_block_num"] == 64 and series["fastdeploy:free_gpu_block_num"] == 40
    assert series["fastdeploy:kv_pages_total"] == 256


def test_a_series_given_twice_raises():
    with pytest.raises(ValueError, match="given twice"):
        parse_prometheus_text('a{h="0"} 1\na{h="0"} 2')


# ----------------------------------------------------------------------------- launcher


def test_settings_become_flags_in_order_with_json_and_boolean_switches():
    flags = settings_to_flags({"max_num_seqs": 8, "model": None, "head_wise_swa_config": {"sliding_window": 64},
                               "enable_prefix_caching": True, "enable_chunked_prefill": False})
    assert flags == ["--max-num-seqs", "8", "--head-wise-swa-config", '{"sliding_window": 64}',
                     "--enable-prefix-caching", "--no-enable-chunked-prefill"]


def test_a_server_that_exits_while_starting_raises_with_its_log_tail(tmp_path):
    server = ApiServerProcess(["--no-such-flag"], log_path=tmp_path / "server.log")
    try:
        with pytest.raises(ServerStartError, match=r"(?s)exited with code 2 while starting.*--no-such-flag"):
            server.wait_healthy(timeout_s=60)
    finally:
        assert server.stop() == 2
