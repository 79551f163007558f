"""A/B benchmark of head-wise SWA page recycling through the real api_server.

Starts the server twice with identical settings and the same KV memory
(--num-gpu-blocks-override), head-wise KV cache on in both, SWA recycling off
(FD_HEAD_WISE_SWA_RECYCLE=0) and then on; drives each with the same fixed-length
workload; samples /metrics while it runs; prints throughput, latency, peak
running requests and peak pages in use next to the gain the page-need
arithmetic predicts (the ceiling).

    python benchmarks/bench_head_wise_swa.py --config benchmarks/yaml/swa_1of4.yaml \
        --json results/swa_1of4.json --plot results/swa_1of4.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

import aiohttp
import yaml

import benchmark_serving

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Runs from a checkout without installing; index 1 keeps benchmarks/ (the script's dir) first.
sys.path.insert(1, REPO_ROOT)

from fastdeploy.entrypoints.openai.metrics import prometheus_totals  # noqa: E402
from fastdeploy.entrypoints.openai.server_process import (  # noqa: E402
    ApiServerProcess,
    ServerStartError,
    free_port,
    settings_to_flags,
)

DEFAULT_CONFIG = os.path.join(REPO_ROOT, "benchmarks", "yaml", "swa_1of4.yaml")
SERVER_KEYS = ("model", "max_model_len", "block_size", "num_gpu_blocks_override", "max_num_seqs",
               "max_num_batched_tokens", "head_wise_swa_config")
WORKLOAD_KEYS = ("num_prompts", "input_len", "output_len", "request_rate", "max_concurrency", "seed")
METRIC_RUNNING = "fastdeploy:num_requests_running"
METRIC_WAITING = "fastdeploy:num_requests_waiting"
METRIC_PAGES_TOTAL = "fastdeploy:kv_pages_total"
METRIC_PAGES_FREE = "fastdeploy:kv_pages_free"
METRIC_STEPS = "fastdeploy:engine_steps_total"
ARMS = (("off", "0"), ("on", "1"))


class ABError(RuntimeError):
    """A failure the user must see as a message, not a traceback."""


def log(message: str) -> None:
    print(f"[bench_head_wise_swa {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ----------------------------------------------------------------------------- settings


def load_settings(args: argparse.Namespace) -> tuple[dict, dict]:
    """Server and workload settings: the YAML file, then any CLI flag that was given."""
    with open(args.config) as f:
        raw = yaml.safe_load(f) or {}
    unknown = set(raw) - {"server", "workload"}
    server, workload = dict(raw.get("server") or {}), dict(raw.get("workload") or {})
    unknown |= {f"server.{k}" for k in set(server) - set(SERVER_KEYS)}
    unknown |= {f"workload.{k}" for k in set(workload) - set(WORKLOAD_KEYS)}
    if unknown:
        raise ABError(f"{args.config}: unknown key(s) {sorted(unknown)}")
    for key in SERVER_KEYS:
        if getattr(args, key) is not None:
            server[key] = getattr(args, key)
    for key in WORKLOAD_KEYS:
        if getattr(args, key) is not None:
            workload[key] = getattr(args, key)
    if isinstance(server.get("head_wise_swa_config"), str):
        try:
            server["head_wise_swa_config"] = json.loads(server["head_wise_swa_config"])
        except json.JSONDecodeError as exc:
            raise ABError(f"head_wise_swa_config is not valid JSON: {exc}") from None
    # The A/B is only meaningful at a fixed KV budget and a fixed workload.
    required = [("server", k, server) for k in ("num_gpu_blocks_override", "max_num_seqs")]
    required += [("workload", k, workload) for k in ("num_prompts", "input_len", "output_len")]
    missing = [f"{section}.{k}" for section, k, d in required if d.get(k) is None]
    if missing:
        raise ABError(f"missing setting(s) {missing}: set them in {args.config} or on the command line")
    # YAML reads `.inf` as a float but `inf` as a string; accept both.
    workload["request_rate"] = float(workload.get("request_rate", "inf"))
    workload.setdefault("seed", 0)
    return server, workload


def predict(server: dict, workload: dict) -> dict:
    """running_off / running_on / ceiling from the engine's own page-need arithmetic."""
    # The prediction is for head-wise mode; the recycle flag itself is not an
    # input (the function predicts both arms), so only the mode is pinned.
    try:
        from fastdeploy.cache_manager.head_wise import predicted_concurrency
        from fastdeploy.engine.args_utils import EngineArgs
    except ImportError as exc:
        raise ABError(f"cannot import the engine's page-need arithmetic ({exc}); run from the repository") from None
    kwargs = {k: v for k, v in server.items() if v is not None}
    saved = os.environ.get("FD_HEAD_WISE_KV_CACHE")
    os.environ["FD_HEAD_WISE_KV_CACHE"] = "1"
    try:
        fd_config = EngineArgs(**kwargs).create_engine_config()
    except (ValueError, TypeError) as exc:
        raise ABError(f"invalid server settings: {exc}") from None
    finally:  # callers importing this function (tests) keep their environment
        if saved is None:
            os.environ.pop("FD_HEAD_WISE_KV_CACHE")
        else:
            os.environ["FD_HEAD_WISE_KV_CACHE"] = saved
    return dict(predicted_concurrency(fd_config, workload["input_len"], workload["output_len"]))


