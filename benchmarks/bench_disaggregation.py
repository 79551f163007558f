"""Prefill/decode disaggregation, measured (docs/disaggregation.md).

  bytes     real models, a prefill engine and a decode engine in one process moving one prompt's KV over
            NIXL (UCX, host memory): bytes and pages moved per request, flag off vs on, at each prompt
            length, beside the page-need arithmetic of the same layout; the read's time and GB/s beside
            this machine's memory copy speed of the same bytes.
  capacity  the decode engine at a fixed KV memory: requests whose KV arrived running at once, flag off vs
            on (prompts share a prefix, so the prefill side's prefix cache keeps it cheap; the decode
            side holds each request's pages on its own).
  latency   HTTP servers, each pinned to its own core (taskset): inter-token latency of running decodes
            while long prompts arrive, one mixed server vs a prefill + decode pair behind vllm-router; then
            TTFT and throughput at 1 and 8 concurrent requests, router vs one server.

Progress goes to stderr; --json writes every row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODELS = {"gemma-3-270m": "Gemma 3 270M (its sliding layers recycled)",
          "smollm2-135m-instruct": "SmolLM2-135M (shipped per-head windows)"}


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


@contextmanager
def flag(value: str):
    old = os.environ.get("FD_HEAD_WISE_KV_CACHE")
    os.environ["FD_HEAD_WISE_KV_CACHE"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FD_HEAD_WISE_KV_CACHE", None)
        else:
            os.environ["FD_HEAD_WISE_KV_CACHE"] = old


def prose_ids(tokenizer, n: int) -> list:
    """The first n tokens of Python's documentation prose (the same text for every configuration)."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    ids = tokenizer.encode_prompt(text)
    assert len(ids) >= n, f"only {len(ids)} tokens of prose"
    return ids[:n]


def make_engine(model: str, head_wise: str, role: str, kv_memory: int, max_len: int, max_num_seqs: int = 8):
    from fastdeploy.engine.args_utils import EngineArgs
    from fastdeploy.engine.engine import LLMEngine

    with flag(head_wise):
        return LLMEngine.from_engine_args(EngineArgs(
            model=model, max_model_len=max_len, kv_cache_memory=kv_memory, max_num_seqs=max_num_seqs,
            splitwise_role=role, kv_transfer_config={"kv_connector": "NixlConnector", "side_channel_port": 0}))


def engine_pair(model: str, head_wise: str, kv_memory: int, max_len: int) -> tuple:
    return tuple(make_engine(model, head_wise, role, kv_memory, max_len) for role in ("prefill", "decode"))


def run(engine, rid, prompt, params, kv=None, until=None):
    engine.add_request(rid, prompt, params, kv)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def settle(*engines) -> None:
    while any(e.transfers_pending for e in engines):
        for e in engines:
            e.step()
        time.sleep(0.001)


def memcpy_gbps(nbytes: int) -> float:
    src = np.ones(max(nbytes, 1 << 20), np.uint8)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
    return src.nbytes / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bytes_rows(models: list, lengths: list) -> list:
    from fastdeploy.cache_manager.head_wise import table_length
    from fastdeploy.engine.request import SamplingParams

    rows = []
    one, greedy = SamplingParams(temperature=0, max_tokens=1), SamplingParams(temperature=0, max_tokens=2)
    for model in models:
        for head_wise in ("0", "1"):
            prefill, decode = engine_pair(model, head_wise, 1 << 30, max(lengths) + 16)
            try:
                for n in lengths:
                    prompt = prose_ids(prefill.tokenizer, n)
                    t = time.perf_counter()
                    handed = run(prefill, f"p{n}", prompt, one, {"do_remote_decode": True})
                    prefill_s = time.perf_counter() - t
                    before = decode.get_stats()
                    run(decode, f"d{n}", prompt, greedy, handed.kv_transfer_params)
                    settle(prefill, decode)
                    after = decode.get_stats()
                    moved = after["kv_transfer_bytes_received_total"] - before["kv_transfer_bytes_received_total"]
                    pages = after["kv_transfer_pages_received_total"] - before["kv_transfer_pages_received_total"]
                    seconds = after["kv_transfer_seconds"]["sum"] - before["kv_transfer_seconds"]["sum"]
                    kv = decode.scheduler.kv_cache_manager
                    page_bytes = decode.connector.entry_bytes // kv.pages_per_entry
                    layout = decode.scheduler.layout
                    # the arithmetic: the pages a query after tokens [0, n - 1) can read
                    arithmetic = sum(layout.pages_per_rank(n - 1, 0)) if kv.num_rows > 1 \
                        else table_length(n - 1, kv.block_size) * layout.num_slots
                    row = dict(model=model, head_wise=int(head_wise), prompt_tokens=n, bytes_moved=int(moved),
                               pages_moved=int(pages), arithmetic_pages=int(arithmetic),
                               arithmetic_bytes=int(arithmetic * page_bytes), read_s=round(seconds, 5),
                               read_gbps=round(moved / seconds / 1e9, 3) if seconds else None,
                               memcpy_gbps=round(memcpy_gbps(int(moved)), 2), prefill_s=round(prefill_s, 2))
                    rows.append(row)
                    log(json.dumps(row))
            finally:
                prefill.close()
                decode.close()
    for row in rows:  # flag-on bytes over flag-off bytes of the same model and length
        off = next(r for r in rows if r["model"] == row["model"] and r["prompt_tokens"] == row["prompt_tokens"]
                   and not r["head_wise"])
        row["ratio_to_flag_off"] = round(row["bytes_moved"] / off["bytes_moved"], 3)
    return rows


