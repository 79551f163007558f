"""Prometheus text exposition (format 0.0.4) for /metrics, written by hand, and its reader.

Engine gauges and counters come from the engine process's latest `get_stats()` snapshot (published
every ~0.1 s while busy, 0.5 s while idle, and at once when it goes idle); latency histograms are
observed here, in the server, from the moment a request arrives to when its tokens are routed.
Counter names end in `_total` and carry `# TYPE ... counter`.
"""

from __future__ import annotations

import bisect
import math
import re
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
    ("engine_steps_total", "engine_steps_total", "counter", "Engine steps that ran the model."),
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
            for key, help_text in (("kv_pages_total_per_rank", "KV pages of each tensor-parallel rank's pool."),
                                   ("kv_pages_free_per_rank", "Free KV pages of each tensor-parallel rank's pool.")):
                if stats.get(key) is not None:
                    name = PREFIX + key
                    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
                    lines += [f'{name}{{rank="{r}"}} {_fmt(v)}' for r, v in enumerate(stats[key])]
            if stats.get("tp_worker_pids"):
                name = PREFIX + "tp_worker_info"
                lines += [f"# HELP {name} One series per tensor-parallel worker process: its rank and pid.",
                          f"# TYPE {name} gauge"]
                lines += [f'{name}{{rank="{r}",pid="{p}"}} 1' for r, p in enumerate(stats["tp_worker_pids"])]
        name = PREFIX + "num_requests_in_flight"
        lines += [f"# HELP {name} HTTP requests admitted and not yet finished.", f"# TYPE {name} gauge",
                  f"{name} {num_in_flight}"]
        name = PREFIX + "request_success_total"
        lines += [f"# HELP {name} Requests that finished, by finish reason.", f"# TYPE {name} counter"]
        lines += [f'{name}{{finish_reason="{r}"}} {n}' for r, n in sorted(self.requests_finished.items())]
        for hist in (self.time_to_first_token, self.time_per_output_token, self.e2e_request_latency):
            lines += hist.render()
        return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- reading the format
# The reader lives next to the writer so the two agree on one format; benchmarks and tests scrape
# /metrics with it. It is strict: a line it cannot read raises, so a broken exposition fails loudly
# instead of silently losing a series.

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}
# Cumulative or quantile series of one histogram/summary: adding them up means nothing.
_NON_ADDITIVE_LABELS = ("le", "quantile")


def _read_labels(line: str, pos: int) -> tuple[tuple[tuple[str, str], ...], int]:
    """Labels from just after `{`; returns them in written order and the position after `}`."""
    labels: list[tuple[str, str]] = []
    while True:
        while pos < len(line) and line[pos] in " \t":
            pos += 1
        if line.startswith("}", pos):
            return tuple(labels), pos + 1
        match = _LABEL_NAME.match(line, pos)
        if match is None:
            raise ValueError(f"bad label name at column {pos + 1}")
        key, pos = match.group(), match.end()
        if any(key == seen for seen, _ in labels):
            raise ValueError(f"label {key!r} given twice")
        if not line.startswith('="', pos):
            raise ValueError(f'label {key!r} is not followed by ="')
        pos += 2
        value: list[str] = []
        while True:
            if pos >= len(line):
                raise ValueError(f"label {key!r} has no closing quote")
            char = line[pos]
            if char == '"':
                pos += 1
                break
            if char == "\\":
                escaped = line[pos + 1:pos + 2]
                if escaped not in _ESCAPES:
                    raise ValueError(f"bad escape in label {key!r}")
                value.append(_ESCAPES[escaped])
                pos += 2
            else:
                value.append(char)
                pos += 1
        labels.append((key, "".join(value)))
        while pos < len(line) and line[pos] in " \t":
            pos += 1
        if line.startswith(",", pos):
            pos += 1
        elif not line.startswith("}", pos):
            raise ValueError(f"expected , or }} after label {key!r}")


def _read_sample(line: str) -> tuple[str, tuple[tuple[str, str], ...], float]:
    match = _METRIC_NAME.match(line)
    if match is None:
        raise ValueError("no metric name")
    name, pos = match.group(), match.end()
    labels: tuple[tuple[str, str], ...] = ()
    if line.startswith("{", pos):
        labels, pos = _read_labels(line, pos + 1)
    rest = line[pos:]
    fields = rest.split()
    if not rest[:1].isspace() or len(fields) not in (1, 2):
        raise ValueError("expected `series value [timestamp]`")
    try:
        value = float(fields[0])
        if len(fields) == 2:
            int(fields[1])  # the optional timestamp (ms) is checked, then not used
    except ValueError:
        raise ValueError(f"not a number: {' '.join(fields)!r}") from None
    return name, labels, value


def iter_prometheus_samples(text: str):
    """Yield (name, labels, value) per sample line; labels is a tuple of (key, value) as written.

    Skips blank lines and `#` lines (HELP, TYPE, comments). Histogram and summary series are plain
    samples here: `x_bucket{le="0.5"}`, `x_sum`, `x_count`. Raises ValueError naming the line
    number for anything else that is not a sample, and for a series given twice (the format
    allows each once per scrape).
    """
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            name, labels, value = _read_sample(line)
            key = series_key(name, labels)
            if key in seen:
                raise ValueError("series given twice")
        except ValueError as exc:
            raise ValueError(f"Prometheus text line {number}: {exc}: {raw!r}") from None
        seen.add(key)
        yield name, labels, value


def series_key(name: str, labels: tuple[tuple[str, str], ...]) -> str:
    """`name` or `name{k="v",...}`: how render() above writes a series, so keys match the text."""
    if not labels:
        return name
    escaped = (v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for _, v in labels)
    return name + "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(labels, escaped)) + "}"


def parse_prometheus_text(text: str) -> dict[str, float]:
    """Every series -> its value, keyed by series_key(): `fastdeploy:kv_pages_free`,
    `fastdeploy:kv_pages_free_per_head{head="0"}`, `..._bucket{le="+Inf"}`, `..._sum`, `..._count`.
    """
    return {series_key(name, labels): value for name, labels, value in iter_prometheus_samples(text)}


def prometheus_totals(text: str) -> dict[str, float]:
    """Metric name -> one number: its unlabelled sample if it has one, else the sum of its
    labelled samples (e.g. a per-head gauge summed over heads).

    An unlabelled total exported next to its labelled breakdown is therefore not counted twice.
    Histogram buckets (`le`) and summary quantiles are left out, since summing them means nothing;
    a histogram's `_sum` and `_count` are plain names and stay.
    """
    plain: dict[str, float] = {}
    labelled: dict[str, float] = {}
    for name, labels, value in iter_prometheus_samples(text):
        if not labels:
            plain[name] = value
        elif not any(key in _NON_ADDITIVE_LABELS for key, _ in labels):
            labelled[name] = labelled.get(name, 0.0) + value
    return {**labelled, **plain}