# ----------------------------------------------------------------------------- server


def server_flags(server: dict) -> list[str]:
    return settings_to_flags({key: server.get(key) for key in SERVER_KEYS})


# ----------------------------------------------------------------------------- metrics

@dataclass
class Timeline:
    times: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)
    pages_in_use: list[float] = field(default_factory=list)
    pages_total: Optional[float] = None
    engine_steps: Optional[float] = None  # model steps between the idle scrapes before and after the run


async def poll_metrics(metrics_url: str, timeline: Timeline, stop: asyncio.Event,
                       label: str, interval_s: float = 0.2, report_every_s: float = 10.0) -> None:
    start = time.perf_counter()
    next_report = report_every_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while not stop.is_set():
            try:
                async with session.get(metrics_url) as response:
                    values = prometheus_totals(await response.text())
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                values = {}  # a missed sample; the timeline goes on with the next one
            now = time.perf_counter() - start
            if METRIC_RUNNING in values and METRIC_PAGES_FREE in values and METRIC_PAGES_TOTAL in values:
                total = values[METRIC_PAGES_TOTAL]
                timeline.pages_total = total
                timeline.times.append(now)
                timeline.running.append(values[METRIC_RUNNING])
                timeline.waiting.append(values.get(METRIC_WAITING, 0.0))
                timeline.pages_in_use.append(total - values[METRIC_PAGES_FREE])
                if now >= next_report:
                    next_report += report_every_s
                    log(f"[{label}] t={now:5.0f}s running={values[METRIC_RUNNING]:.0f} "
                        f"waiting={values.get(METRIC_WAITING, 0):.0f} "
                        f"pages in use={timeline.pages_in_use[-1]:.0f}/{total:.0f}")
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            except asyncio.TimeoutError:
                pass


# ----------------------------------------------------------------------------- one arm


@dataclass
class ArmResult:
    name: str
    result: dict
    timeline: Timeline

    @property
    def peak_running(self) -> float:
        return max(self.timeline.running, default=0.0)

    @property
    def peak_pages(self) -> float:
        return max(self.timeline.pages_in_use, default=0.0)

    @property
    def engine_steps(self) -> Optional[float]:
        return self.timeline.engine_steps


async def idle_engine_steps(metrics_url: str, timeout_s: float = 30.0) -> Optional[float]:
    """fastdeploy:engine_steps_total once /metrics shows an idle engine with every page free.

    /metrics is a snapshot the engine publishes every ~0.1 s; waiting for the idle state makes
    sure the snapshot is from after the last step of the run, not from inside it.
    """
    deadline = time.perf_counter() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.perf_counter() < deadline:
            try:
                async with session.get(metrics_url) as response:
                    values = prometheus_totals(await response.text())
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                values = {}
            if (values.get(METRIC_RUNNING) == 0 and METRIC_STEPS in values
                    and values.get(METRIC_PAGES_FREE) == values.get(METRIC_PAGES_TOTAL)):
                return values[METRIC_STEPS]
            await asyncio.sleep(0.1)
    return None


async def drive(base_url: str, workload: dict, label: str) -> tuple[dict, Timeline]:
    argv = ["--base-url", base_url, "--backend", "openai", "--dataset-name", "random-ids",
            "--random-input-len", str(workload["input_len"]),
            "--random-output-len", str(workload["output_len"]),
            "--random-range-ratio", "0",  # exact lengths: the page arithmetic predicts these peaks
            "--num-prompts", str(workload["num_prompts"]),
            "--request-rate", str(workload["request_rate"]),
            "--seed", str(workload["seed"]), "--ignore-eos",
            "--metric-percentiles", "50,99", "--disable-tqdm"]
    if workload.get("max_concurrency"):
        argv += ["--max-concurrency", str(workload["max_concurrency"])]
    bench_args = benchmark_serving.build_parser().parse_args(argv)
    timeline, stop = Timeline(), asyncio.Event()
    steps_before = await idle_engine_steps(base_url + "/metrics")
    poller = asyncio.create_task(poll_metrics(base_url + "/metrics", timeline, stop, label))
    try:
        result = await benchmark_serving.run_benchmark_async(bench_args)
    finally:
        stop.set()
        await poller
    steps_after = await idle_engine_steps(base_url + "/metrics")
    if steps_before is not None and steps_after is not None:
        timeline.engine_steps = steps_after - steps_before
    return result, timeline


