"""Discrete-step serving simulation: the real scheduler and cache manager on a virtual clock.

The scheduler driver (driver.py) advances the clock by the step model's time for each batch. Nothing
about admission, chunking, recycling or preemption is modelled here: it is whatever the engine's
scheduler does.
"""

from __future__ import annotations

import atexit
import bisect
import dataclasses
import functools
import json
import math
import os
import shutil
import statistics
import tempfile
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from fastdeploy import envs
from fastdeploy.cache_manager.head_wise import PageLayout, predicted_concurrency
from fastdeploy.config import CacheConfig, ModelConfig
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.sched.driver import SAMPLED_TOKEN, drive  # noqa: F401  (SAMPLED_TOKEN: gpu_check's)
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

from .hardware import Hardware
from .step_model import ModelShape, StepModel
from .workload import Workload

ADMISSIONS = ("reserve", "on-demand", "projected")  # the scheduler's admission policies (FD_ADMISSION_POLICY)

SERIES_POINTS = 2000  # time-series points kept per arm (for the plot)


# -- engine settings shared by both arms -------------------------------------------------------
@dataclass(frozen=True)
class EngineSettings:
    model_dir: str
    max_model_len: int
    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: Optional[int]
    swa_heads: Optional[int]  # the first `swa_heads` KV heads slide; None: the model's own sliding layers
    window: int
    sink: int
    admission: str = "reserve"  # one of ADMISSIONS
    tensor_parallel_size: int = 1
    balance_swa_heads: bool = False  # --balance-swa-heads: spread the SWA heads over the ranks

    @property
    def sliding_layers(self) -> bool:
        """The model slides whole layers itself (Gemma 3, gpt-oss): no head-wise section is added."""
        return self.swa_heads is None

    @property
    def swa_spec(self) -> Optional[dict]:
        if self.sliding_layers:
            return None
        return {"sliding_window": self.window, "sink_size": self.sink,
                "swa_kv_heads": list(range(self.swa_heads))}


def model_dir_for(config_path: str) -> str:
    """A directory holding `config.json`: the path itself, or a temp copy of a bare JSON file."""
    if os.path.isdir(config_path):
        return config_path
    with open(config_path, encoding="utf-8") as f:
        raw = json.load(f)
    return _materialize(json.dumps(raw, sort_keys=True))


