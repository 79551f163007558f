"""The CPU GEMM ops, one module built once by cpu_op_loader:
- `linear_packed` (custom_ops/cpu_ops/linear_packed.cc): weights packed once at load (`pack`),
  what the decoder's layers run; row-invariant by construction, 1-3x Paddle's matmul at decode
  row counts (benchmarks/bench_linear_cpu.py);
- `linear_sgemm` (custom_ops/cpu_ops/linear_sgemm.cc): OpenBLAS's sgemm from the
  `scipy-openblas32` wheel (made for linking: a DYNAMIC_ARCH library with a stable C ABI and its
  own headers), for weights used as they are; row-invariant once small products are padded out of
  its small-matrix kernels (the op does that). Its packing of the weight on every call makes it
  3-5x slower than the packed kernel for 1-8 rows, hence the packed kernel for the model. OpenBLAS reads OPENBLAS_CORETYPE (which kernel
set to use) at load; this module never sets it: `blas_info()` reports what the loaded library
chose.

Threads: OpenBLAS takes its count from OPENBLAS_NUM_THREADS, else OMP_NUM_THREADS (which
`import paddle` sets to 1 when unset). Unless OPENBLAS_NUM_THREADS is given, the op's first load
pins it to one thread: on a busy 2-core machine OpenBLAS's spinning thread hand-off made
small-row products 10-100x slower (bench_linear_cpu.py, wall clock), and the model's large
layers run on the packed kernel (linear_packed.cc), whose work pool is robust to that; only
weights used as they are (MoE experts, the router) come here.
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


GEMM_OPS = CpuOpLibrary("fd_cpu_gemm", ("linear_packed.cc", "linear_blocks.cc", "linear_blocks_int8.cc",
                                        "linear_sgemm.cc", "rms_norm.cc", "gated_activation.cc",
                                        "decoder_block_ops.cc", "decoder_stack.cc", "machine_limits.cc"),
                        "the CPU dense-layer ops (packed GEMM, GGUF-block GEMM exact and with int8 activations, "
                        "OpenBLAS sgemm, RMSNorm, gated activation, a decoder layer's dense work fused, the whole "
                        "decoder stack in one call)",
                        dir_prefix="gemm-", link=_link)


def build_dense_ops() -> None:
    """Compile (on first use) and load the dense-layer ops now, while the engine is being built: a server
    that says it is ready must not make its first request wait a minute for the compiler."""
    linear_sgemm()  # loads the one module (every dense-layer op) and settles OpenBLAS's threads


@lru_cache(maxsize=None)
def rms_norm_rows():
    """The op: `rms_norm_rows(x [.., D] float32, weight [D] float32, eps) -> [.., D]`, row-invariant."""
    return load_library(GEMM_OPS).rms_norm_rows


@lru_cache(maxsize=None)
def add_rms_norm_rows():
    """The op: `add_rms_norm_rows(x, delta, weight, eps) -> (x + delta, rms_norm(x + delta))`, float32."""
    return load_library(GEMM_OPS).add_rms_norm_rows


@lru_cache(maxsize=None)
def gated_activation_rows():
    """The op: `gated_activation(x [.., 2F] float32, act) -> [.., F]`: act(x[.., :F]) * x[.., F:],
    act 0 = SiLU, 1 = tanh-approximated GELU."""
    return load_library(GEMM_OPS).gated_activation


@lru_cache(maxsize=None)
def linear_sgemm():
    """The op: `linear_sgemm(x [.., K] float32, w [N, K] float32) -> [.., N]`, x . w^T."""
    op = load_library(GEMM_OPS).linear_sgemm
    if "OPENBLAS_NUM_THREADS" not in os.environ:
        _library().scipy_openblas_set_num_threads(1)
    return op


@lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    # The process already holds this library once the op is loaded: dlopen returns that handle,
    # so the answers below describe the instance the op calls.
    ob = _openblas()
    return ctypes.CDLL(os.path.join(ob.get_lib_dir(), f"lib{ob.get_library()}.so"))


def blas_info() -> dict:
    """Which kernels and how many threads the loaded OpenBLAS uses, and the env that chose them; and
    `tiles`, the instruction set of the packed/block dense layers' own tiles (FD_CPU_LINEAR_ISA caps it)."""
    import paddle

    tiles = load_library(GEMM_OPS).linear_tiles_isa(paddle.zeros([1]))
    lib = _library()
    prefix = "scipy_openblas_"
    getattr(lib, prefix + "get_corename").restype = ctypes.c_char_p
    getattr(lib, prefix + "get_config").restype = ctypes.c_char_p
    return {
        "corename": getattr(lib, prefix + "get_corename")().decode(),
        "threads": int(getattr(lib, prefix + "get_num_threads")()),
        "config": getattr(lib, prefix + "get_config")().decode(),
        "tiles": ("avx512", "avx2", "generic")[int(tiles.numpy()[0])],
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


@lru_cache(maxsize=None)
def linear_packed():
    """`linear_packed(x [.., K], packed, n) -> [.., n]`, and `packed_rows(packed, ids, n)`."""
    linear_sgemm()  # one module: loads it and settles the threads
    return load_library(GEMM_OPS).linear_packed


@lru_cache(maxsize=None)
def packed_rows():
    return load_library(GEMM_OPS).packed_rows


@lru_cache(maxsize=None)
def linear_blocks():
    """`linear_blocks(x [.., K], q, scale, offset | None, n, group, one_rounding) -> [.., n]` on GGUF
    blocks packed by gguf_blocks.pack (`one_rounding`: its PackedBlocks.one_rounding), and `block_rows(q, scale, offset | None, ids, n, group)`."""
    linear_sgemm()
    return load_library(GEMM_OPS).linear_blocks


@lru_cache(maxsize=None)
def linear_blocks_int8():
    """`linear_blocks_int8(x [.., K], q, scale, offset | None, n) -> [.., n]` on blocks packed by
    gguf_blocks.pack_int8: activations quantized to int8 per block of 32 (FD_CPU_INT8_ACTIVATIONS)."""
    linear_sgemm()
    return load_library(GEMM_OPS).linear_blocks_int8


@lru_cache(maxsize=None)
def decoder_block_ops() -> tuple:
    """(norm_qkv_blocks, mlp_blocks): a decoder layer's dense work on GGUF blocks in two calls
    (custom_ops/cpu_ops/decoder_block_ops.cc), the bits of the op-by-op path."""
    linear_sgemm()
    lib = load_library(GEMM_OPS)
    return lib.norm_qkv_blocks, lib.mlp_blocks


@lru_cache(maxsize=None)
def decoder_stack_ops() -> tuple:
    """(decoder_stack_bind, decoder_stack_forward, decoder_stack_release): every decoder layer of a
    step in one op call (custom_ops/cpu_ops/decoder_stack.cc), the bits of the per-layer calls."""
    linear_sgemm()
    lib = load_library(GEMM_OPS)
    return lib.decoder_stack_bind, lib.decoder_stack_forward, lib.decoder_stack_release


@lru_cache(maxsize=None)
def block_rows():
    return load_library(GEMM_OPS).block_rows
