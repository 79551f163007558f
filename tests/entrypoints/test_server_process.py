"""The shared /metrics reader (metrics.py) and the api_server launcher's start-up failure path.

The launcher's happy path (start, wait healthy, stop) runs under every other test in this folder.
"""

import math

import pytest

from fastdeploy.entrypoints.openai.metrics import (
    ServerMetrics,
    iter_prometheus_samples,
    parse_prometheus_text,
    prometheus_totals,
)
from fastdeploy.entrypoints.openai.server_process import ApiServerProcess, ServerStartError, settings_to_flags

EXPOSITION = "\n".join([
    "# HELP fastdeploy:kv_pages_total KV cache pages in total.",
    "# TYPE fastdeploy:kv_pages_total gauge",
    "fastdeploy:kv_pages_total 256",
    "",
    "   # an indented comment",
    'fastdeploy:kv_pages_free_per_head{head="0"} 10',
    'fastdeploy:kv_pages_free_per_head{head="1"} 5.5',
    "fastdeploy:kv_pages_free 15.5",
    'fastdeploy:kv_pages_free{head="0"} 10',
    'fastdeploy:request_success_total{finish_reason="length",model="tiny"} 3',
    'fastdeploy:request_success_total{finish_reason="stop",model="tiny"} 2',
    "# TYPE fastdeploy:e2e_request_latency_seconds histogram",
    'fastdeploy:e2e_request_latency_seconds_bucket{le="0.5"} 1',
    'fastdeploy:e2e_request_latency_seconds_bucket{le="1.0"} 4',
    'fastdeploy:e2e_request_latency_seconds_bucket{le="+Inf"} 5',
    "fastdeploy:e2e_request_latency_seconds_sum 3.25",
    "fastdeploy:e2e_request_latency_seconds_count 5",
])


# ----------------------------------------------------------------------------- series view


def test_series_are_keyed_as_written_with_their_labels():
    series = parse_prometheus_text(EXPOSITION)
    assert series["fastdeploy:kv_pages_total"] == 256
    assert series['fastdeploy:kv_pages_free_per_head{head="1"}'] == 5.5
    assert series['fastdeploy:request_success_total{finish_reason="stop",model="tiny"}'] == 2
    # Every sample line is a key; comments and blank lines are not.
    assert len(series) == 12
    assert not any(key.startswith("#") for key in series)


def test_histogram_buckets_sum_and_count_are_separate_series():
    series = parse_prometheus_text(EXPOSITION)
    hist = "fastdeploy:e2e_request_latency_seconds"
    assert series[f'{hist}_bucket{{le="0.5"}}'] == 1
    assert series[f'{hist}_bucket{{le="+Inf"}}'] == series[f"{hist}_count"] == 5
    assert series[f"{hist}_sum"] == 3.25


def test_label_values_may_hold_spaces_braces_commas_and_escapes():
    text = 'm{path="/v1/a b",note="x}, y",q="say \\"hi\\"\\n\\\\"} 7'
    ((name, labels, value),) = list(iter_prometheus_samples(text))
    assert name == "m" and value == 7
    assert labels == (("path", "/v1/a b"), ("note", "x}, y"), ("q", 'say "hi"\n\\'))
    # The key escapes the value again, so it reads as the line did.
    assert parse_prometheus_text(text) == {'m{path="/v1/a b",note="x}, y",q="say \\"hi\\"\\n\\\\"}': 7}


def test_special_values_a_timestamp_and_a_trailing_comma_are_accepted():
    series = parse_prometheus_text("a +Inf\nb -Inf\nc NaN\nd 1.5e3 1700000000000\ne{x=\"1\",} 2\nf{} 3")
    assert series["a"] == math.inf and series["b"] == -math.inf and math.isnan(series["c"])
    assert series["d"] == 1500.0  # the timestamp is not the value
    assert series['e{x="1"}'] == 2 and series["f"] == 3


@pytest.mark.parametrize("line", [
    "fastdeploy:kv_pages_free",                   # no value
    "fastdeploy:kv_pages_free many",              # not a number
    "fastdeploy:kv_pages_free 1 2 3",             # too many fields
    "fastdeploy:kv_pages_free 1 soon",            # timestamp not an integer
    'fastdeploy:kv_pages_free{head="0" 1',        # labels never closed
    "fastdeploy:kv_pages_free{head=0} 1",         # label value not quoted
    'fastdeploy:kv_pages_free{head="0"head="1"} 1',  # no comma between labels
    'fastdeploy:kv_pages_free{head="0",head="1"} 1',  # a label twice
    'fastdeploy:kv_pages_free{head="\\t"} 1',     # an escape the format does not have
    'fastdeploy:kv_pages_free{head="0"}1',        # no space before the value
    "9lives 1",                                   # not a metric name
])
def test_a_malformed_line_raises_naming_its_line_number(line):
    with pytest.raises(ValueError, match=r"line 3: .*" + line[:10]):
        parse_prometheus_text(f"# HELP x y\nok 1\n{line}\n")
    with pytest.raises(ValueError):
        prometheus_totals(line)


def test_a_series_given_twice_raises():
    with pytest.raises(ValueError, match="line 2: series given twice"):
        parse_prometheus_text('a{h="0"} 1\na{h="0"} 2')
    with pytest.raises(ValueError, match="line 3: series given twice"):
        prometheus_totals("a 1\nb 1\na 2")


# ----------------------------------------------------------------------------- totals view


def test_totals_sum_labelled_series_and_an_unlabelled_sample_wins():
    totals = prometheus_totals(EXPOSITION)
    assert totals["fastdeploy:kv_pages_free_per_head"] == 15.5  # summed over heads
    assert totals["fastdeploy:request_success_total"] == 5  # summed over label combinations
    # An unlabelled total next to a labelled breakdown is taken as is, not added to it.
    assert totals["fastdeploy:kv_pages_free"] == 15.5
    assert totals["fastdeploy:kv_pages_total"] == 256


def test_totals_leave_out_histogram_buckets_but_keep_sum_and_count():
    totals = prometheus_totals(EXPOSITION)
    hist = "fastdeploy:e2e_request_latency_seconds"
    assert f"{hist}_bucket" not in totals  # cumulative buckets do not add up to anything
    assert totals[f"{hist}_sum"] == 3.25 and totals[f"{hist}_count"] == 5
    assert prometheus_totals('s{quantile="0.5"} 1\ns{quantile="0.9"} 2\ns_count 4') == {"s_count": 4}


# ----------------------------------------------------------------------------- against the writer


def test_what_the_server_writes_reads_back_exactly():
    metrics = ServerMetrics()
    for latency in (0.03, 0.3, 3.0):
        metrics.observe_finished(arrival=0.0, first_token=0.01, now=latency, num_output_tokens=4,
                                 finish_reason="length")
    metrics.observe_finished(arrival=0.0, first_token=None, now=0.2, num_output_tokens=0, finish_reason="abort")
    stats = {"kv_pages_total": 256, "kv_pages_free": 200, "num_requests_running": 3,
             "swa_pages_recycled_total": 17, "kv_pages_free_per_head": [50, 60, 40, 50]}
    text = metrics.render(stats, num_in_flight=2)

    series = parse_prometheus_text(text)
    totals = prometheus_totals(text)
    for key in ("kv_pages_total", "kv_pages_free", "num_requests_running", "swa_pages_recycled_total"):
        assert series["fastdeploy:" + key] == stats[key]
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