def capacity_rows(models: list, prompt_tokens: int, kv_memory: int, num_requests: int) -> list:
    """Requests whose KV arrived running at once on the decode engine, at the same KV memory."""
    from fastdeploy.engine.request import SamplingParams

    rows = []
    for model in models:
        for head_wise in ("0", "1"):
            prefill = make_engine(model, head_wise, "prefill", max(kv_memory, 1 << 30), prompt_tokens + 64, num_requests)
            decode = make_engine(model, head_wise, "decode", kv_memory, prompt_tokens + 64, num_requests)
            try:
                shared = prose_ids(prefill.tokenizer, prompt_tokens - 8)
                handed = []
                for i in range(num_requests):
                    prompt = shared + prefill.tokenizer.encode_prompt(f" Question {i}: why?")[:8]
                    out = run(prefill, f"p{i}", prompt, SamplingParams(temperature=0, max_tokens=1),
                              {"do_remote_decode": True})
                    handed.append((prompt, out.kv_transfer_params))
                for i, (prompt, params) in enumerate(handed):
                    decode.add_request(f"d{i}", prompt, SamplingParams(temperature=0, max_tokens=32,
                                                                       ignore_eos=True), params)
                peak, held = 0, []
                kv = decode.scheduler.kv_cache_manager
                while decode.has_unfinished_requests() or decode.transfers_pending:
                    decode.step()
                    running = [r for r in decode.scheduler.running if not r.kv_loading]
                    peak = max(peak, len(running))
                    held += [sum(kv.held_pages_per_slot(r.request_id)) for r in running]
                    prefill.step()  # frees the pages the decode engine has read
                settle(prefill, decode)
                row = dict(model=model, head_wise=int(head_wise), prompt_tokens=prompt_tokens,
                           kv_cache_memory=kv_memory, kv_pages_total=kv.pages.num_total_pages,
                           decode_pages_per_request=max(held), decode_running_peak=peak, requests=num_requests)
                rows.append(row)
                log(json.dumps(row))
            finally:
                prefill.close()
                decode.close()
    return rows


# -- latency: HTTP servers pinned to cores ----------------------------------------------------------------
def start_server(args: list, port: int, cores: str, env: dict, log_path: Path):
    """An api_server pinned to `cores` (taskset), its threads as many as its cores."""
    cmd = ["taskset", "-c", cores, sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server",
           "--port", str(port), "--disable-uvicorn-access-log", *args]
    threads = str(len(cores.split(",")))
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": threads, **env}, stdout=open(log_path, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)


def wait_http(url: str, timeout_s: float = 300) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} not up after {timeout_s} s")


