"""/metrics with prometheus_client (what upstream FastDeploy uses), and the reader tests and
benchmarks scrape it with (prometheus_client's own parser).

Two sources feed one registry per server:
- engine gauges and counters come from the engine process's latest `get_stats()` snapshot
  (published every ~0.1 s while busy, 0.5 s while idle, and at once when it goes idle). The engine
  ships the snapshot to the server over its output queue, so only the server process exports
  metrics and prometheus_client's multiprocess mode (files under PROMETHEUS_MULTIPROC_DIR) is not
  needed; `EngineStatsCollector` turns the snapshot into families at scrape time.
- latency histograms and request counters are observed here, in the server, from the moment a
  request arrives to when its tokens are routed.

Our head-wise names (`kv_pages_*`, `swa_pages_recycled_total`, ...) stay; upstream FastDeploy's
cache and batch gauges are exported next to them under upstream's names, types and meaning. In
head-wise mode a "block" of those gauges is one **page** (one KV head's block_size tokens): pages,
not whole blocks, are what head-wise mode allocates, recycles and lends between heads. In 1-D mode
a block is upstream's block (all KV heads of block_size tokens = num_kv_heads pages). The stats key
`kv_pages_per_block` carries that factor.

Adding a labelled gauge (e.g. per tensor-parallel rank): put a list in the engine's stats and one
row in ENGINE_METRICS naming the label; entry i of the list gets label value "i".
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

# `x_created` timestamps next to every counter and histogram only double the scrape; dashboards
# built for upstream do not read them.
disable_created_metrics()

CONTENT_TYPE = CONTENT_TYPE_LATEST
PREFIX = "fastdeploy:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
TOKEN_COUNT_BUCKETS = tuple(m * 10 ** e for e in range(5) for m in (1, 2, 5))  # 1, 2, 5, ..., 50000 (1-2-5)

# (stats key, metric name without prefix, type, help, label). Keys are those of LLMEngine.get_stats();
# a row with a label exports a list value as one sample per entry.
ENGINE_METRICS = (
    ("kv_pages_total", "kv_pages_total", "gauge", "KV cache pages (one KV head x block_size tokens) in total.", None),
    ("kv_pages_free", "kv_pages_free", "gauge", "KV cache pages currently free (evictable cached pages included).",
     None),
    ("kv_pages_free_per_head", "kv_pages_free_per_head", "gauge", "Free KV pages in each KV head's home free list.",
     "head"),
    ("kv_pages_total_per_rank", "kv_pages_total_per_rank", "gauge", "KV pages of each tensor-parallel rank's pool.",
     "rank"),
    ("kv_pages_free_per_rank", "kv_pages_free_per_rank", "gauge",
     "Free KV pages of each tensor-parallel rank's pool.", "rank"),
    ("num_requests_running", "num_requests_running", "gauge", "Requests scheduled in the running batch.", None),
    ("num_requests_waiting", "num_requests_waiting", "gauge", "Requests waiting for admission.", None),
    ("swa_pages_recycled_total", "swa_pages_recycled_total", "counter",
     "Sliding-window pages returned to the free lists after leaving the window.", None),
    ("num_preemptions_total", "num_preemptions_total", "counter", "Requests preempted to free KV pages.", None),
    ("recomputed_tokens_total", "recomputed_tokens_total", "counter",
     "Tokens computed again because a preemption dropped their KV.", None),
    ("prompt_tokens_total", "prompt_tokens_total", "counter", "Prompt tokens processed (prefilled).", None),
    ("generation_tokens_total", "generation_tokens_total", "counter", "Tokens generated.", None),
    ("engine_steps_total", "engine_steps_total", "counter", "Engine steps that ran the model.", None),
    ("prefix_cache_hit_tokens_total", "prefix_cache_hit_tokens_total", "counter",
     "Prompt tokens served from the prefix cache at admission.", None),
    ("prefix_cache_query_tokens_total", "prefix_cache_query_tokens_total", "counter",
     "Prompt tokens looked up in the prefix cache at admission (hit rate = hit / query).", None),
    ("prefix_cache_cached_pages", "prefix_cache_cached_pages", "gauge", "KV pages held by the prefix cache.", None),
    ("prefix_cache_evictions_total", "prefix_cache_evictions_total", "counter",
     "Cached KV pages evicted to make room.", None),
    # The prefix cache's host tier (only with --swap-space): evicted pages a hit can still read.
    ("prefix_cache_host_hit_tokens_total", "prefix_cache_host_hit_tokens_total", "counter",
     "Of the prompt tokens served from the prefix cache, those whose pages were loaded from the host tier.", None),
    ("host_cache_pages", "host_cache_pages", "gauge", "KV pages held in the host tier.", None),
    ("host_cache_pages_total", "host_cache_pages_total", "gauge", "KV pages the host tier can hold.", None),
    ("host_cache_bytes", "host_cache_bytes", "gauge", "Bytes of KV pages held in the host tier.", None),
    ("host_cache_stored_pages_total", "host_cache_stored_pages_total", "counter",
     "KV pages copied into the host tier as the pool evicted them (stale sliding-window pages are not).", None),
    ("host_cache_evicted_pages_total", "host_cache_evicted_pages_total", "counter",
     "KV pages the host tier let go to make room (to the disk tier when there is one, else dropped).", None),
    ("host_cache_loaded_pages_total", "host_cache_loaded_pages_total", "counter",
     "KV pages copied from the host tier (memory or its disk tier) back into the pool for a prefix hit.", None),
    ("host_cache_loads_total", "host_cache_loads_total", "counter",
     "Prefix hits that loaded pages from the host tier.", None),
    ("host_cache_load_seconds_total", "host_cache_load_seconds_total", "counter",
     "Seconds spent copying pages from the host tier into the pool (on the loader's thread).", None),
    ("host_cache_load_wait_seconds_total", "host_cache_load_wait_seconds_total", "counter",
     "Seconds requests spent admitted in the loading state, waiting for their prefix hit's pages to be loaded "
     "from the host or disk tier (summed over requests).", None),
    ("host_cache_loading_requests", "host_cache_loading_requests", "gauge",
     "Requests waiting in the loading state for pages from the host or disk tier.", None),
    ("host_cache_loading_pages", "host_cache_loading_pages", "gauge",
     "KV pages being copied from the host or disk tier into the pool.", None),
    ("host_cache_load_failures_total", "host_cache_load_failures_total", "counter",
     "Loads from the host or disk tier that could not write every page (a corrupt file); their requests "
     "recomputed those tokens.", None),
    ("host_cache_store_seconds_total", "host_cache_store_seconds_total", "counter",
     "Seconds spent copying evicted pages into the host tier.", None),
    # The disk tier below the host tier (only with --kvcache-storage-backend file): page files that outlive the process.
    ("disk_cache_pages", "disk_cache_pages", "gauge", "KV pages held in the disk tier's files.", None),
    ("disk_cache_pages_total", "disk_cache_pages_total", "gauge",
     "KV pages the disk tier may hold (--kvcache-storage-space).", None),
    ("disk_cache_bytes", "disk_cache_bytes", "gauge", "Bytes of KV pages held in the disk tier's files.", None),
    ("disk_cache_stored_pages_total", "disk_cache_stored_pages_total", "counter",
     "KV pages written to the disk tier (let go by the host tier, or at a clean shutdown).", None),
    ("disk_cache_evicted_pages_total", "disk_cache_evicted_pages_total", "counter",
     "KV page files the disk tier deleted to keep to its capacity.", None),
    ("disk_cache_loaded_pages_total", "disk_cache_loaded_pages_total", "counter",
     "KV pages read from the disk tier back into the pool for a prefix hit.", None),
    ("disk_cache_restored_pages", "disk_cache_restored_pages", "gauge",
     "KV pages of an earlier run the disk tier found at start-up.", None),
    ("disk_cache_corrupt_files_total", "disk_cache_corrupt_files_total", "counter",
     "Page files found truncated or corrupt and deleted (never served).", None),
    ("disk_cache_load_seconds_total", "disk_cache_load_seconds_total", "counter",
     "Seconds spent reading page files for prefix hits.", None),
    ("disk_cache_store_seconds_total", "disk_cache_store_seconds_total", "counter",
     "Seconds spent writing page files.", None),
    # Prefill/decode disaggregation (only with --kv-transfer-config): what moved between the servers.
    ("kv_transfer_bytes_sent_total", "kv_transfer_bytes_sent_total", "counter",
     "KV bytes handed to decode servers (the live pages of finished prefill requests).", None),
    ("kv_transfer_pages_sent_total", "kv_transfer_pages_sent_total", "counter",
     "KV pages handed to decode servers.", None),
    ("kv_transfer_bytes_received_total", "kv_transfer_bytes_received_total", "counter",
     "KV bytes read from prefill servers.", None),
    ("kv_transfer_pages_received_total", "kv_transfer_pages_received_total", "counter",
     "KV pages read from prefill servers.", None),
    ("kv_transfer_requests_sent_total", "kv_transfer_requests_sent_total", "counter",
     "Prefill requests whose KV was parked for a decode server.", None),
    ("kv_transfer_requests_received_total", "kv_transfer_requests_received_total", "counter",
     "Decode requests whose prompt KV was read from a prefill server.", None),
    ("kv_transfer_failed_total", "kv_transfer_failed_total", "counter",
     "Decode requests whose prompt KV could not be read (recomputed or failed, kv_load_failure_policy).", None),
    ("kv_transfer_timed_out_total", "kv_transfer_timed_out_total", "counter",
     "KV reads that did not finish within transfer_timeout_s.", None),
    ("kv_transfer_expired_total", "kv_transfer_expired_total", "counter",
     "Parked prefill KV freed because no decode server read it within abort_timeout_s.", None),
    ("kv_transfer_parked_requests", "kv_transfer_parked_requests", "gauge",
     "Finished prefill requests whose pages wait for a decode server's read.", None),
    ("kv_transfer_loading_requests", "kv_transfer_loading_requests", "gauge",
     "Decode requests whose prompt KV is being read.", None),
    # KV-cache events (only with --kv-events-config): what KV-aware routers were told.
    ("kv_events_published_total", "kv_events_published_total", "counter",
     "KV-cache events (BlockStored / BlockRemoved / AllBlocksCleared) published.", None),
    ("kv_events_batches_dropped_total", "kv_events_batches_dropped_total", "counter",
     "Event batches dropped because the publisher's queue was full (consumers see a gap).", None),
    ("kv_events_stored_blocks", "kv_events_stored_blocks", "gauge",
     "Blocks announced as stored now (a hit ends at or passes them: --kv-events-config stored_blocks).", None),
    # Speculative decoding (only with --speculative-config): upstream FastDeploy's names, plus vLLM's
    # num_drafts (verification steps) and the tokens a verification step yields on average.
    ("spec_decode_num_draft_tokens_total", "spec_decode_num_draft_tokens_total", "counter",
     "Total number of speculative tokens generated by the proposal method", None),
    ("spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_total", "counter",
     "Total number of tokens accepted by the scoring model and verification program", None),
    ("spec_decode_num_emitted_tokens_total", "spec_decode_num_emitted_tokens_total", "counter",
     "Tokens produced by verification steps: accepted drafts plus the model's own next token", None),
    ("spec_decode_num_drafts_total", "spec_decode_num_drafts_total", "counter",
     "Verification steps: a request checking at least one draft token in a step", None),
    ("spec_decode_draft_acceptance_rate", "spec_decode_draft_acceptance_rate", "gauge",
     "Acceptance rate of speculative decoding", None),
    ("spec_decode_mean_accepted_length", "spec_decode_mean_accepted_length", "gauge",
     "Tokens a verification step yields on average (1 + accepted drafts per step)", None),
)

# Upstream FastDeploy's names (fastdeploy/metrics/metrics.py), computed from the snapshot by
# upstream_values(): (name without prefix, type, upstream's help text).
UPSTREAM_METRICS = (
    ("gpu_cache_usage_perc", "gauge", "GPU KV-cache usage. 1 means 100 percent usage"),
    ("max_gpu_block_num", "gauge", "Number of total blocks determined when service started"),
    ("available_gpu_block_num", "gauge", "Number of available gpu blocks in cache, including blocks in LRU list"),
    ("free_gpu_block_num", "gauge", "Number of free blocks in cache"),
    ("available_gpu_resource", "gauge", "Available blocks percentage, i.e. available_gpu_block_num / "
                                        "max_gpu_block_num"),
    ("batch_size", "gauge", "Real batch size during inference"),
    ("max_batch_size", "gauge", "Maximum batch size determined when service started"),
    ("available_batch_size", "gauge", "Number of requests that can still be inserted during the Decode phase"),
    ("hit_req_rate", "gauge", "Request-level prefix cache hit rate"),
    ("hit_token_rate", "gauge", "Token-level prefix cache hit rate"),
    ("gpu_hit_token_rate", "gauge", "Token-level GPU prefix cache hit rate"),
    ("cpu_hit_token_rate", "gauge", "Token-level CPU prefix cache hit rate"),
    ("prefix_cache_token_num", "counter", "Total number of cached tokens"),
    ("prefix_gpu_cache_token_num", "counter", "Total number of cached tokens on GPU"),
    ("prefix_cpu_cache_token_num", "counter", "Total number of cached tokens on CPU"),
)


def upstream_values(stats: dict) -> dict:
    """Upstream's cache and batch gauges from one engine snapshot ("block" as in the module doc).

    available = free + evictable (upstream counts blocks in its LRU list as available); free
    excludes them; usage = 1 - free / max, as upstream's resource manager computes it.
    """
    per_block = stats.get("kv_pages_per_block") or 1
    total = stats["kv_pages_total"] / per_block
    available = stats["kv_pages_free"] / per_block
    free = (stats["kv_pages_free"] - stats.get("prefix_cache_evictable_pages", 0)) / per_block
    running = stats["num_requests_running"]
    max_batch = stats.get("max_num_seqs", running)
    query = stats.get("prefix_cache_query_tokens_total", 0)
    hit = stats.get("prefix_cache_hit_tokens_total", 0)
    hit_rate = hit / query if query else 0.0
    host = stats.get("prefix_cache_host_hit_tokens_total", 0)  # upstream's "CPU" tier: our host tier (--swap-space)
    req_query = stats.get("prefix_cache_query_requests_total", 0)
    req_hit_rate = stats.get("prefix_cache_hit_requests_total", 0) / req_query if req_query else 0.0
    return {
        "gpu_cache_usage_perc": 1.0 - free / total if total else 0.0,
        "max_gpu_block_num": total,
        "available_gpu_block_num": available,
        "free_gpu_block_num": free,
        "available_gpu_resource": available / total if total else 0.0,
        "batch_size": running,
        "max_batch_size": max_batch,
        "available_batch_size": max(0, max_batch - running),
        "hit_req_rate": req_hit_rate,
        "hit_token_rate": hit_rate,
        "gpu_hit_token_rate": (hit - host) / query if query else 0.0,
        "cpu_hit_token_rate": host / query if query else 0.0,
        "prefix_cache_token_num": hit,
        "prefix_gpu_cache_token_num": hit - host,
        "prefix_cpu_cache_token_num": host,
    }


def _family(name: str, kind: str, help_text: str, label: Optional[str] = None) -> Metric:
    if kind == "counter":
        return CounterMetricFamily(name, help_text, labels=[label] if label else None)
    return GaugeMetricFamily(name, help_text, labels=[label] if label else None)


def _histogram(name: str, help_text: str, snapshot: dict) -> Metric:
    """A histogram the engine keeps as bucket counts ({"buckets", "counts", "sum"}), cumulated here."""
    family = HistogramMetricFamily(name, help_text)
    total, buckets = 0, []
    for bound, count in zip(list(snapshot["buckets"]) + [float("inf")], snapshot["counts"]):
        total += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
    family.add_metric([], buckets, snapshot["sum"])
    return family


class EngineStatsCollector:
    """A prometheus_client collector over the latest engine snapshot and the server's in-flight count."""

    def __init__(self, source: Callable[[], tuple]):
        self.source = source  # () -> (stats dict or None, num_in_flight)

    def collect(self) -> Iterator[Metric]:
        stats, num_in_flight = self.source()
        if stats is not None:
            for key, suffix, kind, help_text, label in ENGINE_METRICS:
                if key not in stats:
                    continue
                family = _family(PREFIX + suffix, kind, help_text, label)
                if label:
                    for i, value in enumerate(stats[key]):
                        family.add_metric([str(i)], float(value))
                else:
                    family.add_metric([], float(stats[key]))
                yield family
            if "kv_transfer_seconds" in stats:
                yield _histogram(PREFIX + "kv_transfer_seconds", "Time to read one request's prompt KV from "
                                 "the prefill server (handshake excluded).", stats["kv_transfer_seconds"])
            if "kv_pages_total" in stats:
                values = upstream_values(stats)
                for suffix, kind, help_text in UPSTREAM_METRICS:
                    family = _family(PREFIX + suffix, kind, help_text)
                    family.add_metric([], float(values[suffix]))
                    yield family
            if stats.get("tp_worker_pids"):
                family = GaugeMetricFamily(PREFIX + "tp_worker_info", "One series per tensor-parallel worker "
                                           "process: its rank and pid.", labels=["rank", "pid"])
                for rank, pid in enumerate(stats["tp_worker_pids"]):
                    family.add_metric([str(rank), str(pid)], 1.0)
                yield family
        family = GaugeMetricFamily(PREFIX + "num_requests_in_flight", "HTTP requests admitted and not yet finished.")
        family.add_metric([], float(num_in_flight))
        yield family


