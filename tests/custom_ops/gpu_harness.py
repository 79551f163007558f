"""Build and drive the CUDA AppendAttention harness (custom_ops/gpu_ops/append_attn) with ctypes.

Shared by the GPU tests and benchmarks/bench_append_attention_gpu.py so that both need only
numpy + ctypes: every .cu of the folder is compiled on its own (which is also the CI compile
check), the objects are linked into one shared library, and `Harness.run` passes host buffers.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]


def _load_by_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The CPU build of the kernels and the C ABI's ctypes structs live with the engine's loader (one copy);
# loaded by path, so this harness stays free of Paddle.
cuda_on_cpu = _load_by_path(
    "fd_cuda_on_cpu_loader", REPO_ROOT / "fastdeploy" / "model_executor" / "layers" / "attention" / "ops" /
    "cuda_on_cpu_loader.py")
SOURCE_DIR, LIB_NAME, SHARED_HEADER = cuda_on_cpu.SOURCE_DIR, cuda_on_cpu.LIB_NAME, cuda_on_cpu.SHARED_HEADER

# SASS for sm_80 and sm_90 plus compute_90 PTX, so a newer GPU can still JIT the kernels.
GENCODES = (
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=[sm_90,compute_90]",
)
NVCC_FLAGS = ("-std=c++17", "-O3", "-Xcompiler", "-fPIC")
# What the cached build keeps besides the library: ptxas's per-kernel report (registers, spills, static
# shared memory) and the PTX (launch bounds), read by tests/custom_ops/kernel_resources.py. No codegen change.
RESOURCE_FLAGS = ("--resource-usage", "--keep")

BF16 = 0
FP16 = 1

PARAM_FIELDS = cuda_on_cpu.PARAM_FIELDS
BUFFER_FIELDS = cuda_on_cpu.BUFFER_FIELDS

# AppendAttnCacheQuant: float pages of `dtype`, or int8 / e4m3fn bytes or int4 codes two per byte
# (caches [..., head_dim / 2] uint8), or k8v4 (int8 keys, int4 values), with a float32 scale per row.
CACHE_FLOAT, CACHE_INT8, CACHE_FP8_E4M3, CACHE_INT4, CACHE_K8V4 = 0, 1, 2, 3, 4

# Device-side error codes (AppendAttnDeviceError).
ERR_DEAD_ENTRY = 1
ERR_DEAD_ENTRY_MASKED = 2
ERR_OUT_OF_RANGE = 3
ERR_POSITION = 4
ERR_HEAD_WINDOW = 5
ERR_DUAL_PASS_WINDOWS = 6


class _Params(cuda_on_cpu.AppendAttnParams):
    def __init__(self, **fields):
        super().__init__(**{"cache_quant": CACHE_FLOAT, **fields})  # older callers name no page format


_Buffers = cuda_on_cpu.AppendAttnBuffers


# restype and argtypes of every C entry point ctypes calls, as declared in append_attn_api.cuh (the
# launcher) and harness.cu (aa_*); tests/custom_ops/test_op_abi_contract.py checks them against
# the sources, so a changed prototype cannot be called with stale argument types.
C_ABI = {
    "append_attention_workspace_bytes": (ctypes.c_size_t, [ctypes.POINTER(_Params)]),
    "append_attention_launch": (ctypes.c_int, [ctypes.POINTER(_Params), ctypes.POINTER(_Buffers), ctypes.c_void_p,
                                               ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p]),
    "append_attention_last_error": (ctypes.c_char_p, []),
    "append_attention_dynamic_smem_bytes": (ctypes.c_size_t, [ctypes.POINTER(_Params), ctypes.c_int]),
}
# The CUDA-on-CPU executor's controls (custom_ops/gpu_ops/cuda_on_cpu/launch.cpp), in its builds only.
EXECUTOR_ABI = {
    "cuda_on_cpu_set_orders": (ctypes.c_int, [ctypes.c_char_p]),
    "cuda_on_cpu_set_threads": (None, [ctypes.c_int]),
    "cuda_on_cpu_set_sm_count": (None, [ctypes.c_int]),
    "cuda_on_cpu_races": (ctypes.c_char_p, []),
    "cuda_on_cpu_clear_races": (None, []),
}
HARNESS_ABI = {
    "aa_device_count": (ctypes.c_int, []),
    "aa_run": (ctypes.c_int, [ctypes.POINTER(_Params), ctypes.POINTER(_Buffers), ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int),
                              ctypes.c_char_p, ctypes.c_int]),
    "aa_copy_bandwidth_gbps": (ctypes.c_double, [ctypes.c_size_t, ctypes.c_int]),
}


def bind(lib, abi: dict):
    """Declare restype/argtypes of `abi`'s functions on a loaded library; returns the library."""
    for name, (restype, argtypes) in abi.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


