"""`bench_recycling.py --engine server`: the real api_server, started once per arm, driven over HTTP.

Both servers get identical settings and the same KV memory (--num-gpu-blocks-override), head-wise tables
in both, FD_HEAD_WISE_SWA_RECYCLE=0 then 1; each gets the same fixed-length workload from
benchmark_serving.py's client while /metrics is sampled (running requests, pages in use). Settings come
from a YAML file (--config, benchmarks/yaml/*.yaml: server: and workload: sections), then from the
command line.
"""

from __future__ import annotations

import asyncio
import math
import os
import tempfile
import time
from typing import Optional

import aiohttp
import yaml

import benchmark_serving
from bench_recycling import log, plot, summary
from fastdeploy.entrypoints.openai.metrics import prometheus_totals
from fastdeploy.entrypoints.openai.server_process import ApiServerProcess, free_port, settings_to_flags

SERVER_KEYS = ("model", "max_model_len", "block_size", "num_gpu_blocks_override", "max_num_seqs",
               "max_num_batched_tokens", "head_wise_swa_config")
WORKLOAD_KEYS = ("num_prompts", "input_len", "output_len", "request_rate", "max_concurrency", "seed")
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "yaml", "swa_1of4.yaml")
RUNNING, WAITING, TOTAL, FREE, STEPS = (f"fastdeploy:{name}" for name in (
    "num_requests_running", "num_requests_waiting", "kv_pages_total", "kv_pages_free", "engine_steps_total"))


def load_settings(args) -> tuple:
    """(server, workload) settings: the YAML file, then every option given on the command line."""
    with open(args.config or DEFAULT_CONFIG) as f:
        raw = yaml.safe_load(f) or {}
    server, workload = dict(raw.get("server") or {}), dict(raw.get("workload") or {})
    unknown = (set(raw) - {"server", "workload"}) | {f"server.{k}" for k in set(server) - set(SERVER_KEYS)} \
        | {f"workload.{k}" for k in set(workload) - set(WORKLOAD_KEYS)}
    if unknown:
        raise ValueError(f"{args.config}: unknown key(s) {sorted(unknown)}")
    given = {**vars(args), "model": args.model[0] if args.model else None}
    server.update({k: given[k] for k in SERVER_KEYS if given.get(k) is not None})
    workload.update({k: given[k] for k in WORKLOAD_KEYS if given.get(k) is not None})
    missing = [f"server.{k}" for k in ("num_gpu_blocks_override", "max_num_seqs") if server.get(k) is None]
    missing += [f"workload.{k}" for k in ("num_prompts", "input_len", "output_len") if workload.get(k) is None]
    if missing:  # the A/B is only meaningful at a fixed KV budget and a fixed workload
        raise ValueError(f"missing setting(s) {missing}: set them in {args.config} or on the command line")
    workload["request_rate"] = float(workload.get("request_rate", "inf"))  # YAML reads `.inf`, not `inf`
    workload.setdefault("seed", 0)
    return server, workload


def predict(server: dict, workload: dict) -> dict:
    """running_off / running_on / ceiling from the engine's own page-need arithmetic (head-wise mode)."""
    from fastdeploy import envs
    from fastdeploy.cache_manager.head_wise import predicted_concurrency
    from fastdeploy.engine.args_utils import EngineArgs

    with envs.override(FD_HEAD_WISE_KV_CACHE=1):
        fd_config = EngineArgs(**{k: v for k, v in server.items() if v is not None}).create_engine_config()
    return dict(predicted_concurrency(fd_config, workload["input_len"], workload["output_len"]))


