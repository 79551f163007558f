"""One GPU check: kernel tests, kernel benchmark, engine on the GPU, and the Paddle-free recycle A/B.

    python benchmarks/gpu_check.py --json gpu_check.json [--skip kernel_tests,kernel_bench,engine,ab]

Sized for one H100/H200 in under 8 minutes. Parts (each one key of the JSON; a part that cannot run
says why under "skipped" and the rest still run):

  kernel_tests   pytest of the CUDA AppendAttention against the float64 reference (numpy, nvcc, pytest);
                 the ctypes harness is built once (nvcc, sm_80 + sm_90) and reused by the later parts
  kernel_bench   benchmarks/bench_append_attention_gpu.py: 2-D skip vs 1-D dual pass vs 1-D masked at
                 ERNIE-4.5-21B-A3B shapes, decode and prefill, achieved HBM bandwidth
  engine         only where Paddle with CUDA is importable: the tiny presets on --device gpu vs cpu
                 (greedy tokens; first-token log-probs within a bf16 tolerance), the same with int8
                 and block_wise_fp8 KV pages (--kv-cache-quant-type; quantized arm), and the
                 offline recycle A/B (bench_recycling.py --engine offline --device gpu)
  ab             no Paddle needed (PyTorch or CuPy + nvcc): a step loop that drives the real
                 ResourceManagerV1 / PrefixCacheManager, packs each step with the engine's own
                 the engine's PersistentBatch + HostStepBuffer, calls the project's CUDA AppendAttention
                 through its C ABI on CuPy device buffers, and spends the model's GEMM time with cuBLAS
                 at ERNIE-4.5-21B-A3B shapes (random 16-bit weights, fewer layers; MoE as expert GEMMs
                 over the experts the batch's random top-k routing touches). Recycle OFF vs ON at equal
                 KV memory, 1/4 and 4/4 SWA heads: measured output tok/s, steps, step time, next to the
                 simulator's prediction (benchmarks/serving_sim) for the same reduced scenario.

Without a GPU (or CuPy, or nvcc) the parts that need one are skipped with the reason, and the
script exits 0 with nothing measured; it never fills in numbers it did not measure.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "custom_ops"))

from benchmarks.serving_sim.hardware import get_hardware  # noqa: E402
from benchmarks.serving_sim.simulator import (  # noqa: E402
    SAMPLED_TOKEN, EngineSettings, _materialize, ceiling, make_fd_config, simulate)
from benchmarks.serving_sim.step_model import ModelShape, StepModel  # noqa: E402
from benchmarks.serving_sim.workload import Workload  # noqa: E402
from fastdeploy.engine.request import Request, SamplingParams  # noqa: E402
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1  # noqa: E402
from fastdeploy.engine.persistent_batch import PersistentBatch  # noqa: E402
from fastdeploy.model_executor.layers.attention.swa_spec import attention_type_table, row_attention_args  # noqa: E402
from fastdeploy.model_executor.models.tiny_preset import TINY_GPU_PRESET_NAME, TINY_MOE_GPU_PRESET_NAME  # noqa: E402
from fastdeploy.worker.step_buffers import HostStepBuffer, StepBufferLayout  # noqa: E402

import gpu_harness  # noqa: E402  (tests/custom_ops: nvcc build + ctypes structs of the C ABI)

SCHEMA_VERSION = 1
ERNIE_CONFIG = REPO / "benchmarks" / "models" / "ernie-4.5-21b-a3b.json"
PARTS = ("kernel_tests", "kernel_bench", "engine", "ab")


# -- the reduced A/B scenario --------------------------------------------------------------------
@dataclass(frozen=True)
class ABConfig:
    """ERNIE-4.5-21B-A3B shapes with fewer layers; one burst of equal requests; both arms get the
    same KV blocks. Sized so that the four arms take well under 5 minutes on one H200."""

    name: str
    swa_heads: int            # the first `swa_heads` of the 4 KV heads slide
    num_layers: int = 4       # layer 0 dense, the rest MoE (as in the real model)
    num_prompts: int = 128
    input_len: int = 1024
    output_len: int = 128
    window: int = 256
    sink: int = 64
    block_size: int = 64
    num_gpu_blocks: int = 320  # recycle OFF fits 16 requests: (1024 + 128) / 64 = 18 blocks each
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256  # prefill chunks of 256: a SWA head peaks at its window, not the prompt
    overhead_ms: float = 3.0   # the simulator's fixed per-step term (its default)


DEFAULT_AB = (ABConfig("swa_1of4", swa_heads=1), ABConfig("swa_4of4", swa_heads=4))


def reduced_model_config(num_layers: int) -> dict:
    raw = json.loads(ERNIE_CONFIG.read_text())
    raw.pop("_source", None)
    raw["num_hidden_layers"] = num_layers
    raw["moe_layer_end_index"] = num_layers - 1
    return raw


def engine_settings(cfg: ABConfig) -> EngineSettings:
    model_dir = _materialize(json.dumps(reduced_model_config(cfg.num_layers), sort_keys=True))
    return EngineSettings(model_dir, cfg.input_len + cfg.output_len, cfg.block_size, cfg.num_gpu_blocks,
                          cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.swa_heads, cfg.window, cfg.sink)


# -- the op's arguments from the packed step buffer (shared by the GPU executor and the CPU tests) ---
def kernel_params(fd_config, layout: StepBufferLayout, num_tokens: int, dtype: int) -> dict:
    """AppendAttnParams for one layer of this step: the whole fixed buffer (idle rows included)."""
    model = fd_config.model_config
    return dict(dtype=dtype, token_num=num_tokens, bsz=layout.max_num_seqs, num_heads=model.num_attention_heads,
                kv_num_heads=model.num_key_value_heads, head_dim=model.head_dim,
                block_size=fd_config.cache_config.block_size, num_blocks=fd_config.cache_config.num_gpu_blocks,
                max_blocks_per_seq=layout.max_blocks_per_seq,
                # A 1-D table [bsz, 1, max_blocks] is the kernels' [bsz, max_blocks] byte for byte.
                head_wise_table=int(fd_config.head_wise_kv_cache), max_position=model.max_model_len,
                visit_all_pages=0, dual_pass=0,
                kv_slots=0,  # 0: the per-head cache layout (slot h = head h), what this check's presets use
                cache_quant=gpu_harness.CACHE_FLOAT)  # the A/B runs 16-bit pages


def layer_head_windows(fd_config) -> list:
    """Per layer, the op's head_windows [2, kv_heads] as lists (row 0 each KV head's window, 0 = full; row
    1 its sink): the engine's rule (swa_spec), what its backends pass."""
    return [[list(rows) for rows in row_attention_args(types)] for types in attention_type_table(fd_config.model_config)]


