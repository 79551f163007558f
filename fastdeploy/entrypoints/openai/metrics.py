"""Prometheus text exposition (format 0.0.4) for /metrics, written by hand.

Engine gauges and counters come from the engine process's latest `get_stats()` snapshot (published
every ~0.1 s while busy, 0.5 s while idle, and at once when it goes idle); latency histograms are
observed here, in the server, from the moment a request arrives to when its tokens are routed.
Counter names end in `_total` and carry `# TYPE ... counter`.
"""

from __future__ import annotations

import bisect
import math
from typing import Optional

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "fastdeploy:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)

# (stats key, metric suffix, type, help). Keys are those of LLMEngine.get_stats().
ENGINE_METRICS = (
    ("kv_pages_total", "kv_pages_total", "gauge", "KV cache pages (one KV head x block_size tokens) in total."),
    ("kv_pages_free", "kv_pages_free", "gauge", "KV cache pages currently free."),
    ("num_requests_running", "num_requests_running", "gauge", "Requests scheduled in the running batch."),
    ("num_requests_waiting", "num_requests_waiting", "gauge", "Requests waiting for admission."),
    ("swa_pages_recycled_total", "swa_pages_recycled_total", "counter",
     "Sliding-window pages returned to the free lists after leaving the window."),
    ("num_preemptions_total", "num_preemptions_total", "counter", "Requests preempted to free KV pages."),
    ("prompt_tokens_total", "prompt_tokens_total", "counter", "Prompt tokens processed (prefilled)."),
    ("generation_tokens_total", "generation_tokens_total", "counter", "Tokens generated."),
    ("prefix_cache_hit_tokens_total", "prefix_cache_hit_tokens_total", "counter",
     "Prompt tokens served from the prefix cache at admission."),
    ("prefix_cache_query_tokens_total", "prefix_cache_query_tokens_total", "counter",
     "Prompt tokens looked up in the prefix cache at admission (hit rate = hit / query)."),
    ("prefix_cache_cached_pages", "prefix_cache_cached_pages", "gauge", "KV pages held by the prefix cache."),
    ("prefix_cache_evictions_total", "prefix_cache_evictions_total", "counter",
     "Cached KV pages evicted to make room."),
)


def _fmt(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Histogram:
    """Cumulative-bucket histogram; observe() runs on the event loop thread only."""

    def __init__(self, name: str, help_text: str, buckets: tuple):
        self.name = PREFIX + name
        self.help = help_text
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # last slot: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{self.name}_bucket{{le="{_fmt(float(bound))}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_fmt(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class ServerMetrics:
    def __init__(self):
        self.time_to_first_token = Histogram(
            "time_to_first_token_seconds", "Time from request arrival to its first generated token.", TTFT_BUCKETS)
        self.time_per_output_token = Histogram(
            "time_per_output_token_seconds", "Mean time between output tokens after the first, per request.",
            TPOT_BUCKETS)
        self.e2e_request_latency = Histogram(
            "e2e_request_latency_seconds", "Time from request arrival to its last token.", E2E_BUCKETS)
        self.requests_finished: dict[str, int] = {}

    def observe_finished(self, arrival: float, first_token: Optional[float], now: float, num_output_tokens: int,
                         finish_reason: Optional[str]) -> None:
        self.e2e_request_latency.observe(now - arrival)
        if first_token is not None and num_output_tokens > 1:
            self.time_per_output_token.observe((now - first_token) / (num_output_tokens - 1))
        reason = finish_reason or "unknown"
        self.requests_finished[reason] = self.requests_finished.get(reason, 0) + 1

    def render(self, stats: Optional[dict], num_in_flight: int) -> str:
        lines: list[str] = []
        if stats is not None:
            for key, suffix, kind, help_text in ENGINE_METRICS:
                if key in stats:
                    lines += [f"# HELP {PREFIX}{suffix} {help_text}", f"# TYPE {PREFIX}{suffix} {kind}",
                              f"{PREFIX}{suffix} {_fmt(stats[key])}"]
            per_head = stats.get("kv_pages_free_per_head")
            if per_head is not None:
                name = PREFIX + "kv_pages_free_per_head"
                lines += [f"# HELP {name} Free KV pages in each KV head's home free list.",
                          f"# TYPE {name} gauge"]
                lines += [f'{name}{{head="{h}"}} {_fmt(v)}' for h, v in enumerate(per_head)]
        name = PREFIX + "num_requests_in_flight"
        lines += [f"# HELP {name} HTTP requests admitted and not yet finished.", f"# TYPE {name} gauge",
                  f"{name} {num_in_flight}"]
        name = PREFIX + "request_success_total"
        lines += [f"# HELP {name} Requests that finished, by finish reason.", f"# TYPE {name} counter"]
        lines += [f'{name}{{finish_reason="{r}"}} {n}' for r, n in sorted(self.requests_finished.items())]
        for hist in (self.time_to_first_token, self.time_per_output_token, self.e2e_request_latency):
            lines += hist.render()
        return "\n".join(lines) + "\n"