async def metrics(session, url: str) -> dict:
    try:
        async with session.get(url) as response:
            return prometheus_totals(await response.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return {}  # a missed sample


async def poll(url: str, series: dict, stop: asyncio.Event, label: str, interval_s: float = 0.2) -> None:
    start, next_report = time.perf_counter(), 10.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while not stop.is_set():
            values, now = await metrics(session, url), time.perf_counter() - start
            if {RUNNING, FREE, TOTAL} <= set(values):
                series["pages_total"] = values[TOTAL]
                for key, value in (("x", now), ("running", values[RUNNING]), ("waiting", values.get(WAITING, 0.0)),
                                   ("pages", values[TOTAL] - values[FREE])):
                    series[key].append(value)
                if now >= next_report:
                    next_report += 10.0
                    log(f"[{label}] t={now:5.0f}s running={values[RUNNING]:.0f} pages in use="
                        f"{series['pages'][-1]:.0f}/{values[TOTAL]:.0f}")
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            except asyncio.TimeoutError:
                pass


async def idle_steps(url: str, timeout_s: float = 30.0) -> Optional[float]:
    """engine_steps_total once /metrics shows an idle engine with every page free (a snapshot from after the
    run's last step, not from inside it)."""
    deadline = time.perf_counter() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.perf_counter() < deadline:
            values = await metrics(session, url)
            if values.get(RUNNING) == 0 and STEPS in values and values.get(FREE) == values.get(TOTAL):
                return values[STEPS]
            await asyncio.sleep(0.1)
    return None


async def drive(base_url: str, workload: dict, label: str) -> tuple:
    argv = ["--base-url", base_url, "--backend", "openai", "--dataset-name", "random-ids",
            "--random-input-len", str(workload["input_len"]), "--random-output-len", str(workload["output_len"]),
            "--random-range-ratio", "0",  # exact lengths: the page arithmetic predicts these peaks
            "--num-prompts", str(workload["num_prompts"]), "--request-rate", str(workload["request_rate"]),
            "--seed", str(workload["seed"]), "--ignore-eos", "--metric-percentiles", "50,99", "--disable-tqdm"]
    if workload.get("max_concurrency"):
        argv += ["--max-concurrency", str(workload["max_concurrency"])]
    series, stop = {"x": [], "running": [], "waiting": [], "pages": [], "pages_total": None}, asyncio.Event()
    before = await idle_steps(base_url + "/metrics")
    poller = asyncio.create_task(poll(base_url + "/metrics", series, stop, label))
    try:
        result = await benchmark_serving.run_benchmark_async(benchmark_serving.build_parser().parse_args(argv))
    finally:
        stop.set()
        await poller
    after = await idle_steps(base_url + "/metrics")
    return result, series, (after - before) if before is not None and after is not None else None


def server_arm(name: str, recycle: int, server: dict, workload: dict, args) -> dict:
    port = args.port or free_port()
    log_path = os.path.join(args.log_dir, f"server_recycle_{name}.log")
    log(f"[{name}] starting the server on port {port} (FD_HEAD_WISE_SWA_RECYCLE={recycle}); log: {log_path}")
    proc = ApiServerProcess(settings_to_flags({k: server.get(k) for k in SERVER_KEYS}), port=port, metrics_port=port,
                            env={"FD_HEAD_WISE_KV_CACHE": "1", "FD_HEAD_WISE_SWA_RECYCLE": str(recycle)},
                            log_path=log_path)
    try:
        proc.wait_healthy(args.startup_timeout, poll_interval_s=0.5)
        try:
            result, series, steps = asyncio.run(drive(proc.base_url, workload, name))
        except benchmark_serving.BenchmarkError as exc:
            raise ValueError(f"[{name}] benchmark failed: {exc}\nlast server log lines:\n{proc.log_tail()}") from None
    finally:
        proc.stop(timeout_s=30.0)
    log(f"[{name}] {result['output_throughput']:.1f} output tok/s, peak running {max(series['running'], default=0):.0f}")
    return {"throughput": result["output_throughput"], "peak_running": max(series["running"], default=0.0),
            "peak_pages": max(series["pages"], default=0.0), "pages_total": series["pages_total"], "steps": steps,
            "elapsed_s": result["duration"], **{k: result[k] for k in (
                "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "completed", "failed",
                "total_output_tokens")}, "timeline": series}


def run_server(args) -> dict:
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="bench_recycling_server_")
    os.makedirs(args.log_dir, exist_ok=True)
    server, workload = load_settings(args)
    pred = predict(server, workload)
    log(f"predicted running requests: OFF {pred['running_off']}, ON {pred['running_on']}; ceiling "
        f"{pred['ceiling']:.3f}" + ("; the ceiling is 1: not memory-bound, recycling cannot help" if pred["ceiling"] <= 1
                                    else ""))
    off, on = (server_arm(name, recycle, server, workload, args) for name, recycle in (("off", 0), ("on", 1)))
    if args.plot:
        plot(args.plot, "Head-wise SWA recycling: OFF vs ON at the same KV memory",
             [(f"recycle {n.upper()}", a["timeline"]["x"], a["timeline"]["running"], a["timeline"]["pages"])
              for n, a in (("off", off), ("on", on))], off["pages_total"], "time since the benchmark started (s)")
    return summary(off, on, pred, kv_pages_total=off["pages_total"], server=server, workload={
        k: "inf" if isinstance(v, float) and math.isinf(v) else v for k, v in workload.items()})
