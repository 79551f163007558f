"""Online serving benchmark for the OpenAI-compatible api_server, with upstream FastDeploy's
interface: its flags and defaults, datasets (EB / EBChat jsonl, random words), request yaml
(`--hyperparameter-path`, merged into every request), printed sections and `--save-result` JSON.

    python benchmarks/benchmark_serving.py --backend openai-chat --model default \
        --dataset-name EBChat --dataset-path benchmarks/datasets/ebchat_sample.jsonl \
        --hyperparameter-path benchmarks/yaml/request_yaml/tiny.yaml --num-prompts 16 \
        --percentile-metrics ttft,s_ttft,tpot,itl,s_itl,e2el,s_e2el,s_decode,input_len,s_input_len,output_len \
        --save-result

Ours in addition: `--dataset-name random-ids` (token-id prompts of exact length), `--json PATH`,
a progress bar, `--model` optional (the first model the server lists), and
`--endpoint` defaulting to the backend's endpoint. Server-side metrics (S_TTFT, S_ITL, S_E2EL,
S_decode) are computed from the `arrival_time` of every streamed chunk exactly as upstream's tool
does, so the two tools print the same numbers for the same run: S_TTFT reads the second chunk's
arrival time, S_E2EL the last one's.

Other scripts call `run_benchmark(args)` / `await run_benchmark_async(args)` with
`args = build_parser().parse_args([...])` and get the result dict back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime
from typing import AsyncIterator, Optional

import aiohttp
import numpy as np
import yaml
from tqdm.asyncio import tqdm

from backend_request_func import (
    AIOHTTP_TIMEOUT,
    ASYNC_REQUEST_FUNCS,
    DEFAULT_ENDPOINTS,
    RequestFuncInput,
    RequestFuncOutput,
)
from benchmark_dataset import (
    DatasetError,
    SampleRequest,
    sample_eb,
    sample_eb_chat,
    sample_random_ids,
    sample_random_text,
)

# (attribute, label, header) of upstream's sections, in upstream's order. Times print in ms,
# lengths and S_decode (tok/s) as they are.
TIME_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("s_ttft", "S_TTFT", "Infer Time to First Token"),
    ("res_ttft", "Response TTFT", "Response Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("s_itl", "S_ITL", "Infer Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
    ("s_e2el", "S_E2EL", "Infer End-to-end Latency"),
)
LENGTH_SECTIONS = (
    ("input_len", "Cached Tokens", "Cached Tokens"),
    ("s_input_len", "Input Length", "Infer Input Length"),
    ("reasoning_len", "Reasoning Lenth", "Reasoning Length"),  # upstream's spelling of the label
    ("output_len", "Output Length", "Output Length"),
)
DECODE_SECTION = ("s_decode", "Decode", "Decode Speed (tok/s)")
ALL_METRICS = {name for name, _, _ in (*TIME_SECTIONS, *LENGTH_SECTIONS, DECODE_SECTION)}


class BenchmarkError(RuntimeError):
    """A problem the user must fix (server down, bad flags); printed without a trace."""


@dataclass
class ServerInfo:
    model: str
    vocab_size: Optional[int]
    max_model_len: Optional[int]


# ----------------------------------------------------------------------------- arrivals


async def get_request(requests: list, request_rate: float, burstiness: float,
                      seed: int) -> AsyncIterator[SampleRequest]:
    """Yield requests at gamma-distributed intervals (burstiness 1 = Poisson).

    Mean interval is 1/request_rate whatever the burstiness; lower burstiness
    clusters arrivals, higher makes them regular.
    """
    rng = np.random.default_rng(seed)
    for i, request in enumerate(requests):
        yield request
        if math.isinf(request_rate) or i == len(requests) - 1:
            continue
        await asyncio.sleep(rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness)))


# ----------------------------------------------------------------------------- metrics


def _p_word(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def per_request_samples(outputs: list) -> dict:
    """Each metric's samples over the successful requests, computed as upstream's tool does."""
    s = {name: [] for name in ALL_METRICS}
    for o in outputs:
        if not o.success or not o.output_tokens:
            continue
        arrivals = o.arrival_time
        s["output_len"].append(o.output_tokens)
        s["reasoning_len"].append(o.reasoning_tokens)
        s["input_len"].append(o.prompt_len)
        s["s_input_len"].append(o.prompt_tokens)
        if o.output_tokens > 1:
            s["tpot"].append((o.latency - o.ttft) / (o.output_tokens - 1))
        s["itl"] += o.itl
        later = arrivals[1:]
        s["s_itl"] += [later[j + 1] - later[j] for j in range(len(later) - 2)]
        s["ttft"].append(o.ttft)
        s["s_ttft"].append(arrivals[1] if len(arrivals) > 1 else arrivals[0])
        s["res_ttft"].append(o.res_ttft)
        s["e2el"].append(o.latency)
        s["s_e2el"].append(arrivals[-1])
        if len(arrivals) > 2 and arrivals[-1] > arrivals[1]:
            s["s_decode"].append((o.output_tokens - 1) / (arrivals[-1] - arrivals[1]))
    return s


def parse_goodput(pairs: Optional[list]) -> dict:
    """Upstream's `--goodput ttft:500 tpot:50`: SLOs in ms on ttft, tpot or e2el."""
    slos = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            slos[name] = float(value) if sep else float("nan")
        except ValueError:
            slos[name] = float("nan")
        if name not in ("ttft", "tpot", "e2el") or not slos[name] >= 0:
            raise BenchmarkError(f"--goodput takes KEY:VALUE with KEY in ttft, tpot, e2el and VALUE >= 0 ms, "
                                 f"got {pair!r}")
    return slos