def run_arm(name: str, recycle: str, server: dict, workload: dict, args: argparse.Namespace) -> ArmResult:
    port = args.port or free_port()
    env = {"FD_HEAD_WISE_KV_CACHE": "1", "FD_HEAD_WISE_SWA_RECYCLE": recycle}
    log_path = os.path.join(args.log_dir, f"server_recycle_{name}.log")
    log(f"[{name}] starting server on port {port} (FD_HEAD_WISE_SWA_RECYCLE={recycle}); log: {log_path}")
    server_proc = ApiServerProcess(server_flags(server), port=port, metrics_port=port, env=env, log_path=log_path)
    base_url = server_proc.base_url
    try:
        started = time.perf_counter()
        server_proc.wait_healthy(args.startup_timeout, poll_interval_s=0.5)
        log(f"[{name}] server healthy after {time.perf_counter() - started:.1f} s; "
            f"sending {workload['num_prompts']} requests "
            f"({workload['input_len']} in / {workload['output_len']} out tokens)")
        try:
            result, timeline = asyncio.run(drive(base_url, workload, name))
        except benchmark_serving.BenchmarkError as exc:
            raise ABError(f"[{name}] benchmark failed: {exc}\nlast server log lines:\n"
                          f"{server_proc.log_tail()}") from None
    finally:
        server_proc.stop(timeout_s=30.0)
    log(f"[{name}] done: {result['output_throughput']:.1f} output tok/s, "
        f"peak running {max(timeline.running, default=0):.0f}")
    return ArmResult(name, result, timeline)


# ----------------------------------------------------------------------------- report


def summarize(off: ArmResult, on: ArmResult, prediction: dict, server: dict, workload: dict) -> dict:
    gain = on.result["output_throughput"] / off.result["output_throughput"]
    ceiling = float(prediction["ceiling"])
    summary = {
        "throughput_off": off.result["output_throughput"],
        "throughput_on": on.result["output_throughput"],
        "gain": gain,
        "ceiling": ceiling,
        # The acceptance target: at least 90% of the possible gain.
        "target_gain": 1 + 0.9 * (ceiling - 1),
        "share_of_possible_gain": (gain - 1) / (ceiling - 1) if ceiling > 1 else None,
        "predicted_running_off": prediction.get("running_off"),
        "predicted_running_on": prediction.get("running_on"),
        "kv_pages_total": off.timeline.pages_total,
        # gain = steps ratio OFF/ON / step-time ratio ON/OFF: what recycling saves in steps, and
        # what the bigger batch costs per step on this machine.
        "steps_ratio": None,
        "step_time_ratio": None,
        "gain_share_of_steps_gain": None,
        "server": server,
        # JSON has no infinity; "inf" keeps the file readable by strict parsers.
        "workload": {k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in workload.items()},
    }
    for arm in (off, on):
        r = arm.result
        summary.update({
            f"peak_running_{arm.name}": arm.peak_running,
            f"peak_pages_in_use_{arm.name}": arm.peak_pages,
            f"engine_steps_{arm.name}": arm.engine_steps,
            f"mean_ttft_ms_{arm.name}": r["mean_ttft_ms"],
            f"median_ttft_ms_{arm.name}": r["median_ttft_ms"],
            f"mean_tpot_ms_{arm.name}": r["mean_tpot_ms"],
            f"median_tpot_ms_{arm.name}": r["median_tpot_ms"],
            f"duration_s_{arm.name}": r["duration"],
            f"completed_{arm.name}": r["completed"],
            f"failed_{arm.name}": r["failed"],
            f"total_output_tokens_{arm.name}": r["total_output_tokens"],
            f"timeline_{arm.name}": {
                "t_s": arm.timeline.times,
                "running": arm.timeline.running,
                "waiting": arm.timeline.waiting,
                "pages_in_use": arm.timeline.pages_in_use,
            },
        })
    if off.engine_steps and on.engine_steps:
        summary["steps_ratio"] = off.engine_steps / on.engine_steps
        summary["step_time_ratio"] = ((on.result["duration"] / on.engine_steps)
                                      / (off.result["duration"] / off.engine_steps))
        # How much of what recycling saves in steps reaches output tok/s.
        if summary["steps_ratio"] > 1:
            summary["gain_share_of_steps_gain"] = (gain - 1) / (summary["steps_ratio"] - 1)
    return summary


