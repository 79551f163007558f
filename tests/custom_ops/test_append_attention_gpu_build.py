"""CI compile check of the CUDA AppendAttention kernels (runs wherever nvcc is, GPU or not).

Every .cu under custom_ops/gpu_ops/append_attn/ is compiled on its own for sm_80 and sm_90 (a
compile error fails here), the objects are linked into the ctypes harness, and the launcher's
host-side argument checks are exercised through the C ABI without touching a device.
"""

from __future__ import annotations

import ctypes
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import gpu_harness  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(gpu_harness.find_nvcc() is None, reason="nvcc not found")]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    result = gpu_harness.build(tmp_path_factory.mktemp("append_attn_build"), jobs=2)
    per_file = ", ".join(f"{k} {v:.1f}s" for k, v in sorted(result.compile_seconds.items()))
    print(f"\nappend_attn build: {result.wall_seconds:.1f}s wall (2 jobs); {per_file}")
    return result


def _valid_params(**changes) -> dict[str, int]:
    params = dict(
        dtype=gpu_harness.BF16,
        token_num=8,
        bsz=2,
        num_heads=20,
        kv_num_heads=4,
        head_dim=128,
        block_size=64,
        num_blocks=16,
        max_blocks_per_seq=8,
        head_wise_table=1,
        max_position=512,
        visit_all_pages=0,
        dual_pass=0,
    )
    params.update(changes)
    return params


def test_every_cuda_source_compiles_for_sm80_and_sm90_and_links_the_harness(built):
    assert set(built.compile_seconds) == {p.name for p in gpu_harness.cuda_sources()}
    lib = ctypes.CDLL(str(built.library))
    for symbol in (
        "append_attention_launch",
        "append_attention_workspace_bytes",
        "append_attention_last_error",
        "append_attention_describe_error",
        "aa_run",
        "aa_device_count",
        "aa_copy_bandwidth_gbps",
    ):
        assert hasattr(lib, symbol), symbol


def test_kernel_folder_is_free_of_paddle_headers():
    for path in gpu_harness.SOURCE_DIR.glob("*.cu*"):
        assert "paddle/" not in path.read_text(), path.name


def _launch_status(lib, params):
    lib.append_attention_launch.restype = ctypes.c_int
    lib.append_attention_last_error.restype = ctypes.c_char_p
    p = gpu_harness._Params(**params)
    buffers = gpu_harness._Buffers()
    info = (ctypes.c_int * 4)()
    status = lib.append_attention_launch(
        ctypes.byref(p), ctypes.byref(buffers), None, ctypes.c_size_t(0), info, None
    )
    return status, lib.append_attention_last_error().decode()


@pytest.mark.parametrize(
    "changes, fragment",
    [
        (dict(head_dim=96), "head_dim 96"),
        (dict(block_size=32), "block_size 32"),
        (dict(num_heads=36, kv_num_heads=4), "group size"),
        (dict(num_heads=21), "group size"),
        (dict(dtype=7), "dtype"),
        (dict(cache_quant=5), "cache_quant 5 unknown (0 float, 1 int8, 2 e4m3, 3 int4, 4 k8v4)"),
        (dict(cache_quant=gpu_harness.CACHE_INT4, dtype=gpu_harness.FP16), "need dtype bf16"),
        (dict(cache_quant=gpu_harness.CACHE_K8V4, dtype=gpu_harness.FP16), "need dtype bf16"),
        (dict(dual_pass=2), "dual_pass 2 must be 0 or 1"),
    ],
)
def test_launcher_rejects_unsupported_shapes_before_touching_the_device(built, changes, fragment):
    lib = ctypes.CDLL(str(built.library))
    status, message = _launch_status(lib, _valid_params(**changes))
    assert status == 1  # APPEND_ATTN_INVALID_ARGUMENT
    assert fragment in message


def test_launcher_requires_the_advertised_workspace(built):
    harness = gpu_harness.Harness(built.library)
    params = _valid_params()
    single = harness.workspace_bytes(params)
    assert single > 0
    assert harness.workspace_bytes(_valid_params(dual_pass=1)) > single  # stitch buffer
    assert harness.workspace_bytes(_valid_params(head_dim=96)) == 0
    assert harness.workspace_bytes(_valid_params(head_dim=256, num_heads=4, kv_num_heads=1)) > 0  # Gemma 3
    status, message = _launch_status(ctypes.CDLL(str(built.library)), params)
    assert status == 1 and "workspace" in message


def test_harness_reports_a_missing_gpu_instead_of_crashing(built):
    harness = gpu_harness.Harness(built.library)
    if gpu_harness.driver_gpu_count() > 0:
        assert harness.device_count() > 0
        pytest.skip("a GPU is visible; the no-GPU path is not reachable here")
    assert harness.device_count() <= 0
    import numpy as np

    from gpu_reference import build_case

    result = harness.run(build_case(np.random.default_rng(0), [(0, 4), (20, 1)]))
    assert result.status == 3 and result.message
    assert result.out is None