def _meets(o, slos: dict) -> bool:
    tpot = (o.latency - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0
    values = {"ttft": o.ttft, "tpot": tpot, "e2el": o.latency}
    return all(values[name] * 1000.0 <= slo for name, slo in slos.items())


def calculate_metrics(outputs: list, duration_s: float, percentile_metrics: list,
                      percentiles: list, goodput: Optional[dict] = None) -> dict:
    """Upstream's aggregate fields, plus `failed` (ours). Times in ms; mean/median/std/pXX of the
    selected metrics, keyed as upstream keys them (`mean_ttft_ms`, `p99_output_len`, ...)."""
    samples = per_request_samples(outputs)
    done = [o for o in outputs if o.success and o.output_tokens]
    total_input = sum(o.prompt_tokens for o in done)
    total_output = sum(samples["output_len"])
    duration_s = duration_s or float("nan")
    result = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        # upstream's key, colon included: requests/s meeting every --goodput SLO
        "request_goodput:": sum(_meets(o, goodput) for o in done) / duration_s if goodput else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    for name in percentile_metrics:
        scale, suffix = (1000.0, "_ms") if name in {n for n, _, _ in TIME_SECTIONS} else (1.0, "")
        values = np.asarray(samples[name] or [0.0], dtype=np.float64) * scale
        result[f"mean_{name}{suffix}"] = float(values.mean())
        result[f"median_{name}{suffix}"] = float(np.median(values))
        result[f"std_{name}{suffix}"] = float(values.std())
        for p in percentiles:
            result[f"p{_p_word(p)}_{name}{suffix}"] = float(np.percentile(values, p))
    return result


def print_result(result: dict, percentile_metrics: list, percentiles: list) -> None:
    """Upstream's layout: a totals block, then one section per selected metric."""
    width = 50
    row = "{:<40} {:<10}".format
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=width, c="="))
    print(row("Successful requests:", result["completed"]))
    print(row("Failed requests:", result["failed"]))
    print(row("Benchmark duration (s):", f"{result['duration']:.2f}"))
    print(row("Total input tokens:", result["total_input_tokens"]))
    print(row("Total generated tokens:", result["total_output_tokens"]))
    print(row("Request throughput (req/s):", f"{result['request_throughput']:.3f}"))
    if result.get("request_goodput:") is not None:
        print(row("Request goodput (req/s):", f"{result['request_goodput:']:.2f}"))
    print(row("Output token throughput (tok/s):", f"{result['output_throughput']:.2f}"))
    print(row("Total Token throughput (tok/s):", f"{result['total_token_throughput']:.2f}"))

    def section(name: str, label: str, header: str, unit: str) -> None:
        if name not in percentile_metrics:
            return
        suffix = "_ms" if unit else ""
        print("{s:{c}^{n}}".format(s=header, n=width, c="-"))
        print(row(f"Mean {label}{unit}:", f"{result[f'mean_{name}{suffix}']:.2f}"))
        print(row(f"Median {label}{unit}:", f"{result[f'median_{name}{suffix}']:.2f}"))
        for p in percentiles:
            print(row(f"P{_p_word(p)} {label}{unit}:", f"{result[f'p{_p_word(p)}_{name}{suffix}']:.2f}"))

    section(*DECODE_SECTION, "")
    for name, label, header in TIME_SECTIONS:
        section(name, label, header, " (ms)")
    for name, label, header in LENGTH_SECTIONS:
        section(name, label, header, "")
    print("=" * width)