def print_table(s: dict) -> None:
    rows = [
        ("Output throughput (tok/s)", "throughput_{}", "{:.1f}"),
        ("Mean TTFT (ms)", "mean_ttft_ms_{}", "{:.1f}"),
        ("Median TTFT (ms)", "median_ttft_ms_{}", "{:.1f}"),
        ("Mean TPOT (ms)", "mean_tpot_ms_{}", "{:.2f}"),
        ("Median TPOT (ms)", "median_tpot_ms_{}", "{:.2f}"),
        ("Peak running requests", "peak_running_{}", "{:.0f}"),
        ("Predicted running requests", "predicted_running_{}", "{}"),
        ("Peak pages in use", "peak_pages_in_use_{}", "{:.0f}"),
        ("Engine steps", "engine_steps_{}", "{:.0f}"),
        ("Failed requests", "failed_{}", "{}"),
    ]
    print()
    print(f"{'':<30}{'recycle OFF':>14}{'recycle ON':>14}")
    for label, key, fmt in rows:
        off, on = ("n/a" if s[key.format(arm)] is None else fmt.format(s[key.format(arm)]) for arm in ("off", "on"))
        print(f"{label:<30}{off:>14}{on:>14}")
    print(f"{'KV pages total':<30}{s['kv_pages_total'] or 0:>14.0f}")
    share = s["share_of_possible_gain"]
    share_text = "n/a" if share is None else f"{100 * share:.0f}% of the possible gain"
    print(f"Gain (ON/OFF output throughput): {s['gain']:.3f}   ceiling: {s['ceiling']:.3f}   "
          f"target >= {s['target_gain']:.3f}   ({share_text})")
    if s["steps_ratio"] is not None:
        print(f"Gain = steps ratio OFF/ON {s['steps_ratio']:.3f} / mean step time ratio ON/OFF "
              f"{s['step_time_ratio']:.3f} (the second factor is ~1 only where a step's cost does not "
              f"grow with the batch)")
    if s["gain_share_of_steps_gain"] is not None:
        print(f"tok/s gain is {s['gain_share_of_steps_gain']:.0%} of the engine-steps gain")


def write_plot(path: str, off: ArmResult, on: ArmResult) -> None:
    from ab_plot import ArmSeries, plot_running_and_pages

    arms = [ArmSeries(f"recycle {arm.name.upper()}", arm.timeline.times, arm.timeline.running,
                      arm.timeline.pages_in_use) for arm in (off, on)]
    plot_running_and_pages(path, "Head-wise SWA recycling: OFF vs ON at the same KV memory", arms,
                           off.timeline.pages_total, "time since the benchmark started (s)")


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="YAML with server: and workload: sections.")
    parser.add_argument("--json", default=None, help="Write the summary (docs/benchmarks.md keys) here.")
    parser.add_argument("--plot", default=None, help="Write a PNG of running requests and pages in use here.")
    parser.add_argument("--port", type=int, default=None, help="Server port (default: a free one).")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--log-dir", default=None, help="Server logs (default: a fresh temp dir).")
    server = parser.add_argument_group("server settings (override the YAML)")
    server.add_argument("--model", default=None)
    for key in ("max_model_len", "block_size", "num_gpu_blocks_override", "max_num_seqs",
                "max_num_batched_tokens"):
        server.add_argument("--" + key.replace("_", "-"), type=int, default=None)
    server.add_argument("--head-wise-swa-config", default=None,
                        help='JSON, e.g. \'{"sliding_window": 128, "sink_size": 16, "swa_kv_heads": [0]}\'')
    workload = parser.add_argument_group("workload (overrides the YAML)")
    for key in ("num_prompts", "input_len", "output_len", "max_concurrency", "seed"):
        workload.add_argument("--" + key.replace("_", "-"), type=int, default=None)
    workload.add_argument("--request-rate", type=float, default=None)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="bench_head_wise_swa_")
    os.makedirs(args.log_dir, exist_ok=True)
    try:
        server, workload = load_settings(args)
        prediction = predict(server, workload)
        log(f"predicted running requests: OFF {prediction['running_off']}, ON {prediction['running_on']}; "
            f"ceiling {float(prediction['ceiling']):.3f}")
        if float(prediction["ceiling"]) <= 1.0:
            log("warning: the ceiling is 1, so this workload is not memory-bound and recycling cannot help")
        arms = {name: run_arm(name, recycle, server, workload, args) for name, recycle in ARMS}
    except (ABError, ServerStartError, OSError, yaml.YAMLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    summary = summarize(arms["off"], arms["on"], prediction, server, workload)
    print_table(summary)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
        log(f"wrote {args.json}")
    if args.plot:
        write_plot(args.plot, arms["off"], arms["on"])
        log(f"wrote {args.plot}")
    failed = summary["failed_off"] + summary["failed_on"]
    if failed:
        print(f"error: {failed} request(s) failed; the two arms are not comparable", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
