"""Build-once, load-fast loader for the C++ CPU custom ops (custom_ops/cpu_ops).

Each op library (`CpuOpLibrary`: the attention op, the BLAS-backed GEMM) is compiled on first use
with ``paddle.utils.cpp_extension`` into ``$FD_CUSTOM_OP_DIR/<prefix><key>`` (default
``~/.cache/fastdeploy/custom_ops/...``), where ``key`` hashes the sources, the compile and link
flags, and the Paddle/Python versions, so an edited source or a different machine never picks up
a stale build. A file lock serialises builds across processes (several workers may start at
once); later imports only load the finished shared library.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Callable

from fastdeploy.paddle_env import CCACHE_WARNING

MODULE_NAME = "fd_cpu_ops"  # the attention op's module
_REPO_ROOT = Path(__file__).resolve().parents[5]
# A source checkout (pip install -e) keeps the sources at custom_ops/cpu_ops, upstream's path; a
# regular install carries a copy inside the package (setup.py's build_py puts it there).
_CANDIDATES = (_REPO_ROOT / "custom_ops" / "cpu_ops", Path(__file__).resolve().parents[4] / "_custom_ops" / "cpu_ops")
SOURCE_DIR = next((p for p in _CANDIDATES if p.is_dir()), _CANDIDATES[0])
_BUILT_MARKER = "BUILD_OK"


@dataclass(frozen=True)
class CpuOpLibrary:
    """One compiled module: its .cc files in SOURCE_DIR (every header there is hashed too) and
    what it links against. `link` is called at build time (it may import the library's package)
    and returns (include dirs, linker flags, a version string that enters the cache key)."""

    module_name: str
    sources: tuple
    what: str  # for messages: "the CPU attention op"
    dir_prefix: str = ""  # build folder name = prefix + key (empty: the attention op's folders as before)
    link: Callable[[], tuple] = field(default=lambda: ([], [], ""), compare=False)


ATTENTION_OPS = CpuOpLibrary(MODULE_NAME, ("append_attention.cc",), "the CPU attention op")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def compile_flags() -> list[str]:
    """Portable -O3 plus AVX2/FMA only when this CPU has them.

    -march=native is avoided on purpose: a cache directory may be shared by
    machines of different generations. AVX2/FMA flags enter the cache key, so
    a CPU without them builds (and uses) its own copy.
    """
    # -fopenmp-simd: honour `#pragma omp simd` (vectorised reductions) without
    # linking an OpenMP runtime; threads come from the op's own pool.
    # -ffp-contract=off: a multiply-add the source does not write as an FMA is two roundings in
    # every copy of a loop (vector body and scalar tail alike), so an element's bits never depend on
    # where in a vector it landed — the ops' batch-invariance rests on that.
    flags = ["-O3", "-fopenmp-simd", "-ffp-contract=off", "-std=c++17", "-Wall"]
    cpu = _cpu_flags()
    if {"avx2", "fma"} <= cpu:
        flags += ["-mavx2", "-mfma"]
    return flags


def _sources(lib: CpuOpLibrary = ATTENTION_OPS) -> list[Path]:
    if not SOURCE_DIR.is_dir():
        raise RuntimeError(
            f"FastDeploy CPU custom-op sources not found (looked in {', '.join(map(str, _CANDIDATES))}); "
            "reinstall the package (the ops are compiled on first use)."
        )
    return [SOURCE_DIR / name for name in lib.sources] + sorted(SOURCE_DIR.glob("*.h"))


def _build_key(sources: list[Path], flags: list[str]) -> str:
    import paddle

    h = hashlib.sha256()
    for src in sources:
        h.update(src.name.encode())
        h.update(src.read_bytes())
    h.update(" ".join(flags).encode())
    h.update(paddle.__version__.encode())
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


def op_cache_root() -> Path:
    """Where every compiled op library is kept: $FD_CUSTOM_OP_DIR, or ~/.cache/fastdeploy/custom_ops."""
    return Path(os.environ.get("FD_CUSTOM_OP_DIR") or Path.home() / ".cache" / "fastdeploy" / "custom_ops")


def build_dir(lib: CpuOpLibrary = ATTENTION_OPS) -> Path:
    includes, ldflags, version = lib.link()
    return op_cache_root() / (lib.dir_prefix + _build_key(_sources(lib), [*compile_flags(), *includes, *ldflags, version]))


def _check_compiler(what: str = ATTENTION_OPS.what) -> None:
    # setuptools compiles .cc files with CC and links with CXX.
    missing = []
    for var in ("CC", "CXX"):
        cmd = os.environ.get(var) or sysconfig.get_config_var(var) or "c++"
        exe = cmd.split()[0]
        if shutil.which(exe) is None:
            missing.append(f"{var}={exe!r}")
    if missing:
        raise RuntimeError(
            f"Building {what} needs a C++ compiler "
            f"(GCC >= 8), but {', '.join(missing)} was not found. Install one "
            "(e.g. `apt-get install g++`) or point CC/CXX at it."
        )


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(out_dir: Path, lib: CpuOpLibrary) -> ModuleType:
    from paddle.utils.cpp_extension import load

    _check_compiler(lib.what)
    includes, ldflags, _ = lib.link()
    print(
        f"[fastdeploy] compiling {lib.what} into {out_dir} (first use only, about 15 s)...",
        file=sys.stderr,
        flush=True,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    # Paddle prints its own progress to stdout; keep stdout clean for callers
    # that stream results there (servers, benchmark JSON).
    with contextlib.redirect_stdout(sys.stderr):
        try:
            module = load(
                name=lib.module_name,
                sources=[str(s) for s in _sources(lib) if s.suffix == ".cc"],
                extra_cxx_cflags=compile_flags(),
                extra_ldflags=["-pthread", *ldflags],
                extra_include_paths=[str(SOURCE_DIR), *includes],
                build_directory=str(out_dir),
            )
        except Exception as e:  # the compiler's own messages are already on stderr
            raise RuntimeError(
                f"Building {lib.what} in {out_dir} failed; see the compiler output above."
            ) from e
    (out_dir / _BUILT_MARKER).write_text(" ".join(compile_flags()) + "\n")
    return module


@contextlib.contextmanager
def _quiet_paddle_extension_logs():
    """Paddle's extension helpers warn about ccache and log INFO lines on every
    load; neither is actionable for users of a prebuilt op."""
    logger = logging.getLogger("utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.WARNING)
    # The build runs setup.py in a child Python, which imports Paddle again: filter it there too.
    saved = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [saved, f"ignore:{CCACHE_WARNING}:UserWarning"]))
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=CCACHE_WARNING, category=UserWarning)
            yield
    finally:
        logger.setLevel(level)
        if saved is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = saved


@lru_cache(maxsize=None)
def load_library(lib: CpuOpLibrary) -> ModuleType:
    """The compiled module of `lib`; builds it first if this machine has no copy yet. Its run-time options
    (custom_ops/cpu_ops/cpu_options.h) are set before it is returned, from the environment as it is now
    (start-up: the ops never read it) and any set_cpu_options call made before."""
    with _quiet_paddle_extension_logs():
        from paddle.utils.cpp_extension.extension_utils import _import_module_from_library

        out_dir = build_dir(lib)
        # The lock also covers the import: Paddle writes a small generated .py
        # next to the library while loading it.
        with _locked(out_dir.with_suffix(".lock")):
            if not (out_dir / _BUILT_MARKER).exists():
                module = _build(out_dir, lib)
            else:
                module = _import_module_from_library(lib.module_name, str(out_dir / lib.module_name))
    import ctypes

    handle = ctypes.CDLL(str(Path(module.__file__).parent / f"{lib.module_name}.so"))  # the library Paddle loaded
    handle.fd_cpu_set_options.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    _OPTIONS.setdefault("values", env_cpu_options())
    _OPTIONS.setdefault("handles", []).append(handle)
    _send_options(handle, _OPTIONS["values"])
    return module


# The CPU ops' run-time options, in cpu_options.h's order: what every loaded library holds.
CPU_OPTIONS = ("attn_threads", "pool_spin_us", "linear_isa", "attn_generic", "kv_key_rotation", "kv_value_rotation")
_OPTIONS: dict = {}


def env_cpu_options() -> dict:
    """The options as the environment sets them (fastdeploy/envs.py), read once when the first library loads."""
    from fastdeploy import envs

    return dict(attn_threads=envs.FD_CPU_ATTN_NUM_THREADS, pool_spin_us=envs.FD_CPU_POOL_SPIN_US,
                linear_isa={"avx2": 1, "generic": 2}.get(envs.FD_CPU_LINEAR_ISA.strip().lower(), 0),
                attn_generic=int(envs.FD_CPU_ATTN_ISA.strip().lower() == "generic"),
                kv_key_rotation=int(envs.FD_KV_QUANT_ROTATION != 0),
                kv_value_rotation=int(envs.FD_KV_QUANT_ROTATE_VALUES == 1))


def set_cpu_options(**options) -> dict:
    """Change CPU op options between calls in every loaded op library (and those loaded later); returns the
    previous values, for a measurement to restore. For the knobs a measurement varies per call
    (attn_threads, kv_key_rotation, kv_value_rotation): pool_spin_us, linear_isa and attn_generic are
    fixed at an op's first use."""
    unknown = set(options) - set(CPU_OPTIONS)
    if unknown:
        raise ValueError(f"set_cpu_options: unknown option(s) {sorted(unknown)}; known: {', '.join(CPU_OPTIONS)}")
    values = _OPTIONS.setdefault("values", env_cpu_options())
    previous = {name: values[name] for name in options}
    values.update({name: int(v) for name, v in options.items()})
    for handle in _OPTIONS.get("handles", []):
        _send_options(handle, values)
    return previous


def _send_options(handle, values: dict) -> None:
    import ctypes

    array = (ctypes.c_int * len(CPU_OPTIONS))(*(int(values[name]) for name in CPU_OPTIONS))
    handle.fd_cpu_set_options(array, len(CPU_OPTIONS))


def load_cpu_ops() -> ModuleType:
    """The attention op's module (append_attention_cpu, append_attention_validate)."""
    return load_library(ATTENTION_OPS)
