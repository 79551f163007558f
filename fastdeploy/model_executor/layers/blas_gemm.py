"""The CPU GEMM op: OpenBLAS's sgemm (the `scipy-openblas32` wheel, made for linking) behind a
Paddle custom op (custom_ops/cpu_ops/linear_sgemm.cc), built once by cpu_op_loader.

Why OpenBLAS: on this project's 2-core machine Paddle 3.3.1's CPU matmul runs `[M, 576] x
[576, 1536]` at 15-26 GFLOP/s where OpenBLAS reaches 50-180 (benchmarks/bench_linear_cpu.py
prints both); the wheel ships a DYNAMIC_ARCH library with a stable C ABI and its own headers, so
the op links against it without a system BLAS. OpenBLAS reads OPENBLAS_CORETYPE (which kernel
set to use) at load; this module never sets it: `blas_info()` reports what the loaded library
chose.

Threads: OpenBLAS takes its count from OPENBLAS_NUM_THREADS, else OMP_NUM_THREADS, and
`import paddle` sets OMP_NUM_THREADS=1 when it is unset, which would leave the GEMM on one
core. So unless OPENBLAS_NUM_THREADS is given, the op's first load sets the count to the cores
this process may run on.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache

from fastdeploy.model_executor.layers.attention.ops.cpu_op_loader import CpuOpLibrary, load_library

PACKAGE = "scipy-openblas32"


def _openblas():
    try:
        import scipy_openblas32
    except ImportError as e:
        raise RuntimeError(
            f"The CPU GEMM op links OpenBLAS from the `{PACKAGE}` package, which is not installed: "
            f"`pip install {PACKAGE}` (it is in this project's `cpu` extra)."
        ) from e
    return scipy_openblas32


def _link() -> tuple:
    ob = _openblas()
    lib_dir = ob.get_lib_dir()
    return ([ob.get_include_dir()], [f"-L{lib_dir}", f"-l{ob.get_library()}", f"-Wl,-rpath,{lib_dir}"],
            f"{PACKAGE} {ob.__version__}")


GEMM_OPS = CpuOpLibrary("fd_cpu_gemm", ("linear_packed.cc", "linear_sgemm.cc"), "the CPU GEMM op (OpenBLAS sgemm)",
                        dir_prefix="gemm-", link=_link)


@lru_cache(maxsize=None)
def linear_sgemm():
    """The op: `linear_sgemm(x [.., K] float32, w [N, K] float32) -> [.., N]`, x . w^T."""
    op = load_library(GEMM_OPS).linear_sgemm
    if "OPENBLAS_NUM_THREADS" not in os.environ:
        _library().scipy_openblas_set_num_threads(len(os.sched_getaffinity(0)))
    return op


@lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    # The process already holds this library once the op is loaded: dlopen returns that handle,
    # so the answers below describe the instance the op calls.
    ob = _openblas()
    return ctypes.CDLL(os.path.join(ob.get_lib_dir(), f"lib{ob.get_library()}.so"))


def blas_info() -> dict:
    """Which kernels and how many threads the loaded OpenBLAS uses, and the env that chose them."""
    lib = _library()
    prefix = "scipy_openblas_"
    getattr(lib, prefix + "get_corename").restype = ctypes.c_char_p
    getattr(lib, prefix + "get_config").restype = ctypes.c_char_p
    return {
        "corename": getattr(lib, prefix + "get_corename")().decode(),
        "threads": int(getattr(lib, prefix + "get_num_threads")()),
        "config": getattr(lib, prefix + "get_config")().decode(),
        "env": {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS",
                                           "OMP_NUM_THREADS") if k in os.environ},
    }


PANEL = 32  # custom_ops/cpu_ops/linear_packed.cc's output columns per panel


def pack(weight):
    """`[N, K]` float32 -> the packed `[ceil(N / 32), K, 32]` layout linear_packed streams."""
    import paddle

    n, k = weight.shape
    panels = -(-n // PANEL)
    w = weight if weight.is_contiguous() else weight.contiguous()
    if panels * PANEL != n:
        w = paddle.concat([w, paddle.zeros([panels * PANEL - n, k], dtype=w.dtype)], axis=0)
    return w.reshape([panels, PANEL, k]).transpose([0, 2, 1]).contiguous()


def linear_packed():
    """`linear_packed(x [.., K], packed, n) -> [.., n]`, and `packed_rows(packed, ids, n)`."""
    linear_sgemm()  # one module: loads it and settles the threads
    return load_library(GEMM_OPS).linear_packed


def packed_rows():
    return load_library(GEMM_OPS).packed_rows
