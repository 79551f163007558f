"""The CPU GEMM ops, one module built once by cpu_op_loader:
- `linear_packed` (custom_ops/cpu_ops/linear_packed.cc): weights packed once at load (`pack`),
  what the decoder's layers run; row-invariant by construction, 1-3x Paddle's matmul at decode
  row counts (benchmarks/bench_linear_cpu.py);
- `linear_unpacked` (custom_ops/cpu_ops/linear_unpacked.cc): weights used as they are (MoE experts,
  the router), packed on every call into the same panels and run by the same tiles, so the same
  bits; no BLAS, whose kernels round a row differently by row count on some CPUs (measured on
  OpenBLAS's Zen kernels);
- the GGUF-block products, the norms, the gated activation and the fused decoder ops beside them.
"""

from __future__ import annotations

from functools import lru_cache

from fastdeploy.model_executor.layers.attention.ops.cpu_op_loader import CpuOpLibrary, load_library

GEMM_OPS = CpuOpLibrary("fd_cpu_gemm", ("linear_packed.cc", "linear_unpacked.cc", "linear_blocks.cc",
                                        "linear_blocks_int8.cc", "rms_norm.cc", "gated_activation.cc",
                                        "decoder_block_ops.cc", "decoder_stack.cc", "machine_limits.cc"),
                        "the CPU dense-layer ops (packed GEMM, unpacked GEMM, GGUF-block GEMM exact and with "
                        "int8 activations, RMSNorm, gated activation, a decoder layer's dense work fused, the "
                        "whole decoder stack in one call)",
                        dir_prefix="gemm-")


@lru_cache(maxsize=None)
def _ops():
    return load_library(GEMM_OPS)


def build_dense_ops() -> None:
    """Compile (on first use) and load the dense-layer ops now, while the engine is being built: a server
    that says it is ready must not make its first request wait a minute for the compiler."""
    _ops()


def rms_norm_rows():
    """The op: `rms_norm_rows(x [.., D] float32, weight [D] float32, eps) -> [.., D]`, row-invariant."""
    return _ops().rms_norm_rows


def add_rms_norm_rows():
    """The op: `add_rms_norm_rows(x, delta, weight, eps) -> (x + delta, rms_norm(x + delta))`, float32."""
    return _ops().add_rms_norm_rows


def gated_activation_rows():
    """The op: `gated_activation(x [.., 2F] float32, act) -> [.., F]`: act(x[.., :F]) * x[.., F:],
    act 0 = SiLU, 1 = tanh-approximated GELU."""
    return _ops().gated_activation


def linear_unpacked():
    """The op: `linear_unpacked(x [.., K] float32, w [N, K] float32) -> [.., N]`, x . w^T."""
    return _ops().linear_unpacked


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
    return _ops().linear_packed


def packed_rows():
    return _ops().packed_rows


def linear_blocks():
    """`linear_blocks(x [.., K], q, scale, offset | None, n, group, one_rounding) -> [.., n]` on GGUF
    blocks packed by gguf_blocks.pack (`one_rounding`: its PackedBlocks.one_rounding), and `block_rows(q, scale, offset | None, ids, n, group)`."""
    return _ops().linear_blocks


def linear_blocks_int8():
    """`linear_blocks_int8(x [.., K], q, scale, offset | None, n) -> [.., n]` on blocks packed by
    gguf_blocks.pack_int8: activations quantized to int8 per block of 32 (FD_CPU_INT8_ACTIVATIONS)."""
    return _ops().linear_blocks_int8


def decoder_block_ops() -> tuple:
    """(norm_qkv_blocks, mlp_blocks): a decoder layer's dense work on GGUF blocks in two calls
    (custom_ops/cpu_ops/decoder_block_ops.cc), the bits of the op-by-op path."""
    lib = _ops()
    return lib.norm_qkv_blocks, lib.mlp_blocks


def decoder_stack_ops() -> tuple:
    """(decoder_stack_bind, decoder_stack_forward, decoder_stack_release): every decoder layer of a
    step in one op call (custom_ops/cpu_ops/decoder_stack.cc), the bits of the per-layer calls."""
    lib = _ops()
    return lib.decoder_stack_bind, lib.decoder_stack_forward, lib.decoder_stack_release


def block_rows():
    return _ops().block_rows