async def stream_completion(session, url: str, prompt, max_tokens: int) -> dict:
    """One streamed completion: TTFT, the gaps between tokens, the end time."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    stamps = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - start, "gaps": [b - a for a, b in zip(stamps, stamps[1:])],
            "tokens": len(stamps), "end": stamps[-1] - start}


async def interference(url: str, short: list, long_prompts: list, decode_tokens: int, gap_s: float) -> dict:
    """Decodes run while long prompts arrive every gap_s: their inter-token gaps."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        decodes = [asyncio.ensure_future(stream_completion(session, url, p, decode_tokens)) for p in short]
        await asyncio.sleep(1.0)
        longs = []
        for p in long_prompts:
            longs.append(asyncio.ensure_future(stream_completion(session, url, p, 4)))
            await asyncio.sleep(gap_s)
        results = await asyncio.gather(*decodes)
        await asyncio.gather(*longs)
    gaps = sorted(g for r in results for g in r["gaps"])
    return {"itl_p50_ms": round(1000 * gaps[len(gaps) // 2], 1), "itl_p99_ms": round(1000 * gaps[int(len(gaps) * 0.99)], 1),
            "itl_max_ms": round(1000 * gaps[-1], 1)}


async def load(url: str, prompts: list, max_tokens: int, concurrency: int) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)

    async def one(session, p):
        async with sem:
            return await stream_completion(session, url, p, max_tokens)

    start = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        results = await asyncio.gather(*(one(session, p) for p in prompts))
    wall = time.perf_counter() - start
    ttfts = sorted(r["ttft"] for r in results)
    return {"concurrency": concurrency, "ttft_p50_s": round(statistics.median(ttfts), 3),
            "output_tok_s": round(sum(r["tokens"] for r in results) / wall, 1), "wall_s": round(wall, 1)}


def latency_rows(model: str, head_wise: str, long_tokens: int, out_dir: Path) -> list:
    import shutil

    from fastdeploy.input.tokenizer_loader import load_tokenizer
    from fastdeploy.model_config import ModelConfig

    tokenizer = load_tokenizer(ModelConfig.create(model, 4096, None))
    env = {"FD_HEAD_WISE_KV_CACHE": head_wise}
    common = ["--model", model, "--max-model-len", str(long_tokens + 512), "--max-num-seqs", "16"]
    transfer = json.dumps({"kv_connector": "NixlConnector", "side_channel_port": 0})
    long_prompts = [prose_ids(tokenizer, long_tokens + 50 * i)[50 * i:] for i in range(4)]
    short = [f"Story {i}: once upon a time" for i in range(4)]
    mixed_prompts = [f"Question {i}: explain how a compiler works." for i in range(16)]
    rows, procs = [], []
    ports = dict(mixed=18301, prefill=18302, decode=18303, router=18300)
    try:
        for name, core in (("mixed one core", "0"), ("mixed two cores", "0,1")):
            p = start_server(common, ports["mixed"], core, env, out_dir / "mixed.log")
            wait_http(f"http://127.0.0.1:{ports['mixed']}/health")
            url = f"http://127.0.0.1:{ports['mixed']}"
            row = {"setup": name, **asyncio.run(interference(url, short, long_prompts, 96, 2.0))}
            for c in (1, 8):
                row[f"c{c}"] = asyncio.run(load(url, mixed_prompts[:max(4, 2 * c)], 64, c))
            rows.append(row)
            log(json.dumps(row))
            os.killpg(p.pid, 15)
            p.wait()
        pre = start_server(common + ["--splitwise-role", "prefill", "--kv-transfer-config", transfer], ports["prefill"],
                           "0", env, out_dir / "prefill.log")
        dec = start_server(common + ["--splitwise-role", "decode", "--kv-transfer-config", transfer], ports["decode"],
                           "1", env, out_dir / "decode.log")
        procs += [pre, dec]
        for role in ("prefill", "decode"):
            wait_http(f"http://127.0.0.1:{ports[role]}/health")
        router_bin = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
        router = subprocess.Popen([router_bin, "--host", "127.0.0.1", "--port", str(ports["router"]),
                                   "--vllm-pd-disaggregation", "--kv-connector", "nixl", "--policy", "round_robin",
                                   "--prometheus-port", "18309", "--prefill", f"http://127.0.0.1:{ports['prefill']}",
                                   "--decode", f"http://127.0.0.1:{ports['decode']}"],
                                  stdout=open(out_dir / "router.log", "wb"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        procs.append(router)
        wait_http(f"http://127.0.0.1:{ports['router']}/health")
        url = f"http://127.0.0.1:{ports['router']}"
        row = {"setup": "prefill core 0 + decode core 1, vllm-router",
               **asyncio.run(interference(url, short, long_prompts, 96, 2.0))}
        for c in (1, 8):
            row[f"c{c}"] = asyncio.run(load(url, mixed_prompts[:max(4, 2 * c)], 64, c))
        rows.append(row)
        log(json.dumps(row))
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, 15)
                p.wait(30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
    for row in rows:
        row.update(model=model, head_wise=int(head_wise), long_prompt_tokens=long_tokens)
    return rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["bytes", "capacity", "latency"])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 3000, 4000, 8000],
                        help="prompt tokens (bytes)")
    parser.add_argument("--prompt-tokens", type=int, default=4000, help="prompt tokens (capacity, latency)")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="decode engine's KV bytes (capacity)")
    parser.add_argument("--requests", type=int, default=32, help="decode requests (capacity)")
    parser.add_argument("--head-wise", choices=["0", "1"], default="1", help="FD_HEAD_WISE_KV_CACHE (latency)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.what == "bytes":
        rows = bytes_rows(args.models, args.lengths)
    elif args.what == "capacity":
        rows = capacity_rows(args.models, args.prompt_tokens, args.kv_cache_memory, args.requests)
    else:
        out = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_disaggregation"
        out.mkdir(exist_ok=True)
        rows = latency_rows(args.models[0], args.head_wise, args.prompt_tokens, out)
    print(json.dumps(rows, indent=1))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