# ----------------------------------------------------------------------------- server


async def fetch_server_info(models_url: str) -> list:
    """The model entries of GET /v1/models, or a BenchmarkError naming the URL."""
    headers = {"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"} if os.environ.get("OPENAI_API_KEY") else {}
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(models_url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as response:
                if response.status != 200:
                    raise BenchmarkError(f"GET {models_url} returned HTTP {response.status}: "
                                         f"{(await response.text())[:300]}")
                return (await response.json()).get("data") or []
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise BenchmarkError(f"cannot reach the server at {models_url} ({type(exc).__name__}: {exc}); "
                             "is the api_server running on that host and port?") from None


def resolve_server_info(entries: list, model: Optional[str]) -> ServerInfo:
    if model is None:
        if not entries:
            raise BenchmarkError("the server lists no models; pass --model")
        entry = entries[0]
    else:
        entry = next((e for e in entries if e.get("id") == model), entries[0] if entries else {})
    return ServerInfo(model=model or entry["id"], vocab_size=entry.get("vocab_size"),
                      max_model_len=entry.get("max_model_len"))


# ----------------------------------------------------------------------------- run


def load_requests(args: argparse.Namespace, info: ServerInfo) -> list:
    try:
        if args.dataset_name == "EB":
            return sample_eb(args.dataset_path, args.num_prompts, args.seed, args.shuffle)
        if args.dataset_name == "EBChat":
            return sample_eb_chat(args.dataset_path, args.num_prompts, args.sharegpt_output_len, args.seed,
                                  args.shuffle)
        if args.dataset_name == "random":
            return sample_random_text(args.num_prompts, args.random_input_len, args.random_output_len,
                                      args.random_range_ratio, args.seed)
        requests = sample_random_ids(args.num_prompts, args.random_input_len, args.random_output_len,
                                     args.random_range_ratio, info.vocab_size or args.tokenizer_vocab_size,
                                     args.seed, as_text=args.backend == "openai-chat")
    except (DatasetError, OSError) as exc:
        raise BenchmarkError(str(exc)) from None
    longest = max(r.prompt_len + r.expected_output_len for r in requests)
    if info.max_model_len is not None and longest > info.max_model_len:
        raise BenchmarkError(f"input + output length reaches {longest} tokens but the server's max_model_len is "
                             f"{info.max_model_len}; lower --random-input-len/--random-output-len")
    return requests


def load_hyperparameters(path: Optional[str]) -> dict:
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            params = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise BenchmarkError(f"cannot read --hyperparameter-path {path}: {exc}") from None
    if not isinstance(params, dict):
        raise BenchmarkError(f"--hyperparameter-path {path} must hold a mapping of request fields")
    return params


async def benchmark(*, backend: str, api_url: str, model: str, requests: list, hyper_parameters: dict,
                    request_rate: float = float("inf"), burstiness: float = 1.0,
                    max_concurrency: Optional[int] = None, ignore_eos: bool = False, logprobs: Optional[int] = None,
                    pd_metrics: bool = False, debug: bool = False, drop_ratio: float = 0.0, seed: int = 0,
                    disable_tqdm: bool = False, initial_test: bool = True) -> tuple[dict, list]:
    """Send `requests` to `api_url`; returns (aggregate-ready raw fields, outputs in finish order)."""
    request_func = ASYNC_REQUEST_FUNCS[backend]
    if burstiness <= 0:
        raise BenchmarkError(f"--burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise BenchmarkError(f"--request-rate must be > 0, got {request_rate}")
    if not 0.0 <= drop_ratio < 1.0:
        raise BenchmarkError(f"--drop-ratio must be in [0, 1), got {drop_ratio}")

    def to_input(req: SampleRequest) -> RequestFuncInput:
        return RequestFuncInput(no=req.no, prompt=req.prompt, history_QA=req.history_QA,
                                hyper_parameters=hyper_parameters, api_url=api_url, prompt_len=req.prompt_len,
                                output_len=req.expected_output_len, model=model, logprobs=logprobs,
                                ignore_eos=ignore_eos, debug=debug, pd_metrics=pd_metrics,
                                response_format=req.response_format, random_flag=req.random_flag,
                                fixed_output_len=req.fixed_output_len)

    connector = aiohttp.TCPConnector(limit=max_concurrency or 0)
    async with aiohttp.ClientSession(timeout=AIOHTTP_TIMEOUT, connector=connector, trust_env=True) as session:
        if initial_test:
            # Upstream's single test request (kept short here): a wrong endpoint or model fails at
            # once with the server's message instead of N times.
            short = replace(requests[0], expected_output_len=min(4, requests[0].expected_output_len))
            probe = await request_func(to_input(short), session=session)
            if not probe.success:
                raise BenchmarkError(f"initial test request to {api_url} failed: {probe.error}")

        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="requests")

        async def send(req: SampleRequest) -> RequestFuncOutput:
            if semaphore is None:
                return await request_func(to_input(req), pbar=progress, session=session)
            async with semaphore:
                return await request_func(to_input(req), pbar=progress, session=session)

        start = time.perf_counter()
        tasks = [asyncio.create_task(send(req)) async for req in get_request(requests, request_rate, burstiness,
                                                                                seed)]
        outputs: list = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        progress.close()

    outputs.sort(key=lambda o: o.end_timestamp)
    kept = outputs
    if drop_ratio > 0:
        # Upstream: drop drop_ratio of the requests, half from each end of the finish order, and
        # time the rest from the first kept finish to the last.
        half = int(len(outputs) * drop_ratio) // 2
        kept = [o for o in outputs[half:len(outputs) - half] if o.end_timestamp]
        if len(kept) < 2:
            raise BenchmarkError(f"--drop-ratio {drop_ratio} leaves {len(kept)} finished requests")
        duration = kept[-1].end_timestamp - kept[0].end_timestamp
    return {"duration": duration, "kept": kept}, outputs


def build_result(args: argparse.Namespace, info: ServerInfo, requests: list, raw: dict, outputs: list,
                 percentile_metrics: list, percentiles: list) -> dict:
    """Upstream's result JSON: setup, traffic, aggregates, then the per-request lists."""
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "model_id": info.model,
        "tokenizer_id": args.tokenizer or info.model,
        "num_prompts": args.num_prompts,
    }
    for item in args.metadata or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise BenchmarkError(f"--metadata takes KEY=VALUE, got {item!r}")
        result[key.strip()] = value.strip()
    result.update(request_rate=args.request_rate if args.request_rate < float("inf") else "inf",
                  burstiness=args.burstiness, max_concurrency=args.max_concurrency)
    result.update(calculate_metrics(raw["kept"], raw["duration"], percentile_metrics, percentiles,
                                    parse_goodput(args.goodput)))
    done = [o for o in outputs if o.success and o.output_tokens]
    # Upstream's per-request lists: result key -> the RequestFuncOutput field it lists.
    per_request = {"reasoning_lens": "reasoning_tokens", "input_lens": "prompt_len", "infer_input_lens": "prompt_tokens",
                   "ttfts": "ttft", "res_ttfts": "res_ttft", "itls": "itl", "generated_texts": "generated_text",
                   "reasoning_contents": "reasoning_content", "errors": "error", "metrics": "metrics"}
    result.update({key: [getattr(o, field) for o in outputs] for key, field in per_request.items()},
                  output_lens=[o.output_tokens for o in done], input_texts=[r.prompt for r in requests])
    if args.save_detailed:  # ours: what the server-side sections were computed from
        result.update(arrival_times=[o.arrival_time for o in outputs], e2els=[o.latency for o in outputs])
    return result