def buffer_addresses(base: int, layout: StepBufferLayout) -> dict:
    """Device address of each step input inside the one int32 buffer starting at `base`."""
    return {name: base + 4 * a for name, (a, _) in layout.offsets().items()}


# -- the step loop -----------------------------------------------------------------------------------
def run_arm(cfg: ABConfig, recycle: bool, executor, time_limit_s: float = math.inf) -> dict:
    """Every request of the burst to completion through the real scheduler; wall-clock metrics."""
    fd = make_fd_config(engine_settings(cfg), recycle)
    rm = ResourceManagerV1(fd)
    side = PersistentBatch(fd, rm.kv_cache_manager)  # the engine's: what it sends its workers each step
    host = HostStepBuffer(StepBufferLayout.from_config(fd, fd.table_rows_per_rank))
    executor.prepare(fd, host.layout)
    eos = fd.model_config.eos_token_id
    for r in Workload(cfg.num_prompts, cfg.input_len, cfg.output_len).requests():
        rm.add_request(Request(str(r.index), [SAMPLED_TOKEN] * r.input_len,
                               SamplingParams(max_tokens=r.output_len, ignore_eos=True), eos_token_id=eos))
    steps = output_tokens = peak_running = 0
    host_s = 0.0
    timed_out = False
    started = time.perf_counter()
    while rm.has_unfinished_requests():
        t0 = time.perf_counter()
        batch = rm.schedule()
        for request in batch.preempted:
            side.release(request.request_id)
        if not batch.requests:
            raise RuntimeError("the scheduler scheduled nothing with requests left")
        peak_running = max(peak_running, len(rm.running))
        host.pack(side.step_input(batch)[0])
        t1 = time.perf_counter()
        executor.step(host)
        t2 = time.perf_counter()
        for request in rm.update_from_output(batch, [SAMPLED_TOKEN] * len(batch.requests)):
            output_tokens += 1
            if request.is_finished:
                side.release(request.request_id)
        host_s += (t1 - t0) + (time.perf_counter() - t2)
        steps += 1
        if time.perf_counter() - started > time_limit_s:
            timed_out = True
            break
    wall = time.perf_counter() - started
    if not timed_out:
        if rm.cache_manager.num_free_pages != rm.cache_manager.num_total_pages:
            raise AssertionError("pages still held after every request finished")
        rm.cache_manager.check_integrity()
    return {"recycle": recycle, "output_tokens": output_tokens, "wall_s": wall,
            "output_throughput": output_tokens / wall if wall > 0 else None, "steps": steps,
            "mean_step_ms": 1e3 * wall / max(steps, 1), "host_ms_per_step": 1e3 * host_s / max(steps, 1),
            "peak_running": peak_running, "preemptions": rm.num_preemptions_total,
            "swa_pages_recycled": rm.kv_cache_manager.swa_pages_recycled_total, "timed_out": timed_out}


