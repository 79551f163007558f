"""Build-once loader for the CUDA AppendAttention kernels executed on the CPU (the CUDA-on-CPU
executor, custom_ops/gpu_ops/cuda_on_cpu; FD_ATTENTION_BACKEND=CUDA_ON_CPU and the kernel tests).

Every .cu of custom_ops/gpu_ops/append_attn is compiled by the host C++ compiler as C++ with the
executor's header force-included, against the CUDA toolkit's host headers (cuda_bf16.h, ...: they
give the 16- and 8-bit float conversions), and linked with the executor's runtime into one shared
library with the kernels' C ABI (append_attn_api.cuh). `-z defs`: a CUDA call the executor does not
implement fails the link with its name. Like cpu_op_loader, the engine's build lives in
`$FD_CUSTOM_OP_DIR/cuda_on_cpu-<key>` (the key hashes sources and flags) under a file lock.

This module imports only the standard library at module level: the paddle-free kernel test harness
(tests/custom_ops/gpu_harness.py) loads it by path for `build` and the ctypes structs.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from functools import lru_cache
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[5]
_CANDIDATES = (_REPO_ROOT / "custom_ops", Path(__file__).resolve().parents[4] / "_custom_ops")
_CUSTOM_OPS = next((p for p in _CANDIDATES if (p / "gpu_ops").is_dir()), _CANDIDATES[0])
SOURCE_DIR = _CUSTOM_OPS / "gpu_ops" / "append_attn"
EXECUTOR_DIR = _CUSTOM_OPS / "gpu_ops" / "cuda_on_cpu"
SHARED_HEADER = _CUSTOM_OPS / "cpu_ops" / "kv_quant.h"  # the quantized-page rule, included by the kernels
LIB_NAME = "libappend_attn_harness.so"
# -fno-strict-aliasing: the kernels move 16-bit and 8-bit data through 32/64/128-bit words, which
# nvcc allows; -Wno-sign-compare: threadIdx is unsigned, as under nvcc, which does not warn.
CPU_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-fno-strict-aliasing", "-Wall", "-Wno-unknown-pragmas",
             "-Wno-sign-compare", "-Werror")

# The C ABI's structs (append_attn_api.cuh; tests/custom_ops/test_op_abi_contract.py checks them).
PARAM_FIELDS = ("dtype", "token_num", "bsz", "num_heads", "kv_num_heads", "head_dim", "block_size", "num_blocks",
                "max_blocks_per_seq", "head_wise_table", "max_position", "visit_all_pages", "dual_pass", "kv_slots",
                "cache_quant")
FLOAT_PARAM_FIELDS = ("softcap",)  # after the ints
BUFFER_FIELDS = ("qkv", "key_cache", "value_cache", "seq_lens_encoder", "seq_lens_decoder", "seq_lens_this_time",
                 "cu_seqlens_q", "block_tables", "rotary_cos", "rotary_sin", "head_windows", "out",
                 "kv_head_slots", "key_cache_scales", "value_cache_scales", "attention_sinks")


class AppendAttnParams(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in PARAM_FIELDS] + [(name, ctypes.c_float) for name in FLOAT_PARAM_FIELDS]


class AppendAttnBuffers(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in BUFFER_FIELDS]


class BuildError(RuntimeError):
    pass


def find_cuda_include() -> Path | None:
    """The toolkit's headers (cuda_bf16.h, cuda_fp8.h, ...), which the executor compiles with g++."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.insert(0, str(Path(nvcc).resolve().parents[1]))
    for root in candidates:
        if root and (Path(root) / "include" / "cuda_bf16.h").is_file():
            return Path(root) / "include"
    return None


def _object_name(src: Path) -> str:
    return src.parent.name + "_" + src.stem + ".o"


def _reusable_object(src: Path, source_dir: Path, reuse_from: Path | None) -> Path | None:
    """An object of a previous build of SOURCE_DIR that `src` would compile to unchanged: the
    executor's runtime, or a .cu whose text and whose folder's .cuh headers equal SOURCE_DIR's."""
    if reuse_from is None or not (Path(reuse_from) / _object_name(src)).is_file():
        return None
    if src.parent != EXECUTOR_DIR:
        for path in [src, *Path(source_dir).glob("*.cuh")]:
            original = SOURCE_DIR / path.name
            if not original.is_file() or original.read_bytes() != path.read_bytes():
                return None
    return Path(reuse_from) / _object_name(src)