def _parse_list(text: str, valid: Optional[set] = None) -> list:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if valid is not None:
        unknown = [item for item in items if item not in valid]
        if unknown:
            raise BenchmarkError(f"unknown metric(s) {unknown}; choose from {sorted(valid)}")
    return items


def _base_url(args: argparse.Namespace) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    hosts = [h.strip() for item in args.ip_list or [] for h in item.split(",") if h.strip()]
    if len(hosts) > 1:
        raise BenchmarkError("--ip-list with several servers is not supported; run once per server")
    return f"http://{hosts[0]}" if hosts else f"http://{args.host}:{args.port}"


async def run_benchmark_async(args: argparse.Namespace) -> dict:
    """Everything `main` does except printing errors and exiting: returns the result dict."""
    base_url = _base_url(args)
    percentile_metrics = _parse_list(args.percentile_metrics, ALL_METRICS)
    try:
        percentiles = [float(p) for p in _parse_list(args.metric_percentiles)]
    except ValueError:
        raise BenchmarkError(f"--metric-percentiles must be numbers, got {args.metric_percentiles!r}") from None
    if any(not 0 <= p <= 100 for p in percentiles):
        raise BenchmarkError("--metric-percentiles must lie in [0, 100]")
    hyper_parameters = load_hyperparameters(args.hyperparameter_path)

    info = resolve_server_info(await fetch_server_info(base_url + "/v1/models"), args.served_model_name or args.model)
    requests = load_requests(args, info)
    endpoint = args.endpoint or DEFAULT_ENDPOINTS[args.backend]
    print(f"Model {info.model!r} (max_model_len {info.max_model_len}); {len(requests)} {args.dataset_name} prompts "
          f"to {endpoint}, request rate {args.request_rate}, burstiness {args.burstiness}, "
          f"max concurrency {args.max_concurrency}, drop ratio {args.drop_ratio}"
          + (f", request yaml {args.hyperparameter_path}" if hyper_parameters else ""))
    raw, outputs = await benchmark(
        backend=args.backend, api_url=base_url + endpoint, model=info.model, requests=requests,
        hyper_parameters=hyper_parameters, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
        pd_metrics=args.pd_metrics, debug=args.debug, drop_ratio=args.drop_ratio, seed=args.seed,
        disable_tqdm=args.disable_tqdm)
    result = build_result(args, info, requests, raw, outputs, percentile_metrics, percentiles)
    print_result(result, percentile_metrics, percentiles)
    if args.save_result:
        save_result(args, result)
    if args.json:
        _write_json(args.json, result)
    return result