@functools.lru_cache(maxsize=None)
def _materialize(raw_json: str) -> str:
    path = tempfile.mkdtemp(prefix="serving_sim_model_")
    atexit.register(shutil.rmtree, path, True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        f.write(raw_json)
    return path


def read_raw_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def kv_pool_blocks(model_dir: str, hardware: Hardware, gpu_memory_utilization: float, block_size: int,
                   max_model_len: int, tensor_parallel_size: int = 1) -> int:
    """KV blocks that fit (memory * utilization - bf16 weights), with a bf16 cache, on one GPU
    (under tensor parallelism: one rank's GPU, holding 1/N of the weights and of the KV heads)."""
    model = ModelConfig.create(model_dir, max_model_len, None)
    weights = ModelShape.from_config(model.raw).weight_bytes / tensor_parallel_size
    budget = hardware.memory_bytes * gpu_memory_utilization - weights
    block = CacheConfig(block_size=block_size, cache_dtype="bfloat16").block_bytes(model, tensor_parallel_size)
    if budget < block:
        raise ValueError(f"{hardware.name}: {weights / 1e9:.1f} GB of weights leave no room for a KV block "
                         f"at gpu_memory_utilization={gpu_memory_utilization}")
    return int(budget // block)


def admission_env(admission: str) -> dict:
    """The env flag selecting an admission policy; ValueError naming the choices for another name."""
    if admission not in ADMISSIONS:
        raise ValueError(f"unknown admission policy {admission!r}; choose one of {', '.join(ADMISSIONS)}")
    return {"FD_ADMISSION_POLICY": admission.replace("-", "_")}


def make_fd_config(settings: EngineSettings, recycle: bool):
    """The engine config of one arm: head-wise tables in both, recycling on or off. A model with its own
    sliding layers runs OFF as 1-D (FD_HEAD_WISE_KV_CACHE=0: every layer keeps every token, the issue's
    A/B baseline) and ON with slots and recycling."""
    flags = dict(FD_HEAD_WISE_KV_CACHE=1, FD_HEAD_WISE_SWA_RECYCLE=int(recycle))
    if settings.sliding_layers:
        flags = dict(FD_HEAD_WISE_KV_CACHE=int(recycle), FD_HEAD_WISE_SWA_RECYCLE=1)
    with envs.override(**flags, **admission_env(settings.admission)):
        return EngineArgs(
            model=settings.model_dir, max_model_len=settings.max_model_len, block_size=settings.block_size,
            num_gpu_blocks_override=settings.num_gpu_blocks, cache_dtype="bfloat16",
            max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
            head_wise_swa_config=settings.swa_spec,
            tensor_parallel_size=settings.tensor_parallel_size, balance_swa_heads=settings.balance_swa_heads,
            # Benchmark prompts are random and share no prefix; the simulated ones are all the same
            # token, so a prefix cache would turn them into hits that no real workload has.
            enable_prefix_caching=False,
        ).create_engine_config()


def ceiling(settings: EngineSettings, workload: Workload) -> dict:
    """Predicted running requests OFF/ON and their ratio (the gain recycling can at most buy).

    Fixed lengths: `predicted_concurrency` as is. Sampled lengths: it only knows one length, so the
    same reservation rule is applied to the mean peak over the sampled requests (pages / mean peak).
    """
    fd = make_fd_config(settings, recycle=True)
    if workload.fixed_lengths:
        return predicted_concurrency(fd, workload.input_len, workload.output_len)
    on = PageLayout.from_config(fd)
    off = dataclasses.replace(on, recycle=False)
    chunk, pages = fd.scheduler_config.max_num_batched_tokens, fd.cache_config.num_gpu_blocks * on.slots_per_rank
    reqs = workload.requests()

    def mean_peak(layout, max_chunk=None):
        if max_chunk is None:  # the engine's chunk rule: the window only where it lets more run
            max_chunk = layout.chunk_for(chunk, lambda c: running(layout, c))
        return statistics.fmean(max(layout.peak_pages_per_rank(r.input_len, r.output_len, max_chunk)) for r in reqs)

    def running(layout, max_chunk=None):
        return min(fd.scheduler_config.max_num_seqs, pages / mean_peak(layout, max_chunk))

    run_off, run_on = running(off), running(on)
    return {"running_off": run_off, "running_on": run_on, "ceiling": run_on / run_off, "pages_per_rank": pages,
            "peak_pages_off": mean_peak(off), "peak_pages_on": mean_peak(on)}


def sliding_pairs(fd_config) -> tuple:
    """(sliding (layer, KV head) pairs, their one window, their sink) of a model with sliding layers."""
    from fastdeploy.model_executor.layers.attention.swa_spec import attention_type_table

    table = attention_type_table(fd_config.model_config)
    kinds = {t for row in table for t in row if t.sliding}
    if len(kinds) != 1:
        raise ValueError(f"the step model follows one sliding window; this model has {len(kinds)} sliding types")
    kind = kinds.pop()
    return sum(t.sliding for row in table for t in row), kind.window, kind.sink


# -- one arm -----------------------------------------------------------------------------------
@dataclass
class ArmResult:
    num_requests: int
    output_tokens: int
    makespan: float
    ttft: list
    tpot: list
    e2el: list
    done_times: list
    peak_running: int
    peak_pages_used: int
    mean_pages_used: float  # time-averaged over the makespan
    mean_running: float  # time-averaged over the makespan
    pages_total: int
    preemptions: int
    recomputed_tokens: int  # tokens computed again after a preemption threw their KV away
    computed_tokens: int  # every token of every scheduled chunk, recomputation included
    recomputed_tokens_scheduler: Optional[int]
    swa_pages_recycled: int
    steps: int
    saturated_until: float  # last time a request was waiting or not yet arrived
    series: dict = field(default_factory=dict)  # t, running, pages_used (downsampled)

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.makespan


def simulate(fd_config, step_model: StepModel, requests: list) -> ArmResult:
    """Run `requests` (SimRequest list, by arrival) to completion on the step model's clock (driver.py)."""
    rm = ResourceManagerV1(fd_config)

    def step_time(batch) -> float:
        # A one-token chunk is (almost always) a decode, which samples; only longer chunks need the check.
        return step_model.step_time([(s.start, s.num_tokens, s.num_tokens == 1 or s.samples) for s in batch.requests])

    run = drive(rm, requests, step_time, eos=fd_config.model_config.eos_token_id)
    makespan = run.makespan
    first, done = run.first_token, run.done
    return ArmResult(
        num_requests=len(requests),
        output_tokens=sum(r.output_len for r in requests),
        makespan=makespan,
        ttft=[f - r.arrival for f, r in zip(first, requests)],
        tpot=[(d - f) / (r.output_len - 1) for d, f, r in zip(done, first, requests) if r.output_len > 1],
        e2el=[d - r.arrival for d, r in zip(done, requests)],
        done_times=done,
        peak_running=run.peak_running,
        peak_pages_used=run.peak_pages_used,
        mean_pages_used=run.pages_time / makespan,
        mean_running=run.running_time / makespan,
        pages_total=rm.cache_manager.num_total_pages,
        preemptions=rm.num_preemptions_total,
        recomputed_tokens=run.recomputed,
        computed_tokens=run.computed,
        recomputed_tokens_scheduler=rm.recomputed_tokens_total,  # the same quantity, counted at preemption
        swa_pages_recycled=rm.kv_cache_manager.swa_pages_recycled_total,
        steps=run.steps,
        saturated_until=run.saturated_until,
        series=_downsample(run.series["t"], run.series["running"], run.series["pages_used"]),
    )


def _downsample(ts: list, running: list, used: list) -> dict:
    stride = max(1, len(ts) // SERIES_POINTS)
    return {"t": ts[::stride], "running": running[::stride], "pages_used": used[::stride]}


# -- fewer prompts, same steady state ----------------------------------------------------------
def steady_completion_rate(result: ArmResult) -> Optional[float]:
    """Requests/s completed in the saturated steady state, or None if the run never reached it.

    While requests wait, a finishing request's slot is refilled at once, so completions come in
    cycles of `peak_running` requests. The rate is measured over whole cycles from the first
    completion, among completions that happened while the queue was still non-empty.
    """
    if result.preemptions:
        return None  # preempted requests recompute: completions no longer come in regular cycles
    c = sorted(result.done_times)
    cycle = result.peak_running
    saturated = bisect.bisect_right(c, result.saturated_until)
    span = (saturated - 1) // cycle * cycle
    if cycle < 1 or span < cycle or c[span] <= c[0]:
        return None
    return span / (c[span] - c[0])


def extrapolated_makespan(result: ArmResult, num_prompts: int) -> Optional[float]:
    """Makespan of the same stream with `num_prompts` requests: the simulated run plus steady cycles.

    The longer run has the same ramp-up (same first arrivals) and the same drain (the queue runs dry
    the same way); only the saturated middle is longer, and it completes requests at the steady rate.
    """
    rate = steady_completion_rate(result)
    if rate is None:
        return None
    return result.makespan + (num_prompts - result.num_requests) / rate


# -- an A/B scenario: recycle OFF vs ON at identical settings -----------------------------------
@dataclass(frozen=True)
class Scenario:
    name: str
    model_config: str
    hardware: Hardware
    workload: Workload
    swa_heads: Optional[int]  # None: the model's own sliding layers (window and sink then come from it)
    window: int
    sink: int
    block_size: int = 64
    num_gpu_blocks_override: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 512
    max_num_batched_tokens: Optional[int] = None
    max_model_len: Optional[int] = None
    overhead_ms: float = 3.0
    admission: str = "reserve"  # one of ADMISSIONS
    attention: str = "skip"  # step_model.ATTENTION_READS: which keys a SWA head's kernel reads
    max_sim_prompts: int = 0  # 0: simulate every prompt; else simulate fewer and extrapolate
    dtype_bytes: int = 2  # weights and KV cache; 4 for the float32 CPU engine
    tensor_parallel_size: int = 1  # ranks, one GPU each (serving_sim/tensor_parallel.py)
    balance_swa_heads: bool = False

    def settings(self) -> EngineSettings:
        model_dir = model_dir_for(self.model_config)
        max_len = self.max_model_len or max(r.input_len + r.output_len for r in self.workload.requests())
        blocks = self.num_gpu_blocks_override or kv_pool_blocks(
            model_dir, self.hardware, self.gpu_memory_utilization, self.block_size, max_len,
            self.tensor_parallel_size)
        return EngineSettings(model_dir, max_len, self.block_size, blocks, self.max_num_seqs,
                              self.max_num_batched_tokens, self.swa_heads, self.window, self.sink,
                              self.admission,
                              tensor_parallel_size=self.tensor_parallel_size, balance_swa_heads=self.balance_swa_heads)

    def step_model(self, settings: EngineSettings) -> StepModel:
        shape = ModelShape.from_config(read_raw_config(settings.model_dir))
        if settings.sliding_layers:
            if settings.tensor_parallel_size > 1:
                raise ValueError("the simulator models sliding layers on one GPU only (tensor_parallel_size 1)")
            pairs, window, sink = sliding_pairs(make_fd_config(settings, recycle=True))
            return StepModel(shape, self.hardware, self.overhead_ms / 1e3, 0, window, sink, self.dtype_bytes,
                             self.attention, num_swa_pairs=pairs)
        if settings.tensor_parallel_size > 1:
            from .tensor_parallel import TensorParallelStepModel

            # The SWA heads each rank holds, after any --balance-swa-heads permutation.
            layout = PageLayout.from_config(make_fd_config(settings, recycle=True))
            per_rank = [sum(counts[1:]) for counts in layout.rank_head_counts()]
            return TensorParallelStepModel(shape, self.hardware, self.overhead_ms / 1e3, per_rank, self.window,
                                           self.sink, self.dtype_bytes)
        return StepModel(shape, self.hardware, self.overhead_ms / 1e3, self.swa_heads, self.window, self.sink,
                         self.dtype_bytes, self.attention)


@dataclass
class ArmOutcome:
    result: ArmResult  # of the simulated prompts
    num_prompts: int
    output_tokens: int  # of all prompts
    makespan: float  # of all prompts (extrapolated when fewer were simulated)

    @property
    def simulated_prompts(self) -> int:
        return self.result.num_requests

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.makespan


def run_arm(scenario: Scenario, recycle: bool, predicted_running: Optional[float] = None) -> ArmOutcome:
    settings = scenario.settings()
    fd = make_fd_config(settings, recycle)
    model = scenario.step_model(settings)
    requests = scenario.workload.requests()
    n = len(requests)
    outputs = sum(r.output_len for r in requests)
    sim_n = n
    if scenario.max_sim_prompts and predicted_running:
        # Two and a half cycles of the steady concurrency: one to ramp up, at least one to measure.
        sim_n = min(n, max(scenario.max_sim_prompts, math.ceil(2.5 * predicted_running)))
    # Only worth it (and only accurate: a partial last wave weighs more in a short run) when the
    # simulated prompts are at most half of the stream.
    if sim_n <= n // 2:
        result = simulate(fd, model, requests[:sim_n])
        makespan = extrapolated_makespan(result, n)
        if makespan is not None:
            return ArmOutcome(result, n, outputs, makespan)
    result = simulate(fd, model, requests)  # no steady state to extrapolate from: run them all
    return ArmOutcome(result, n, outputs, result.makespan)


def arm_metrics(arm: ArmOutcome) -> dict:
    r = arm.result
    out = {"output_throughput": arm.output_throughput, "makespan_s": arm.makespan,
           "simulated_prompts": arm.simulated_prompts, "peak_running": r.peak_running,
           "peak_pages_used": r.peak_pages_used, "mean_pages_used": r.mean_pages_used, "pages_total": r.pages_total,
           "peak_pages_fraction": r.peak_pages_used / r.pages_total,
           "mean_pages_fraction": r.mean_pages_used / r.pages_total, "mean_running": r.mean_running,
           "preemptions": r.preemptions, "recomputed_tokens": r.recomputed_tokens,
           "swa_pages_recycled": r.swa_pages_recycled, "steps": r.steps}
    for name, values, scale in (("ttft", r.ttft, 1e3), ("tpot", r.tpot, 1e3), ("e2el", r.e2el, 1e3)):
        out[f"mean_{name}_ms"] = statistics.fmean(values) * scale
        out[f"median_{name}_ms"] = statistics.median(values) * scale
        # numpy's linear interpolation, benchmark_serving.py's percentile: simulated and measured p99s compare
        out[f"p99_{name}_ms"] = float(np.percentile(values, 99)) * scale
    return out


def ab_row(scenario: Scenario, off: ArmOutcome, on: ArmOutcome, predicted: dict) -> dict:
    """One result row: docs/benchmarks.md A/B keys plus the per-arm serving metrics."""
    settings = scenario.settings()
    m_off, m_on = arm_metrics(off), arm_metrics(on)
    fd_on = make_fd_config(settings, True)
    shape = ModelShape.from_config(read_raw_config(settings.model_dir))
    window, sink = scenario.window, scenario.sink
    if settings.sliding_layers:
        _, window, sink = sliding_pairs(fd_on)
    w = scenario.workload
    row = {**{k: getattr(scenario, k) for k in ("name", "model_config", "swa_heads", "admission", "attention",
                                                  "gpu_memory_utilization", "overhead_ms")},
           **{k: getattr(w, k) for k in ("num_prompts", "input_len", "output_len", "range_ratio")},
           "request_rate": w.request_rate if math.isfinite(w.request_rate) else "inf",
           "hardware": scenario.hardware.name, "num_kv_heads": shape.num_kv_heads, "num_layers": shape.num_layers,
           "sliding_layers": (sum(win is not None for win in fd_on.model_config.layer_sliding_window)
                              if settings.sliding_layers else None),
           "slot_layout": fd_on.slot_layout.describe(), "window": window, "sink": sink,
           "num_gpu_blocks": settings.num_gpu_blocks, "max_num_seqs": settings.max_num_seqs,
           "max_num_batched_tokens": fd_on.scheduler_config.max_num_batched_tokens,
           "peak_pages_per_request_off": predicted.get("peak_pages_off"),
           "peak_pages_per_request_on": predicted.get("peak_pages_on"),
           "throughput_off": off.output_throughput, "throughput_on": on.output_throughput,
           "gain": on.output_throughput / off.output_throughput, "ceiling": predicted["ceiling"],
           "predicted_running_off": predicted["running_off"], "predicted_running_on": predicted["running_on"],
           "peak_running_off": off.result.peak_running, "peak_running_on": on.result.peak_running,
           "extrapolated": off.simulated_prompts < off.num_prompts or on.simulated_prompts < on.num_prompts}
    row.update({f"{k}_off": v for k, v in m_off.items()})
    row.update({f"{k}_on": v for k, v in m_on.items()})
    return row


def _arm_job(job: tuple) -> ArmOutcome:
    scenario, recycle, predicted_running = job
    return run_arm(scenario, recycle, predicted_running)


def run_scenarios(scenarios: list, jobs: int = 1) -> list:
    """A/B every scenario (both arms as separate jobs, `jobs` processes); returns (row, off, on) each."""
    predicted = [ceiling(sc.settings(), sc.workload) for sc in scenarios]
    work = [(sc, recycle, p["running_on" if recycle else "running_off"])
            for sc, p in zip(scenarios, predicted) for recycle in (False, True)]
    if jobs > 1 and len(work) > 1:
        import concurrent.futures
        import multiprocessing

        # Longest first, so the pool does not end on one long arm: cost ~ simulated request-steps.
        order = sorted(range(len(work)), key=lambda i: -_estimated_cost(*work[i]))
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = {i: pool.submit(_arm_job, work[i]) for i in order}
            outcomes = [futures[i].result() for i in range(len(work))]
    else:
        outcomes = [_arm_job(w) for w in work]
    return [(ab_row(sc, outcomes[2 * k], outcomes[2 * k + 1], p), outcomes[2 * k], outcomes[2 * k + 1])
            for k, (sc, p) in enumerate(zip(scenarios, predicted))]


def _estimated_cost(scenario: Scenario, recycle: bool, predicted_running: float) -> float:
    n = scenario.workload.num_prompts
    if scenario.max_sim_prompts:
        sim_n = max(scenario.max_sim_prompts, math.ceil(2.5 * predicted_running))
        n = sim_n if sim_n <= n // 2 else n
    return n * scenario.workload.output_len