class BuildError(RuntimeError):
    pass


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return None


def cuda_sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.cu"))


@dataclasses.dataclass
class BuildResult:
    library: Path
    compile_seconds: dict[str, float]  # per source file
    wall_seconds: float
    compile_logs: dict[str, str] = dataclasses.field(default_factory=dict)  # nvcc's stdout + stderr per file


def build(out_dir: Path, jobs: int = 2, nvcc: str | None = None, extra_flags: tuple[str, ...] = ()) -> BuildResult:
    """Compiles every .cu under append_attn/ separately (sm_80 + sm_90) and links the harness.
    extra_flags go to every compile (tests/custom_ops/kernel_resources.py: --resource-usage)."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def compile_one(src: Path) -> tuple[str, float, Path, str]:
        obj = out_dir / (src.stem + ".o")
        cmd = [nvcc, *NVCC_FLAGS, *GENCODES, *extra_flags, "-c", str(src), "-o", str(obj)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"nvcc failed on {src.name}:\n{' '.join(cmd)}\n{proc.stderr}")
        return src.name, time.perf_counter() - t0, obj, proc.stdout + proc.stderr

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(compile_one, cuda_sources()))
    lib = out_dir / LIB_NAME
    link = [nvcc, "-shared", "-o", str(lib), *[str(obj) for _, _, obj, _ in results]]
    proc = subprocess.run(link, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"link failed:\n{' '.join(link)}\n{proc.stderr}")
    return BuildResult(lib, {name: secs for name, secs, _, _ in results}, time.perf_counter() - started,
                       {name: log for name, _, _, log in results})


# ---- the same sources on the CPU: the CUDA-on-CPU executor (custom_ops/gpu_ops/cuda_on_cpu) ----
EXECUTOR_DIR = cuda_on_cpu.EXECUTOR_DIR
CPU_FLAGS = cuda_on_cpu.CPU_FLAGS
find_cuda_include = cuda_on_cpu.find_cuda_include


def build_on_cpu(out_dir: Path, jobs: int = 2, source_dir: Path = SOURCE_DIR, extra_flags=(),
                 reuse_from: Path | None = None) -> BuildResult:
    """The kernels (every .cu of `source_dir`) compiled as C++ for the CUDA-on-CPU executor
    (cuda_on_cpu_loader.build; `reuse_from`: a build of the unchanged sources to take objects from)."""
    started = time.perf_counter()
    try:
        lib, seconds = cuda_on_cpu.build(out_dir, jobs=jobs, source_dir=source_dir, extra_flags=extra_flags,
                                         reuse_from=reuse_from)
    except cuda_on_cpu.BuildError as e:
        raise BuildError(str(e)) from e
    return BuildResult(lib, seconds, time.perf_counter() - started)


def _source_key(on_cpu: bool = False) -> str:
    if on_cpu:
        return cuda_on_cpu.source_key()
    digest = hashlib.sha256()
    for path in [*sorted(SOURCE_DIR.glob("*.cu*")), SHARED_HEADER]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(NVCC_FLAGS + GENCODES + RESOURCE_FLAGS).encode())
    return digest.hexdigest()[:16]


def cached_build(jobs: int | None = None, on_cpu: bool = False) -> Path:
    """The harness library for the current sources (nvcc, or on_cpu: the CUDA-on-CPU executor),
    built once per source hash in the temp dir. Next to an nvcc build: <source stem>.resource_usage.txt
    (nvcc's report) and keep/<stem>.compute_XX.ptx (tests/custom_ops/kernel_resources.py)."""
    kind = "cpu_" if on_cpu else ""
    final = Path(tempfile.gettempdir()) / f"fd_append_attn_harness_{kind}{_source_key(on_cpu)}"
    if (final / LIB_NAME).is_file():
        return final / LIB_NAME
    shutil.rmtree(final, ignore_errors=True)  # leftovers of an interrupted build
    staging = Path(tempfile.mkdtemp(prefix="fd_append_attn_build_"))
    jobs = jobs or max(2, os.cpu_count() or 2)
    if on_cpu:
        build_on_cpu(staging, jobs=jobs)
    else:
        keep = staging / "keep"
        keep.mkdir()
        result = build(staging, jobs=jobs, extra_flags=(*RESOURCE_FLAGS, f"--keep-dir={keep}"))
        for name, log in result.compile_logs.items():
            (staging / f"{Path(name).stem}.resource_usage.txt").write_text(log)
        for path in keep.iterdir():  # of nvcc's intermediates only the PTX is read
            if path.suffix != ".ptx":
                path.unlink()
    try:
        os.replace(staging, final)
    except OSError:  # another process won the race; use its build
        shutil.rmtree(staging, ignore_errors=True)
    return final / LIB_NAME


def driver_gpu_count() -> int:
    """GPUs visible to the CUDA driver, 0 when there is no driver or no device (never raises)."""
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            cuda = ctypes.CDLL(name)
        except OSError:
            continue
        count = ctypes.c_int(0)
        if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return 0
        return count.value
    return 0


# ---- storage dtypes (numpy has no bfloat16: storage arrays are uint16 bit patterns) ----


def to_storage(x: np.ndarray, dtype: int) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if dtype == FP16:
        return x.astype(np.float16).view(np.uint16)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # nearest-even
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded).astype(np.uint16)


