"""Online serving benchmark for the OpenAI-compatible api_server.

Sends a synthetic workload at a chosen arrival rate (Poisson, or gamma with
--burstiness), streams every response, and reports throughput and latency
percentiles (TTFT, TPOT, ITL, E2EL). Flags follow upstream FastDeploy/vLLM.

    python benchmarks/benchmark_serving.py --backend openai --port 8000 \
        --dataset-name random --random-input-len 256 --random-output-len 64 \
        --num-prompts 64 --ignore-eos

Other scripts call `run_benchmark(args)` / `await run_benchmark_async(args)`
with `args = build_parser().parse_args([...])` and get the result dict back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from typing import AsyncIterator, Optional, Union

import aiohttp
import numpy as np
from tqdm.asyncio import tqdm

from backend_request_func import (
    AIOHTTP_TIMEOUT,
    ASYNC_REQUEST_FUNCS,
    DEFAULT_ENDPOINTS,
    RequestFuncInput,
    RequestFuncOutput,
)

# Ids 0-2 are pad/bos/eos-like specials in ERNIE-style vocabularies; random
# prompts avoid them so a prompt never ends early or means something special.
FIRST_REGULAR_TOKEN_ID = 3
# Printable, non-space ASCII: one byte each, so one token each for a
# byte-level tokenizer, and nothing a server might strip.
ASCII_PROMPT_CHARS = np.array([chr(c) for c in range(33, 127)])
METRIC_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


class BenchmarkError(RuntimeError):
    """A problem the user must fix (server down, bad flags); printed without a trace."""


@dataclass
class SampleRequest:
    prompt: Union[str, list[int]]
    prompt_len: int
    expected_output_len: int


@dataclass
class ServerInfo:
    model: str
    vocab_size: Optional[int]
    max_model_len: Optional[int]


# ----------------------------------------------------------------------------- dataset


def _lengths(rng: np.random.Generator, center: int, range_ratio: float, n: int) -> np.ndarray:
    """Integer lengths uniform in [center*(1-r), center*(1+r)], at least 1."""
    low = max(1, math.floor(center * (1 - range_ratio)))
    high = max(low, math.ceil(center * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=n)


def sample_random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
    as_text: bool = False,
) -> list[SampleRequest]:
    """Random prompts with exact lengths: token ids, or single-byte ASCII text.

    Token-id prompts reach the model untouched, so `prompt_len` is the true
    input length; text prompts are for the chat endpoint, whose template adds
    its own tokens on top.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise BenchmarkError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise BenchmarkError("--random-input-len and --random-output-len must be >= 1")
    if not as_text and vocab_size <= FIRST_REGULAR_TOKEN_ID:
        raise BenchmarkError(f"vocab size {vocab_size} leaves no regular token ids")
    rng = np.random.default_rng(seed)
    input_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    requests = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist()):
        if as_text:
            prompt = "".join(rng.choice(ASCII_PROMPT_CHARS, size=n_in).tolist())
        else:
            prompt = rng.integers(FIRST_REGULAR_TOKEN_ID, vocab_size, size=n_in).tolist()
        requests.append(SampleRequest(prompt, n_in, n_out))
    return requests


async def get_request(
    requests: list[SampleRequest], request_rate: float, burstiness: float, seed: int
) -> AsyncIterator[SampleRequest]:
    """Yield requests at gamma-distributed intervals (burstiness 1 = Poisson).

    Mean interval is 1/request_rate whatever the burstiness; lower burstiness
    clusters arrivals, higher makes them regular.
    """
    rng = np.random.default_rng(seed)
    for i, request in enumerate(requests):
        yield request
        if math.isinf(request_rate) or i == len(requests) - 1:
            continue
        interval = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness))
        await asyncio.sleep(interval)


# ----------------------------------------------------------------------------- metrics


