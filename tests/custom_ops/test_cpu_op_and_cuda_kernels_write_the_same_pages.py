"""The CPU op and the CUDA kernels (on the CUDA-on-CPU executor) given the same step on quantized pages
write the same bytes: codes and scales bit for bit (one rule, custom_ops/cpu_ops/kv_quant.h, the same
float32 RoPE), and their outputs agree to bf16 rounding. The step's q, k and v are bfloat16, what the
CUDA kernels take, so both quantize the same rows."""

from __future__ import annotations

import os
import sys

import numpy as np
import paddle
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import gpu_harness  # noqa: E402
from gpu_harness import BF16, from_storage  # noqa: E402
from gpu_reference import MIXED_HEAD_WINDOWS, build_case, quantize_case  # noqa: E402
from reference_kv_quant import lane_format  # noqa: E402

from fastdeploy.model_executor.layers.attention.ops import append_attention  # noqa: E402

pytestmark = pytest.mark.skipif(gpu_harness.find_cuda_include() is None,
                                reason="the CUDA toolkit's headers are needed to build the kernels for the CPU")

# The cache dtype each lane format's codes travel in to the CPU op (int4: two codes per uint8).
PADDLE_CODES = {"int8": paddle.int8, "block_wise_int4": paddle.uint8}
FORMATS = ["int8", "block_wise_int4", "k8v4"]  # k8v4: int8 keys beside int4 values


@pytest.fixture(scope="module")
def executor():
    return gpu_harness.Harness(gpu_harness.cached_build(on_cpu=True))


def cpu_op(case, fmt):
    """The CPU op on the quantized case: (output bf16 bits, key codes, key scales, value codes, value scales)."""
    p = case.params
    codes = {n: paddle.to_tensor(np.ascontiguousarray(getattr(case, n)).view(np.uint8)).view(
        PADDLE_CODES[lane_format(fmt, keys=n == "key_cache")]) for n in ("key_cache", "value_cache")}
    scales = {n: paddle.to_tensor(getattr(case, n).copy()) for n in ("key_cache_scales", "value_cache_scales")}
    qkv = paddle.to_tensor(from_storage(case.qkv, BF16)).astype(paddle.bfloat16)  # exact: bf16 values
    ints = {n: paddle.to_tensor(getattr(case, n).astype(np.int32)) for n in (
        "seq_lens_encoder", "seq_lens_decoder", "seq_lens_this_time", "cu_seqlens_q", "block_tables", "head_windows")}
    out = append_attention(qkv, codes["key_cache"], codes["value_cache"], ints["seq_lens_encoder"],
                           ints["seq_lens_decoder"], ints["seq_lens_this_time"], ints["cu_seqlens_q"],
                           ints["block_tables"], paddle.to_tensor(case.rotary_cos), paddle.to_tensor(case.rotary_sin),
                           ints["head_windows"], key_cache_scales=scales["key_cache_scales"],
                           value_cache_scales=scales["value_cache_scales"], num_heads=p["num_heads"],
                           kv_num_heads=p["kv_num_heads"], head_dim=p["head_dim"])
    assert out.dtype == paddle.bfloat16
    return (out.view(paddle.uint16).numpy(), codes["key_cache"].numpy().view(np.uint8), scales["key_cache_scales"].numpy(),
            codes["value_cache"].numpy().view(np.uint8), scales["value_cache_scales"].numpy())


def assert_same_step(executor, case, fmt):
    """The CUDA kernels (executor) and the CPU op on the same quantized step: the same bytes written, finite
    outputs that agree to bf16 rounding."""
    gpu = executor.run(case)
    assert gpu.status == 0 and not gpu.races, (gpu.message, gpu.races)
    out_bits, k_codes, k_scales, v_codes, v_scales = cpu_op(case, fmt)
    for name, ours, theirs in (("key codes", gpu.key_cache.view(np.uint8), k_codes),
                               ("key scales", gpu.key_cache_scales, k_scales),
                               ("value codes", gpu.value_cache.view(np.uint8), v_codes),
                               ("value scales", gpu.value_cache_scales, v_scales)):
        np.testing.assert_array_equal(ours.reshape(theirs.shape), theirs, err_msg=f"{fmt} {name}")
    got = from_storage(gpu.out, BF16).astype(np.float64)
    want = from_storage(out_bits.reshape(gpu.out.shape), BF16).astype(np.float64)
    assert np.isfinite(want).all() and np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("requests, head_dim, block_size", [
    ([(0, 40), (300, 1), (129, 3), (90, 17)], 64, 16),  # prefill, decode, verification rows, a chunk
    ([(0, 20), (700, 1)], 256, 64),                    # Gemma 3's head_dim
])
def test_the_cpu_op_and_the_cuda_kernels_write_the_same_quantized_pages(executor, fmt, requests, head_dim, block_size):
    rng = np.random.default_rng(11)
    case = quantize_case(build_case(rng, requests, num_heads=8, kv_num_heads=2, head_dim=head_dim,
                                    block_size=block_size, window=40, sink=5), fmt)
    assert_same_step(executor, case, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_heads_own_window_gives_the_cpu_op_and_the_cuda_kernels_the_same_step(executor, fmt):
    """head_windows [2, kv_heads]: a full head and three sliding types, each head's own dead pages -1
    (NaN behind them): both devices write the same bytes, and their outputs agree to bf16 rounding."""
    rng = np.random.default_rng(12)
    case = quantize_case(build_case(rng, [(0, 40), (300, 1), (129, 3), (90, 17)], num_heads=8, kv_num_heads=4,
                                    head_dim=64, block_size=16, head_windows=MIXED_HEAD_WINDOWS), fmt)
    assert case.head_windows.shape == (2, 4) and (case.block_tables[1, 2] == -1).any()
    assert_same_step(executor, case, fmt)