def from_storage(bits: np.ndarray, dtype: int) -> np.ndarray:
    bits = np.asarray(bits, dtype=np.uint16)
    if dtype == FP16:
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def storage_nan(shape, dtype: int) -> np.ndarray:
    return np.full(shape, 0x7E00 if dtype == FP16 else 0x7FC0, dtype=np.uint16)


@dataclasses.dataclass
class Case:
    """One step's inputs in the op's layout; 16-bit arrays hold storage bit patterns."""

    params: dict[str, int]
    qkv: np.ndarray
    key_cache: np.ndarray
    value_cache: np.ndarray
    seq_lens_encoder: np.ndarray
    seq_lens_decoder: np.ndarray
    seq_lens_this_time: np.ndarray
    cu_seqlens_q: np.ndarray
    block_tables: np.ndarray
    rotary_cos: np.ndarray
    rotary_sin: np.ndarray
    head_windows: np.ndarray  # int32 [2, kv_num_heads]: row 0 each KV head's window (0 = full), row 1 its sink
    out: np.ndarray
    kv_head_slots: np.ndarray | None = None  # None: KV head h in slot h (params kv_slots 0)
    # Quantized pages (params cache_quant != 0): the caches are uint8 / int8 codes (int4: uint8
    # [num_blocks, kv_slots, block_size, head_dim / 2], two codes a byte; k8v4: int8 keys, int4 values)
    # and these float32 [num_blocks, kv_slots, block_size] their rows' scales.
    key_cache_scales: np.ndarray | None = None
    value_cache_scales: np.ndarray | None = None
    attention_sinks: np.ndarray | None = None  # float32 [num_heads] learned sink logits (gpt-oss), or none

    def with_params(self, **changes) -> "Case":
        return dataclasses.replace(self, params={**self.params, **changes})


@dataclasses.dataclass
class RunResult:
    status: int  # 0 ok, 1 rejected arguments, 2 device-side error, 3 CUDA error
    error_info: tuple[int, int, int, int]
    message: str
    avg_ms: float
    out: np.ndarray | None
    key_cache: np.ndarray | None
    value_cache: np.ndarray | None
    key_cache_scales: np.ndarray | None = None
    value_cache_scales: np.ndarray | None = None
    races: str = ""  # CUDA-on-CPU executor: launches whose results depend on the thread order