def _percentile_key(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def calculate_metrics(
    outputs: list[RequestFuncOutput],
    duration_s: float,
    percentile_metrics: list[str],
    percentiles: list[float],
) -> dict:
    """Aggregate per-request observations into the benchmark's result fields.

    TPOT of a request is its decode time spread over the tokens after the
    first, so single-token requests have none. ITL pools every gap of every
    request. Times are reported in milliseconds.
    """
    done = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_tokens for o in done)
    samples = {
        "ttft": [o.ttft for o in done],
        "tpot": [(o.latency - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
    }
    result = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    for name in percentile_metrics:
        values_ms = np.asarray(samples[name], dtype=np.float64) * 1000.0
        empty = values_ms.size == 0
        result[f"mean_{name}_ms"] = 0.0 if empty else float(values_ms.mean())
        result[f"median_{name}_ms"] = 0.0 if empty else float(np.median(values_ms))
        result[f"std_{name}_ms"] = 0.0 if empty else float(values_ms.std())
        for p in percentiles:
            value = 0.0 if empty else float(np.percentile(values_ms, p))
            result[f"p{_percentile_key(p)}_{name}_ms"] = value
    return result


def print_result(result: dict, percentile_metrics: list[str], percentiles: list[float]) -> None:
    width = 50
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=width, c="="))
    rows = [
        ("Successful requests:", result["completed"]),
        ("Failed requests:", result["failed"]),
        ("Benchmark duration (s):", f"{result['duration']:.2f}"),
        ("Total input tokens:", result["total_input_tokens"]),
        ("Total generated tokens:", result["total_output_tokens"]),
        ("Request throughput (req/s):", f"{result['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{result['total_token_throughput']:.2f}"),
    ]
    if result.get("max_concurrency") is not None:
        rows.insert(3, ("Maximum request concurrency:", result["max_concurrency"]))
    for label, value in rows:
        print(f"{label:<40}{value:<10}")
    for name in percentile_metrics:
        print("{s:{c}^{n}}".format(s=METRIC_NAMES[name], n=width, c="-"))
        upper = name.upper()
        print(f"{'Mean ' + upper + ' (ms):':<40}{result[f'mean_{name}_ms']:<10.2f}")
        print(f"{'Median ' + upper + ' (ms):':<40}{result[f'median_{name}_ms']:<10.2f}")
        for p in percentiles:
            key = _percentile_key(p)
            print(f"{'P' + key + ' ' + upper + ' (ms):':<40}{result[f'p{key}_{name}_ms']:<10.2f}")
    print("=" * width)


# ----------------------------------------------------------------------------- run


async def fetch_server_info(session: aiohttp.ClientSession, models_url: str) -> list[dict]:
    """The model entries of GET /v1/models, or a BenchmarkError naming the URL."""
    try:
        async with session.get(models_url, timeout=aiohttp.ClientTimeout(total=30)) as response:
            if response.status != 200:
                body = (await response.text())[:300]
                raise BenchmarkError(f"GET {models_url} returned HTTP {response.status}: {body}")
            return (await response.json()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise BenchmarkError(
            f"cannot reach the server at {models_url} ({type(exc).__name__}: {exc}); "
            "is the api_server running on that host and port?"
        ) from None


def resolve_server_info(entries: list[dict], model: Optional[str]) -> ServerInfo:
    if model is None:
        if not entries:
            raise BenchmarkError("the server lists no models; pass --model")
        entry = entries[0]
    else:
        entry = next((e for e in entries if e.get("id") == model), {})
    return ServerInfo(
        model=model or entry["id"],
        vocab_size=entry.get("vocab_size"),
        max_model_len=entry.get("max_model_len"),
    )


async def benchmark(
    *,
    backend: str,
    api_url: str,
    model: str,
    requests: list[SampleRequest],
    request_rate: float = float("inf"),
    burstiness: float = 1.0,
    max_concurrency: Optional[int] = None,
    ignore_eos: bool = False,
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el"),
    percentiles: tuple[float, ...] = (99.0,),
    seed: int = 0,
    disable_tqdm: bool = False,
    initial_test: bool = True,
) -> dict:
    """Send `requests` to `api_url` and return the aggregated result dict."""
    request_func = ASYNC_REQUEST_FUNCS[backend]
    if burstiness <= 0:
        raise BenchmarkError(f"--burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise BenchmarkError(f"--request-rate must be > 0, got {request_rate}")

    def to_input(req: SampleRequest, output_len: Optional[int] = None) -> RequestFuncInput:
        return RequestFuncInput(
            prompt=req.prompt, api_url=api_url, prompt_len=req.prompt_len,
            output_len=output_len or req.expected_output_len, model=model, ignore_eos=ignore_eos,
        )

    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=False)
    async with aiohttp.ClientSession(timeout=AIOHTTP_TIMEOUT, connector=connector) as session:
        if initial_test:
            # One short request first: a wrong endpoint or model fails in a
            # second with the server's message instead of N times.
            probe = await request_func(to_input(requests[0], min(4, requests[0].expected_output_len)), session)
            if not probe.success:
                raise BenchmarkError(f"initial test request to {api_url} failed: {probe.error}")

        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="requests")

        async def send(req: SampleRequest) -> RequestFuncOutput:
            if semaphore is None:
                output = await request_func(to_input(req), session)
            else:
                async with semaphore:
                    output = await request_func(to_input(req), session)
            progress.update(1)
            return output

        start = time.perf_counter()
        tasks = []
        async for req in get_request(requests, request_rate, burstiness, seed):
            tasks.append(asyncio.create_task(send(req)))
        outputs: list[RequestFuncOutput] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        progress.close()

    result = calculate_metrics(outputs, duration, list(percentile_metrics), list(percentiles))
    result.update(
        backend=backend,
        model_id=model,
        num_prompts=len(requests),
        request_rate=request_rate,
        burstiness=burstiness,
        max_concurrency=max_concurrency,
        input_lens=[o.prompt_len for o in outputs],
        output_lens=[o.output_tokens for o in outputs],
        ttfts=[o.ttft for o in outputs],
        e2els=[o.latency for o in outputs],
        itls=[o.itl for o in outputs],
        generated_texts=[o.generated_text for o in outputs],
        errors=[o.error for o in outputs],
    )
    return result