def predicted_arm(cfg: ABConfig, recycle: bool, hardware: str = "H200") -> dict:
    """The simulator's prediction for the same reduced scenario (same scheduler, roofline step time)."""
    settings = engine_settings(cfg)
    fd = make_fd_config(settings, recycle)
    model = StepModel(ModelShape.from_config(reduced_model_config(cfg.num_layers)), get_hardware(hardware),
                      cfg.overhead_ms / 1e3, cfg.swa_heads, cfg.window, cfg.sink)
    result = simulate(fd, model, Workload(cfg.num_prompts, cfg.input_len, cfg.output_len).requests())
    return {"output_throughput": result.output_throughput, "steps": result.steps,
            "mean_step_ms": 1e3 * result.makespan / max(result.steps, 1), "peak_running": result.peak_running}


def ab_config_report(cfg: ABConfig, executor, time_limit_s: float, hardware: str) -> dict:
    arms = {}
    for recycle in (False, True):
        arms["on" if recycle else "off"] = {"measured": run_arm(cfg, recycle, executor, time_limit_s),
                                            "predicted": predicted_arm(cfg, recycle, hardware)}
    off, on = arms["off"]["measured"], arms["on"]["measured"]
    p_off, p_on = arms["off"]["predicted"], arms["on"]["predicted"]
    gain = on["output_throughput"] / off["output_throughput"] if not (off["timed_out"] or on["timed_out"]) else None
    return {"config": asdict(cfg), "off": arms["off"], "on": arms["on"], "gain": gain,
            "predicted_gain": p_on["output_throughput"] / p_off["output_throughput"],
            # running ON / OFF from the page-need function alone (the ceiling of docs/memory_model.md)
            "ceiling": ceiling(engine_settings(cfg), Workload(cfg.num_prompts, cfg.input_len, cfg.output_len))["ceiling"],
            "throughput_off": off["output_throughput"], "throughput_on": on["output_throughput"],
            "peak_running_off": off["peak_running"], "peak_running_on": on["peak_running"]}