def build(out_dir: Path, jobs: int = 2, source_dir: Path = SOURCE_DIR, extra_flags=(),
          reuse_from: Path | None = None) -> tuple[Path, dict[str, float]]:
    """Compiles and links the library into out_dir; returns (library, seconds per source). With
    `reuse_from` (a build of the unchanged sources) only what differs from them is compiled again
    (a copy of the sources with one kernel edited)."""
    include = find_cuda_include()
    if include is None:
        raise BuildError("the CUDA toolkit's headers (cuda_bf16.h) were not found; set CUDA_HOME")
    cxx = os.environ.get("CXX") or "g++"
    if extra_flags:
        reuse_from = None  # objects built without the flags do not fit
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    common = [cxx, *CPU_FLAGS, *extra_flags, f"-I{include}", f"-I{EXECUTOR_DIR}"]
    units = [(src, ["-x", "c++", "-include", str(EXECUTOR_DIR / "cuda_on_cpu.h")])
             for src in sorted(Path(source_dir).glob("*.cu"))]
    units += [(src, []) for src in sorted(EXECUTOR_DIR.glob("*.cpp"))]

    def compile_one(unit) -> tuple[str, float, Path]:
        src, lang = unit
        reused = _reusable_object(src, source_dir, reuse_from)
        if reused is not None:
            return src.name, 0.0, reused
        obj = out_dir / _object_name(src)
        cmd = [*common, *lang, "-c", str(src), "-o", str(obj)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"{cxx} failed on {src.name}:\n{' '.join(cmd)}\n{proc.stderr}")
        return src.name, time.perf_counter() - t0, obj

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(compile_one, units))
    lib = out_dir / LIB_NAME
    link = [cxx, "-shared", "-Wl,-z,defs", "-o", str(lib), *[str(obj) for _, _, obj in results], "-lpthread"]
    proc = subprocess.run(link, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"link failed:\n{' '.join(link)}\n{proc.stderr}")
    return lib, {name: secs for name, secs, _ in results}


@lru_cache(maxsize=None)
def _compiler_identity(cxx: str) -> str:
    """The compiler's name and its own version line: another compiler, or an upgraded one, builds
    another library."""
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return cxx  # build() then reports the compiler that cannot run
    return f"{cxx} {out.splitlines()[0] if out else ''}"


def source_key() -> str:
    """Hash of everything the library is built from: sources, executor, flags, the compiler (CXX and
    its version) and the CUDA toolkit's headers it includes (their folder and cuda_bf16.h's text)."""
    digest = hashlib.sha256()
    for path in [*sorted(SOURCE_DIR.glob("*.cu*")), SHARED_HEADER, *sorted(EXECUTOR_DIR.glob("*"))]:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(CPU_FLAGS).encode())
    digest.update(_compiler_identity(os.environ.get("CXX") or "g++").encode())
    include = find_cuda_include()
    if include is not None:
        digest.update(str(include).encode())
        digest.update((include / "cuda_bf16.h").read_bytes())
    return digest.hexdigest()[:16]


@lru_cache(maxsize=1)
def load_cuda_on_cpu() -> ctypes.CDLL:
    """The engine's library (built on first use, about a minute on 2 cores), with the C ABI declared."""
    from .cpu_op_loader import _locked, op_cache_root

    root, key = op_cache_root(), source_key()
    out = root / f"cuda_on_cpu-{key}"
    with _locked(root / f"cuda_on_cpu-{key}.lock"):
        if not (out / LIB_NAME).is_file():
            print(f"[fastdeploy] compiling the CUDA kernels for the CPU executor into {out} (first use only)...",
                  flush=True)
            # Built aside and moved in whole: an interrupted build never leaves a library that looks finished.
            staging = Path(tempfile.mkdtemp(prefix=f"cuda_on_cpu-{key}.", dir=root))
            build(staging, jobs=max(1, min(4, os.cpu_count() or 1)))
            shutil.rmtree(out, ignore_errors=True)
            os.replace(staging, out)
    lib = ctypes.CDLL(str(out / LIB_NAME))
    lib.append_attention_workspace_bytes.restype = ctypes.c_size_t
    lib.append_attention_workspace_bytes.argtypes = [ctypes.POINTER(AppendAttnParams)]
    lib.append_attention_launch.restype = ctypes.c_int
    lib.append_attention_launch.argtypes = [ctypes.POINTER(AppendAttnParams), ctypes.POINTER(AppendAttnBuffers),
                                            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p]
    lib.append_attention_last_error.restype = ctypes.c_char_p
    lib.cuda_on_cpu_set_orders.restype = ctypes.c_int
    lib.cuda_on_cpu_set_orders.argtypes = [ctypes.c_char_p]
    lib.cuda_on_cpu_set_threads.argtypes = [ctypes.c_int]
    lib.cuda_on_cpu_set_sm_count.argtypes = [ctypes.c_int]
    return lib


def configure_executor(lib, env) -> None:
    """The executor's settings from a config's env flags (CUDA_ON_CPU_ORDERS, _THREADS, _SM_COUNT): the
    library reads no environment of its own."""
    if lib.cuda_on_cpu_set_orders(env.CUDA_ON_CPU_ORDERS.encode()) != 0:
        raise ValueError(f"CUDA_ON_CPU_ORDERS={env.CUDA_ON_CPU_ORDERS!r}: expected comma-separated thread orders "
                         f"(forward, reverse, shuffle:SEED)")
    for name, setter in (("CUDA_ON_CPU_THREADS", lib.cuda_on_cpu_set_threads),
                         ("CUDA_ON_CPU_SM_COUNT", lib.cuda_on_cpu_set_sm_count)):
        raw = getattr(env, name).strip()
        if raw:
            if not raw.isdigit():
                raise ValueError(f"{name}={raw!r} must be a positive integer")
            setter(int(raw))