def _base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def _parse_list(text: str, valid: Optional[set] = None) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if valid is not None:
        unknown = [item for item in items if item not in valid]
        if unknown:
            raise BenchmarkError(f"unknown metric(s) {unknown}; choose from {sorted(valid)}")
    return items


async def run_benchmark_async(args: argparse.Namespace) -> dict:
    """Everything `main` does except printing errors and exiting: returns the result dict."""
    base_url = _base_url(args)
    percentile_metrics = _parse_list(args.percentile_metrics, set(METRIC_NAMES))
    try:
        percentiles = [float(p) for p in _parse_list(args.metric_percentiles)]
    except ValueError:
        raise BenchmarkError(f"--metric-percentiles must be numbers, got {args.metric_percentiles!r}") from None
    if any(not 0 <= p <= 100 for p in percentiles):
        raise BenchmarkError("--metric-percentiles must lie in [0, 100]")

    async with aiohttp.ClientSession() as session:
        entries = await fetch_server_info(session, base_url + "/v1/models")
    info = resolve_server_info(entries, args.model)
    vocab_size = info.vocab_size or args.tokenizer_vocab_size

    if args.dataset_name != "random":
        raise BenchmarkError(f"unsupported --dataset-name {args.dataset_name!r}")
    requests = sample_random_requests(
        args.num_prompts, args.random_input_len, args.random_output_len,
        args.random_range_ratio, vocab_size, args.seed, as_text=args.backend == "openai-chat",
    )
    longest = max(r.prompt_len + r.expected_output_len for r in requests)
    if info.max_model_len is not None and longest > info.max_model_len:
        raise BenchmarkError(
            f"input + output length reaches {longest} tokens but the server's "
            f"max_model_len is {info.max_model_len}; lower --random-input-len/--random-output-len"
        )

    endpoint = args.endpoint or DEFAULT_ENDPOINTS[args.backend]
    print(f"Model {info.model!r} (vocab {vocab_size}, max_model_len {info.max_model_len}); "
          f"{len(requests)} prompts, request rate {args.request_rate}, "
          f"burstiness {args.burstiness}, max concurrency {args.max_concurrency}")
    result = await benchmark(
        backend=args.backend,
        api_url=base_url + endpoint,
        model=info.model,
        requests=requests,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        percentile_metrics=tuple(percentile_metrics),
        percentiles=tuple(percentiles),
        seed=args.seed,
        disable_tqdm=args.disable_tqdm,
    )
    print_result(result, percentile_metrics, percentiles)
    if args.save_result:
        save_result(args, result)
    return result


def run_benchmark(args: argparse.Namespace) -> dict:
    return asyncio.run(run_benchmark_async(args))


def save_result(args: argparse.Namespace, result: dict) -> str:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    record = {"date": stamp, **result}
    name = args.result_filename
    if name is None:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        model = os.path.basename(str(result["model_id"]).rstrip("/"))
        name = f"{args.backend}-{args.request_rate}qps{concurrency}-{model}-{stamp}.json"
    path = os.path.join(args.result_dir or ".", name)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(f"Result saved to {path}")
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=sorted(ASYNC_REQUEST_FUNCS), default="openai")
    parser.add_argument("--base-url", default=None, help="Server URL; overrides --host/--port.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default=None,
                        help="Default: /v1/completions (openai) or /v1/chat/completions (openai-chat).")
    parser.add_argument("--model", default=None, help="Default: the first model the server lists.")
    parser.add_argument("--tokenizer-vocab-size", type=int, default=256,
                        help="Vocabulary size for random token ids when /v1/models does not report one.")
    parser.add_argument("--dataset-name", choices=["random"], default="random")
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="Lengths are uniform in [len*(1-r), len*(1+r)]; 0 = fixed lengths.")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Requests per second; inf sends all at once.")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="Gamma shape of arrival intervals: 1 = Poisson, <1 burstier, >1 steadier.")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="Send ignore_eos and min_tokens so every request generates exactly its output length.")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    parser.add_argument("--metric-percentiles", default="99")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-dir", default=None)
    parser.add_argument("--result-filename", default=None)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run_benchmark(args)
    except BenchmarkError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
