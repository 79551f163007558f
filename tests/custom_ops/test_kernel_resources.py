"""What ptxas says about every CUDA AppendAttention kernel instantiation on sm_80 and sm_90 (runs where
nvcc is, GPU or not; tests/custom_ops/kernel_resources.py prints the same report): the decode path does not
spill, and each kernel's shared memory fits its architecture's per-block limit."""

from __future__ import annotations

import ctypes

import pytest

import kernel_resources  # noqa: E402  (this directory: the resource report of every kernel)
from kernel_resources import ARCH_LIMITS, gpu_harness, occupancy  # noqa: E402

needs_nvcc = pytest.mark.skipif(gpu_harness.find_nvcc() is None,
                                reason="nvcc not found: the resource report needs ptxas's --resource-usage")


@pytest.fixture(scope="module")
def report():
    return kernel_resources.collect(jobs=2)


def _rows(report, kernel):
    return [r for r in report["kernels"] if r["kernel"] == kernel]


@needs_nvcc
def test_every_attention_instantiation_is_reported_on_both_architectures_head_dim_256_included(report):
    for kernel in ("decode_attention_kernel", "prefill_attention_kernel"):
        by_arch = {arch: {r["name"] for r in _rows(report, kernel) if r["arch"] == arch} for arch in ARCH_LIMITS}
        assert by_arch["sm_80"] == by_arch["sm_90"]
        # 2 float page dtypes + int8 + e4m3 + int4 + k8v4 pages, head_dim 64 / 128 / 256, block 16 / 64
        assert len(by_arch["sm_90"]) == 6 * 3 * 2, sorted(by_arch["sm_90"])
        assert sum(", 256, " in name for name in by_arch["sm_90"]) == 6 * 2
    assert {r["kernel"] for r in report["kernels"]} == set(kernel_resources.KERNEL_IDS)


@needs_nvcc
def test_the_decode_path_does_not_spill_registers(report):
    decode = [r for r in report["kernels"] if r["decode_path"]]
    assert decode
    spilling = [(r["arch"], r["name"], r["spill_store_bytes"], r["spill_load_bytes"]) for r in decode
                if r["spill_store_bytes"] or r["spill_load_bytes"]]
    assert not spilling


@needs_nvcc
def test_shared_memory_per_block_fits_each_architecture(report):
    for r in report["kernels"]:
        lim = ARCH_LIMITS[r["arch"]]
        assert r["static_smem_bytes"] <= lim["static_smem_per_block"], r["name"]
        assert r["smem_per_block"] <= lim["smem_per_block"], (r["arch"], r["name"], r["shape"], r["smem_per_block"])
        assert r["blocks_per_sm"] >= 1, (r["arch"], r["name"], r["shape"])


@needs_nvcc
def test_the_dynamic_shared_memory_is_what_the_launches_pass(report):
    prefill = {r["name"]: r["dynamic_smem_bytes"] for r in _rows(report, "prefill_attention_kernel")}
    hd128_bf16 = [v for n, v in prefill.items() if "FloatPages<__nv_bfloat16>, 128, 64" in n]
    assert hd128_bf16 == [84480]  # q, scores, K, V tiles of 64 rows x 128 dims (PrefillSmem)
    assert all(v > 0 for v in prefill.values())
    for r in report["kernels"]:
        if r["kernel"] not in ("prefill_attention_kernel", "rope_write_quantized_kernel"):
            assert r["dynamic_smem_bytes"] == 0, r["name"]
    lib = gpu_harness.bind(ctypes.CDLL(str(gpu_harness.cached_build(jobs=2))), gpu_harness.C_ABI)
    unsupported = gpu_harness._Params(dtype=gpu_harness.BF16, token_num=1, bsz=1, num_heads=4, kv_num_heads=1,
                                      head_dim=96, block_size=64, num_blocks=1, max_blocks_per_seq=1,
                                      head_wise_table=1, max_position=1)
    assert lib.append_attention_dynamic_smem_bytes(ctypes.byref(unsupported), 2) == 0


def test_occupancy_follows_the_calculators_register_and_shared_memory_rules():
    # 128 registers x 32 lanes = 4096 per warp; 16384 per sub-partition -> 4 warps each, 16 per SM
    assert occupancy("sm_80", 128, 128, 0)["blocks_per_sm"] == 4
    # 166 registers round up to 5376 per warp: 3 warps per sub-partition, 12 per SM
    assert occupancy("sm_90", 166, 128, 0)["warps_per_sm"] == 12
    # 84480 B + 1 KB reserved per block: one block in sm_80's 164 KB, two in sm_90's 228 KB
    assert occupancy("sm_80", 64, 256, 84480)["blocks_per_sm"] == 1
    assert occupancy("sm_90", 64, 256, 84480)["blocks_per_sm"] == 2
    # 1024 threads: 2 blocks fill the SM's 64 warps, and 32 registers fit exactly 64 warps too
    assert occupancy("sm_80", 32, 1024, 0) == dict(blocks_per_sm=2, warps_per_sm=64, occupancy=1.0,
                                                    limited_by="threads + registers")
    assert occupancy("sm_80", 32, 128, 164 * 1024)["blocks_per_sm"] == 0  # over the per-block limit