class ServerMetrics:
    """The server's registry: the engine snapshot collector plus what the server observes itself."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=False)
        self._snapshot: tuple = (None, 0)
        self.registry.register(EngineStatsCollector(lambda: self._snapshot))
        r = self.registry
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from request arrival to its first generated token.",
            buckets=TTFT_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            PREFIX + "time_per_output_token_seconds", "Mean time between output tokens after the first, per request.",
            buckets=TPOT_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from request arrival to its last token.",
            buckets=E2E_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(
            PREFIX + "request_generation_tokens", "Number of generation tokens processed.",
            buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens", "Number of prefill tokens processed.", buckets=TOKEN_COUNT_BUCKETS,
            registry=r)
        self.request_params_max_tokens = Histogram(
            PREFIX + "request_params_max_tokens", "Histogram of max_tokens parameter in request parameters",
            buckets=TOKEN_COUNT_BUCKETS, registry=r)
        self.request_decode_time = Histogram(
            PREFIX + "request_decode_time_seconds", "Time spent in decode phase (from first token to last token)",
            buckets=E2E_BUCKETS, registry=r)
        self.request_success = Counter(PREFIX + "request_success_total", "Requests that finished, by finish reason.",
                                       ["finish_reason"], registry=r)
        self.requests_number = Counter(PREFIX + "requests_number", "Total number of requests received", registry=r)
        self.first_token_latency = Gauge(PREFIX + "first_token_latency", "Latest time to first token in seconds",
                                         registry=r)
        self.infer_latency = Gauge(PREFIX + "infer_latency", "Latest time to generate one token in seconds",
                                   registry=r)

    def observe_admitted(self, max_tokens: Optional[int] = None) -> None:
        self.requests_number.inc()
        if max_tokens is not None:  # None: up to max_model_len, no number to record
            self.request_params_max_tokens.observe(max_tokens)

    def observe_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)
        self.first_token_latency.set(seconds)

    def observe_finished(self, arrival: float, first_token: Optional[float], now: float, num_output_tokens: int,
                         finish_reason: Optional[str], num_prompt_tokens: Optional[int] = None) -> None:
        self.e2e_request_latency.observe(now - arrival)
        self.request_generation_tokens.observe(num_output_tokens)
        if num_prompt_tokens is not None:
            self.request_prompt_tokens.observe(num_prompt_tokens)
        if first_token is not None:
            self.request_decode_time.observe(now - first_token)
        if first_token is not None and num_output_tokens > 1:
            tpot = (now - first_token) / (num_output_tokens - 1)
            self.time_per_output_token.observe(tpot)
            self.infer_latency.set(tpot)
        self.request_success.labels(finish_reason=finish_reason or "unknown").inc()

    def render(self, stats: Optional[dict], num_in_flight: int) -> str:
        self._snapshot = (stats, num_in_flight)
        return generate_latest(self.registry).decode("utf-8")


# ----------------------------------------------------------------------------- reading /metrics
# Benchmarks and tests read /metrics with prometheus_client's parser; these two views flatten it.


def series_key(name: str, labels: dict) -> str:
    """`name` or `name{k="v",...}` (labels in the order given)."""
    if not labels:
        return name
    escaped = {k: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for k, v in labels.items()}
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in escaped.items()) + "}"


def parse_prometheus_text(text: str) -> dict[str, float]:
    """Every sample -> its value, keyed by series_key(): `fastdeploy:kv_pages_free`,
    `fastdeploy:kv_pages_free_per_head{head="0"}`, `..._bucket{le="+Inf"}`, `..._sum`, `..._count`.
    Raises ValueError for text the parser cannot read or a series given twice."""
    series: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = series_key(sample.name, sample.labels)
            if key in series:
                raise ValueError(f"series given twice: {key}")
            series[key] = sample.value
    return series


def prometheus_totals(text: str) -> dict[str, float]:
    """Sample name -> one number: its unlabelled sample if it has one, else the sum of its labelled
    samples (e.g. a per-head gauge summed over heads). Histogram buckets (`le`) and summary
    quantiles are left out, since summing them means nothing; `_sum` and `_count` stay."""
    plain: dict[str, float] = {}
    labelled: dict[str, float] = {}
    for key, value in parse_prometheus_text(text).items():
        name, _, rest = key.partition("{")
        if not rest:
            plain[name] = value
        elif not (rest.startswith("le=") or rest.startswith("quantile=") or ',le="' in rest
                  or ',quantile="' in rest):
            labelled[name] = labelled.get(name, 0.0) + value
    return {**labelled, **plain}
