"""Build-once loader for the CUDA AppendAttention op (custom_ops/gpu_ops), like cpu_op_loader.

Two ways to get it, tried in this order:
  1. the op installed by `python custom_ops/setup_ops.py install` (module `fastdeploy_ops_gpu`);
  2. a JIT build on first use with `paddle.utils.cpp_extension.load` (nvcc, sm_80 + sm_90) into
     `$FD_CUSTOM_OP_DIR/gpu-<key>`, where the key hashes the CUDA sources, the flags and the
     Paddle/Python versions; a file lock serialises concurrent builds (one per TP rank at start-up).
Only a CUDA build of Paddle can do either; with the CPU wheel this raises, naming both wheels.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from fastdeploy.worker.device import GPU_WHEEL_HINT

from .cpu_op_loader import _BUILT_MARKER, SOURCE_DIR as CPU_SOURCE_DIR, _locked, _quiet_paddle_extension_logs, build_dir

MODULE_NAME = "fd_gpu_ops"
INSTALLED_MODULE = "fastdeploy_ops_gpu"  # what custom_ops/setup_ops.py installs
_REPO_ROOT = Path(__file__).resolve().parents[5]
_CANDIDATES = (_REPO_ROOT / "custom_ops" / "gpu_ops", Path(__file__).resolve().parents[4] / "_custom_ops" / "gpu_ops")
SOURCE_DIR = next((p for p in _CANDIDATES if p.is_dir()), _CANDIDATES[0])
# The same targets the CI compile check builds (tests/custom_ops/gpu_harness.py) and setup_ops.py.
NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=[sm_90,compute_90]",
    # paddle/extension.h then leaves out Paddle's Python bindings (pybind.h), whose ATen shim pulls
    # cublasXt.h and cudnn.h: a CUDA toolkit without the cuDNN headers could not build the op. It
    # uses no binding (Paddle loads a custom-op-only library), and CI compiles it with these flags.
    "-DPADDLE_NO_PYTHON",
]


class GpuOpUnavailable(RuntimeError):
    pass


def gpu_sources() -> list[Path]:
    """The op wrapper plus every kernel file; the ctypes test harness is not part of the op."""
    kernels = sorted(p for p in (SOURCE_DIR / "append_attn").glob("*.cu") if p.name != "harness.cu")
    return [SOURCE_DIR / "append_attention.cu", *kernels]


def include_dirs() -> list[Path]:
    """gpu_ops/ for the kernels' API header; cpu_ops/ for append_attention_checks.h, the input
    checks the wrapper shares with the CPU op."""
    return [SOURCE_DIR, CPU_SOURCE_DIR]


def _build_key() -> str:
    import paddle

    h = hashlib.sha256()
    for src in [*sorted(SOURCE_DIR.rglob("*.cu*")), *sorted(CPU_SOURCE_DIR.glob("*.h"))]:
        h.update(src.name.encode())
        h.update(src.read_bytes())
    h.update(" ".join(NVCC_FLAGS).encode())
    h.update(paddle.__version__.encode())
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


def gpu_build_dir() -> Path:
    return build_dir().parent / f"gpu-{_build_key()}"


def _require_cuda_paddle() -> None:
    import paddle

    if not paddle.is_compiled_with_cuda():
        raise GpuOpUnavailable(f"the CUDA attention op needs a CUDA build of Paddle, but this Paddle "
                               f"({paddle.__version__}) is the CPU build; {GPU_WHEEL_HINT}")


def _build(out_dir: Path) -> ModuleType:
    from paddle.utils.cpp_extension import load

    print(f"[fastdeploy] compiling the CUDA attention op into {out_dir} (first use only, a few minutes)...",
          file=sys.stderr, flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(sys.stderr):
        try:
            module = load(name=MODULE_NAME, sources=[str(s) for s in gpu_sources()],
                          extra_cxx_cflags=["-O3", "-std=c++17"], extra_cuda_cflags=NVCC_FLAGS,
                          extra_include_paths=[str(d) for d in include_dirs()], build_directory=str(out_dir))
        except Exception as e:
            raise GpuOpUnavailable(f"building the CUDA attention op in {out_dir} failed (nvcc output above); "
                                   f"or build it ahead with `python custom_ops/setup_ops.py install`") from e
    (out_dir / _BUILT_MARKER).write_text(" ".join(NVCC_FLAGS) + "\n")
    return module


@lru_cache(maxsize=None)
def load_gpu_ops() -> ModuleType:
    """A module with `append_attention_gpu`; raises GpuOpUnavailable with the remedy."""
    _require_cuda_paddle()
    try:
        import importlib

        return importlib.import_module(INSTALLED_MODULE)
    except ImportError:
        pass
    with _quiet_paddle_extension_logs():
        from paddle.utils.cpp_extension.extension_utils import _import_module_from_library

        out_dir = gpu_build_dir()
        with _locked(out_dir.with_suffix(".lock")):
            if not (out_dir / _BUILT_MARKER).exists():
                return _build(out_dir)
            return _import_module_from_library(MODULE_NAME, str(out_dir / MODULE_NAME))