class Harness:
    def __init__(self, library: Path | str):
        self.lib = bind(bind(ctypes.CDLL(str(library)), C_ABI), HARNESS_ABI)
        # A build of the CUDA-on-CPU executor: every launch runs under several thread orders.
        self.on_cpu = hasattr(self.lib, "cuda_on_cpu_races")
        if self.on_cpu:
            bind(self.lib, EXECUTOR_ABI)
            from fastdeploy import envs

            if envs.CUDA_ON_CPU_THREADS.strip():  # a launch's blocks on this many OS threads at once
                self.lib.cuda_on_cpu_set_threads(int(envs.CUDA_ON_CPU_THREADS))

    def device_count(self) -> int:
        return self.lib.aa_device_count()

    def workspace_bytes(self, params: dict[str, int]) -> int:
        p = _Params(**params)
        return self.lib.append_attention_workspace_bytes(ctypes.byref(p))

    def copy_bandwidth_gbps(self, nbytes: int = 1 << 30, iters: int = 10) -> float:
        return self.lib.aa_copy_bandwidth_gbps(nbytes, iters)

    def run(
        self,
        case: Case,
        *,
        fill_on_device: bool = False,
        warmup: int = 0,
        iters: int = 0,
        orders: str | None = None,
    ) -> RunResult:
        """Runs one step; outputs are fresh arrays (the case is left untouched). On the CUDA-on-CPU
        executor every launch runs under `orders` (default: CUDA_ON_CPU_ORDERS, else
        "forward,reverse") and RunResult.races lists the launches whose results differ."""
        if self.on_cpu:
            spec = orders or os.environ.get("CUDA_ON_CPU_ORDERS") or "forward,reverse"  # the tests' default: two
            if self.lib.cuda_on_cpu_set_orders(spec.encode()) != 0:
                raise ValueError(f"bad thread orders {spec!r}")
            self.lib.cuda_on_cpu_clear_races()
        p = _Params(**case.params)
        windows_shape = np.shape(case.head_windows)
        if windows_shape != (2, case.params["kv_num_heads"]):  # the C side reads 2 * kv_num_heads ints
            raise ValueError(f"head_windows must be [2, kv_num_heads={case.params['kv_num_heads']}], "
                             f"got {list(windows_shape)}")
        keep = []  # contiguous host arrays must outlive the call

        def ptr(arr, dtype, copy=False):
            if arr is None:
                return None
            a = np.array(arr, dtype=dtype, copy=True) if copy else np.ascontiguousarray(arr, dtype)
            keep.append(a)
            return a.ctypes.data_as(ctypes.c_void_p)

        host = not fill_on_device
        quantized = case.params.get("cache_quant", CACHE_FLOAT) != CACHE_FLOAT
        cache_dtype = np.uint8 if quantized else np.uint16
        out = np.array(case.out, dtype=np.uint16) if host else None
        # Quantized codes may arrive as int8 or uint8 arrays: their bytes are what the device gets.
        kc = np.array(case.key_cache, copy=True).view(cache_dtype) if host else None
        vc = np.array(case.value_cache, copy=True).view(cache_dtype) if host else None
        ks = np.array(case.key_cache_scales, dtype=np.float32) if host and quantized else None
        vs = np.array(case.value_cache_scales, dtype=np.float32) if host and quantized else None
        b = _Buffers(
            qkv=ptr(case.qkv, np.uint16) if host else None,
            key_cache=ptr(kc, cache_dtype),
            value_cache=ptr(vc, cache_dtype),
            seq_lens_encoder=ptr(case.seq_lens_encoder, np.int32),
            seq_lens_decoder=ptr(case.seq_lens_decoder, np.int32),
            seq_lens_this_time=ptr(case.seq_lens_this_time, np.int32),
            cu_seqlens_q=ptr(case.cu_seqlens_q, np.int32),
            block_tables=ptr(case.block_tables, np.int32),
            rotary_cos=ptr(case.rotary_cos, np.float32),
            rotary_sin=ptr(case.rotary_sin, np.float32),
            head_windows=ptr(case.head_windows, np.int32),
            out=ptr(out, np.uint16),
            kv_head_slots=ptr(case.kv_head_slots, np.int32),
            key_cache_scales=ptr(ks, np.float32),
            value_cache_scales=ptr(vs, np.float32),
            attention_sinks=ptr(case.attention_sinks, np.float32),
        )
        avg_ms = ctypes.c_float(0.0)
        info = (ctypes.c_int * 4)()
        msg = ctypes.create_string_buffer(1024)
        status = self.lib.aa_run(
            ctypes.byref(p),
            ctypes.byref(b),
            int(fill_on_device),
            warmup,
            iters,
            ctypes.byref(avg_ms),
            info,
            msg,
            len(msg),
        )
        ok = status == 0 and host
        races = self.lib.cuda_on_cpu_races().decode() if self.on_cpu else ""
        return RunResult(
            races=races,
            status=status,
            error_info=tuple(info),
            message=msg.value.decode(errors="replace"),
            avg_ms=avg_ms.value,
            out=out if ok else None,
            key_cache=kc if ok else None,
            value_cache=vc if ok else None,
            key_cache_scales=ks if ok else None,
            value_cache_scales=vs if ok else None,
        )