def run_benchmark(args: argparse.Namespace) -> dict:
    return asyncio.run(run_benchmark_async(args))


def _write_json(path: str, record: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, ensure_ascii=False)


def save_result(args: argparse.Namespace, result: dict) -> str:
    """Upstream's file name: {backend}-{rate}qps[-concurrency{c}]-{model}-{date}.json."""
    name = args.result_filename
    if name is None:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        model = str(result["model_id"]).rstrip("/").split("/")[-1]
        name = f"{args.backend}-{args.request_rate}qps{concurrency}-{model}-{result['date']}.json"
    path = os.path.join(args.result_dir, name) if args.result_dir else name
    _write_json(path, result)
    print(f"Result saved to {path}")
    return path


def build_parser() -> argparse.ArgumentParser:
    """Upstream's flags and defaults; the ones this engine has no use for are accepted and ignored."""
    p = argparse.ArgumentParser(description="Benchmark the online serving throughput.")
    p.add_argument("--backend", choices=sorted(ASYNC_REQUEST_FUNCS), default="openai-chat")
    p.add_argument("--base-url", default=None, help="Server or API base url if not using http host and port.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None,
                   help="API endpoint (default: /v1/completions for openai, /v1/chat/completions for openai-chat).")
    p.add_argument("--ip-list", nargs="*", default=[], help="ip:port of the server (one).")
    p.add_argument("--dataset-name", default="EBChat", choices=["EB", "EBChat", "random", "random-ids"])
    p.add_argument("--dataset-path", default=None, help="jsonl file of the EB / EBChat dataset.")
    p.add_argument("--hyperparameter-path", default=None, help="request yaml merged into every request.")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--model", default=None, help="Served model name (default: the first the server lists).")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--use-beam-search", action="store_true")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--pd-metrics", action="store_true", help="ask for per-request metrics (collect_metrics).")
    p.add_argument("--drop-ratio", type=float, default=0.0, help="Drop ratio of the outputs. [0, 1)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--debug", action="store_true")
    p.add_argument("--save-detailed", action="store_true",
                   help="also save every chunk's arrival_time and every E2E latency")
    p.add_argument("--metadata", metavar="KEY=VALUE", nargs="*")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,reasoning_len",
                   help=f"comma-separated, from: {','.join(sorted(ALL_METRICS))}")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--goodput", nargs="+", required=False)
    p.add_argument("--sonnet-input-len", type=int, default=550)
    p.add_argument("--sonnet-output-len", type=int, default=150)
    p.add_argument("--sonnet-prefix-len", type=int, default=200)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--random-input-len", type=int, default=200)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.1)
    p.add_argument("--hf-subset", default=None)
    p.add_argument("--hf-split", default=None)
    p.add_argument("--hf-output-len", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--tokenizer-mode", default="auto", choices=["auto", "slow", "mistral", "custom"])
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--lora-modules", nargs="+", default=None)
    ours = p.add_argument_group("ours")
    ours.add_argument("--tokenizer-vocab-size", type=int, default=256,
                      help="random-ids: vocabulary size when /v1/models does not report one.")
    ours.add_argument("--json", default=None, metavar="PATH", help="write the result dict to PATH")
    return p


def main(argv: Optional[list] = None) -> int:
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