# -- the GPU executor: C ABI attention on CuPy buffers + cuBLAS GEMMs -------------------------------------
class CudaExecutor:
    """Per step: one host-to-device copy of the packed inputs; per layer: QKV GEMM, the project's
    AppendAttention (C ABI), O GEMM, the FFN (dense in layer 0; else router + shared expert + one
    GEMM pair per routed expert the step's random top-k routing touches); then the LM head over
    the sampled rows, one sync, and the kernels' error word. GEMMs run in bf16 with PyTorch where
    it is installed, else in fp16 with CuPy (same bytes and tensor-core rate)."""

    def __init__(self, library: Path, seed: int = 0):
        import cupy as cp

        self.cp = cp
        self.lib = gpu_harness.bind(ctypes.CDLL(str(library)), gpu_harness.C_ABI)  # the header's prototypes
        try:
            import torch

            usable = torch.cuda.is_available()
        except ImportError:
            usable = False
        if usable:
            self.torch, self.dtype, self.dtype_name = torch, gpu_harness.BF16, "bfloat16 (PyTorch cuBLAS)"
        else:  # no PyTorch, or a CPU build of it
            self.torch, self.dtype, self.dtype_name = None, gpu_harness.FP16, "float16 (CuPy cuBLAS)"
        self.rng = np.random.default_rng(seed)
        self.key = None

    # 16-bit matrices of either library, addressed by pointer for the kernel
    def _randn(self, *shape):
        if self.torch is not None:
            return self.torch.randn(*shape, device="cuda", dtype=self.torch.bfloat16) * 0.02
        return (self.cp.random.standard_normal(shape, dtype=self.cp.float32) * 0.02).astype(self.cp.float16)

    def _empty(self, *shape):
        if self.torch is not None:
            return self.torch.empty(*shape, device="cuda", dtype=self.torch.bfloat16)
        return self.cp.empty(shape, dtype=self.cp.float16)

    def _mm(self, a, b, out=None):
        if self.torch is not None:
            return self.torch.matmul(a, b, out=out)
        return self.cp.matmul(a, b, out=out)

    @staticmethod
    def _ptr(x) -> int:
        return x.data_ptr() if hasattr(x, "data_ptr") else x.data.ptr

    def prepare(self, fd_config, layout: StepBufferLayout) -> None:
        cp, m, cache = self.cp, fd_config.model_config, fd_config.cache_config
        key = (m.num_hidden_layers, cache.num_gpu_blocks, layout)
        self.fd, self.layout = fd_config, layout
        shape = ModelShape.from_config(m.raw)
        self.shape = shape
        t_max = layout.max_num_tokens
        nh, kvh, d, hid = m.num_attention_heads, m.num_key_value_heads, m.head_dim, m.hidden_size
        if self.key != key:  # weights and caches are made once per scenario, reused by both arms
            self.weights = []
            for layer in range(shape.num_layers):
                w = {"qkv": self._randn(hid, (nh + 2 * kvh) * d), "o": self._randn(nh * d, hid)}
                if layer < shape.dense_mlp_layers:
                    w["up"], w["down"] = self._randn(hid, 2 * shape.dense_intermediate), \
                        self._randn(shape.dense_intermediate, hid)
                else:
                    w["router"] = self._randn(hid, shape.num_experts)
                    w["shared_up"] = self._randn(hid, 2 * shape.shared_intermediate)
                    w["shared_down"] = self._randn(shape.shared_intermediate, hid)
                    experts = range(shape.num_experts)
                    w["experts_up"] = [self._randn(hid, 2 * shape.expert_intermediate) for _ in experts]
                    w["experts_down"] = [self._randn(shape.expert_intermediate, hid) for _ in experts]
                self.weights.append(w)
            self.lm_head = self._randn(hid, shape.vocab)
            cache_shape = (cache.num_gpu_blocks, kvh, cache.block_size, d)
            self.k_caches = [cp.zeros(cache_shape, cp.uint16) for _ in range(shape.num_layers)]
            self.v_caches = [cp.zeros(cache_shape, cp.uint16) for _ in range(shape.num_layers)]
            self.x = self._randn(t_max, hid)
            self.qkv = self._empty(t_max, (nh + 2 * kvh) * d)
            self.attn = self._empty(t_max, nh * d)
            self.key = key
        from gpu_reference import rotary_tables  # tests/custom_ops, on sys.path above

        cos, sin = rotary_tables(m.max_model_len, d)
        self.cos, self.sin = cp.asarray(cos, cp.float32), cp.asarray(sin, cp.float32)
        # Per layer, head_windows [2, kv_heads]: each KV head's window (0 = full) and sink.
        self.head_windows = [cp.asarray(w, cp.int32) for w in layer_head_windows(fd_config)]
        self.meta = cp.zeros(layout.total, cp.int32)
        self.error_info = cp.zeros(4, cp.int32)
        ws = self.lib.append_attention_workspace_bytes(ctypes.byref(gpu_harness._Params(
            **kernel_params(fd_config, layout, t_max, self.dtype))))
        if ws == 0:
            raise RuntimeError(f"append_attention_workspace_bytes refused the shapes: "
                               f"{self.lib.append_attention_last_error().decode()}")
        self.workspace = cp.zeros(ws, cp.uint8)
        self.addr = buffer_addresses(self.meta.data.ptr, layout)

    def _expert_counts(self, tokens: int) -> np.ndarray:
        """Tokens per routed expert under uniform random top-k routing (the step's distinct experts)."""
        e, k = self.shape.num_experts, self.shape.experts_per_token
        picks = np.argpartition(self.rng.random((tokens, e)), k, axis=1)[:, :k]
        return np.bincount(picks.ravel(), minlength=e)

    def _ffn(self, w: dict, x, tokens: int) -> None:
        if "up" in w:
            h = self._mm(x, w["up"])
            self._mm(h[:, :h.shape[1] // 2], w["down"])
            return
        self._mm(x, w["router"])
        h = self._mm(x, w["shared_up"])
        self._mm(h[:, :h.shape[1] // 2], w["shared_down"])
        for expert, n in enumerate(self._expert_counts(tokens)):
            if n:
                h = self._mm(x[:n], w["experts_up"][expert])
                self._mm(h[:, :h.shape[1] // 2], w["experts_down"][expert])

    def step(self, host: HostStepBuffer) -> None:
        cp = self.cp
        self.meta.set(host.array)  # the step's one host-to-device copy
        tokens = host.num_tokens
        params = gpu_harness._Params(**kernel_params(self.fd, self.layout, tokens, self.dtype))
        a = self.addr
        x = self.x[:tokens]
        for layer, w in enumerate(self.weights):
            self._mm(x, w["qkv"], out=self.qkv[:tokens])
            bufs = gpu_harness._Buffers(
                qkv=self._ptr(self.qkv), key_cache=self.k_caches[layer].data.ptr,
                value_cache=self.v_caches[layer].data.ptr, seq_lens_encoder=a["seq_lens_encoder"],
                seq_lens_decoder=a["seq_lens_decoder"], seq_lens_this_time=a["seq_lens_this_time"],
                cu_seqlens_q=a["cu_seqlens_q"], block_tables=a["block_tables"], rotary_cos=self.cos.data.ptr,
                rotary_sin=self.sin.data.ptr, head_windows=self.head_windows[layer].data.ptr,
                out=self._ptr(self.attn))
            status = self.lib.append_attention_launch(
                ctypes.byref(params), ctypes.byref(bufs), ctypes.c_void_p(self.workspace.data.ptr),
                ctypes.c_size_t(self.workspace.nbytes), ctypes.c_void_p(self.error_info.data.ptr), None)
            if status != 0:
                raise RuntimeError(f"append_attention_launch: {self.lib.append_attention_last_error().decode()}")
            self._mm(self.attn[:tokens], w["o"])
            self._ffn(w, x, tokens)
        if host.num_sampled:
            self._mm(self.x[:host.num_sampled], self.lm_head)
        cp.cuda.Device().synchronize()
        info = self.error_info.get()
        if info[0]:
            raise RuntimeError(f"AppendAttention device error {info.tolist()} (code, request, kv head, block)")


# -- the other parts ---------------------------------------------------------------------------------
def _run(cmd: list, timeout: float) -> tuple:
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
        return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as e:
        return None, f"timed out after {timeout:.0f}s\n{e.stdout or ''}", time.perf_counter() - t0


def kernel_tests(timeout: float) -> dict:
    junit = Path(tempfile.mkdtemp()) / "junit.xml"
    # The compile-only check (test_append_attention_gpu_build.py) runs in the CPU suite already.
    rc, out, secs = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/custom_ops/test_append_attention_gpu.py", f"--junitxml={junit}"], timeout)
    result = {"returncode": rc, "seconds": secs, "tail": out[-2000:]}
    if junit.is_file():
        import xml.etree.ElementTree as ET

        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        result.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
    return result


def kernel_bench(timeout: float) -> dict:
    out_json = Path(tempfile.mkdtemp()) / "kernel_bench.json"
    rc, out, secs = _run([sys.executable, "benchmarks/bench_append_attention_gpu.py", "--json", str(out_json)],
                         timeout)
    result = {"returncode": rc, "seconds": secs, "tail": out[-2000:]}
    if out_json.is_file():
        result["report"] = json.loads(out_json.read_text())
    return result


ENGINE_SCRIPT = r"""
import json, os, sys
os.environ["FD_HEAD_WISE_KV_CACHE"] = "1"
from fastdeploy import LLM, SamplingParams
device, model = sys.argv[1], sys.argv[2]
quant = sys.argv[3] if len(sys.argv) > 3 else "none"
pages = dict(cache_dtype="bfloat16") if quant == "none" else dict(kv_cache_quant_type=quant)
llm = LLM(model=model, device=device, dtype="bfloat16" if device == "gpu" else "float32",
          block_size=16, max_model_len=1024, max_num_seqs=8, **pages)
prompts = [[3 + (i * 37 + n * 11) % 250 for i in range(n)] for n in (1, 17, 130, 300)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5),
                    use_tqdm=False)
print("RESULT" + json.dumps({"tokens": [o.outputs.token_ids for o in outs],
                             "first_logprobs": [o.outputs.logprobs[0] for o in outs]}))
"""
BF16_LOGPROB_TOLERANCE = 0.1  # |log p| of the first sampled token, bf16 GPU vs float32 CPU
# The quantized arm: the tiny GPU preset with 8-bit KV pages on both devices (the same page rule,
# kv_quant.h; the GPU computes in bf16, so its codes may differ where a value sits on a rounding edge).
QUANTIZED_ARMS = ("int8", "block_wise_fp8")


def compare_engine_runs(gpu: dict, cpu: dict) -> dict:
    """Greedy tokens prompt by prompt, and the first token's top-5 log-probs (same prefix on both
    devices, so they are comparable even where later tokens diverge on near-ties)."""
    equal = [a == b for a, b in zip(gpu["tokens"], cpu["tokens"])]
    diffs = []
    for g, c in zip(gpu["first_logprobs"], cpu["first_logprobs"]):
        common = set(g) & set(c)
        diffs += [abs(g[t] - c[t]) for t in common]
    worst = max(diffs) if diffs else None
    return {"greedy_prompts_equal": f"{sum(equal)}/{len(equal)}", "first_token_logprob_max_abs_diff": worst,
            "within_bf16_tolerance": worst is not None and worst <= BF16_LOGPROB_TOLERANCE}


def engine_part(timeout: float) -> dict:
    """Paddle-GPU engine vs the CPU path on the tiny presets, and the offline recycle A/B on the GPU."""
    try:
        import paddle
    except ImportError:
        return {"skipped": "Paddle is not installed (this part needs paddlepaddle-gpu)"}
    if not paddle.is_compiled_with_cuda():
        return {"skipped": f"Paddle {paddle.__version__} is the CPU build (this part needs paddlepaddle-gpu)"}
    report = {}
    # The presets' head_dim-64 twins, named on both devices: the CUDA op has no head_dim 32/16 kernels.
    arms = [(m, "none") for m in (TINY_GPU_PRESET_NAME, TINY_MOE_GPU_PRESET_NAME)]
    arms += [(TINY_GPU_PRESET_NAME, q) for q in QUANTIZED_ARMS]
    for model, quant in arms:
        runs, name = {}, model if quant == "none" else f"{model}_{quant}"
        for device in ("gpu", "cpu"):
            rc, out, secs = _run([sys.executable, "-c", ENGINE_SCRIPT, device, model, quant], timeout / 7)
            line = next((x for x in out.splitlines() if x.startswith("RESULT")), None)
            runs[device] = json.loads(line[6:], object_hook=_int_keys) if line else None
            report[f"{name}_{device}"] = {"returncode": rc, "seconds": secs, "tail": None if line else out[-1500:]}
        if runs["gpu"] and runs["cpu"]:
            report[f"{name}_compare"] = compare_engine_runs(runs["gpu"], runs["cpu"])
    ab_json = Path(tempfile.mkdtemp()) / "offline_ab.json"
    rc, out, secs = _run([sys.executable, "benchmarks/bench_recycling.py", "--engine", "offline", "--device", "gpu",
                          "--cache-dtype", "bfloat16",
                          "--num-prompts", "64", "--input-len", "512", "--output-len", "128", "--window", "64",
                          "--json", str(ab_json)], timeout / 7)
    report["offline_ab"] = {"returncode": rc, "seconds": secs,
                            "report": json.loads(ab_json.read_text()) if ab_json.is_file() else None,
                            "tail": None if ab_json.is_file() else out[-1500:]}
    return report


def _int_keys(d: dict) -> dict:
    return {int(k) if k.lstrip("-").isdigit() else k: v for k, v in d.items()}


def ab_part(configs, time_limit_s: float, hardware: str) -> dict:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return {"skipped": "CuPy is not installed"}
    if gpu_harness.find_nvcc() is None:
        return {"skipped": "nvcc not found"}
    if gpu_harness.driver_gpu_count() == 0:
        return {"skipped": "no GPU visible"}
    executor = CudaExecutor(gpu_harness.cached_build())
    report = {"gemm_dtype": executor.dtype_name, "simulator_hardware": hardware}
    for cfg in configs:
        report[cfg.name] = ab_config_report(cfg, executor, time_limit_s, hardware)
    return report


def environment() -> dict:
    env = {"python": platform.python_version(), "machine": platform.node(), "nvcc": gpu_harness.find_nvcc(),
           "gpus_visible": gpu_harness.driver_gpu_count()}
    try:
        env["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                     "--format=csv,noheader"], capture_output=True, text=True,
                                    timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["gpu"] = None
    for mod in ("cupy", "torch", "paddle"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    return env


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("gpu_check.json"), help="where the one JSON goes")
    parser.add_argument("--skip", default="", help=f"comma-separated parts to skip: {', '.join(PARTS)}")
    parser.add_argument("--deadline-s", type=float, default=420.0,
                        help="parts not started by then are skipped (the whole check stays under 8 minutes)")
    parser.add_argument("--ab-arm-limit-s", type=float, default=45.0,
                        help="stop an A/B arm after this many seconds (it is then marked timed_out)")
    parser.add_argument("--hardware", default="H200", help="the simulator's hardware preset for the prediction")
    args = parser.parse_args(argv)
    skip = {p for p in args.skip.split(",") if p}
    unknown = skip - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    skip = {p for p in args.skip.split(",") if p}
    started = time.perf_counter()
    report = {"schema_version": SCHEMA_VERSION, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "environment": environment()}
    have_gpu = report["environment"]["gpus_visible"] > 0 and report["environment"]["nvcc"] is not None
    if not have_gpu:
        print("gpu_check: no GPU (or no nvcc) here: the kernel parts and the A/B are skipped, nothing is measured",
              file=sys.stderr)
    for part, run in (("kernel_tests", lambda: kernel_tests(180)), ("kernel_bench", lambda: kernel_bench(120)),
                      ("engine", lambda: engine_part(210)),
                      ("ab", lambda: ab_part(DEFAULT_AB, args.ab_arm_limit_s, args.hardware))):
        if part in skip:
            report[part] = {"skipped": "--skip"}
        elif time.perf_counter() - started > args.deadline_s:
            report[part] = {"skipped": f"out of time (--deadline-s {args.deadline_s:.0f})"}
        elif part != "engine" and not have_gpu:
            report[part] = {"skipped": "no GPU visible or nvcc not found"}
        else:
            try:
                report[part] = run()
            except Exception as exc:  # one broken part must not hide the others' results
                report[part] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"gpu_check: {part} done ({time.perf_counter() - started:.0f}s)", file=sys.stderr)
    report["seconds"] = time.perf_counter() - started
    args.json.write_text(json.dumps(report, indent=2, default=str))
    print(f"gpu_check: wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
