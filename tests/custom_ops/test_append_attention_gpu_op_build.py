"""The Paddle op wrapper (custom_ops/gpu_ops/append_attention.cu) compiles against this Paddle's own
headers as a CUDA build of Paddle compiles it, and links with the kernels.

Where nvcc exists (CI has it, no GPU needed). The flags are exactly the JIT loader's (gpu_op_loader:
sources, include dirs, sm_80 + sm_90, PADDLE_NO_PYTHON) plus Paddle's own CUDA defines
(`COMMON_NVCC_FLAGS`: PADDLE_WITH_CUDA, which turns on `paddle::Tensor::stream()` and the GPU
places). Without PADDLE_NO_PYTHON, `paddle/extension.h` would pull Paddle's Python bindings, whose
ATen shim needs cublasXt.h and cudnn.h, which CI's toolkit (and many GPU machines') lacks; the op
uses no binding, so the production build leaves them out too and this check compiles what ships.
Linking with the CPU libpaddle is impossible (no GPU symbols), so the link check is the C ABI
between the wrapper and the kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import gpu_harness  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(gpu_harness.find_nvcc() is None, reason="nvcc not found")]


def _paddle_cuda_compile_command(nvcc: str, out) -> list[str]:
    from paddle.utils.cpp_extension import extension_utils

    from fastdeploy.model_executor.layers.attention.ops import gpu_op_loader

    wrapper = gpu_op_loader.gpu_sources()[0]
    includes = [*map(str, gpu_op_loader.include_dirs()), *extension_utils.find_paddle_includes(use_cuda=False),
                sysconfig.get_paths()["include"]]
    return [nvcc, *extension_utils.COMMON_NVCC_FLAGS, *gpu_op_loader.NVCC_FLAGS,
            "-Xcompiler", "-fPIC", *(f"-I{d}" for d in includes), "-c", str(wrapper), "-o", str(out)]


def _symbols(path, *nm_args) -> set[str]:
    listed = subprocess.run(["nm", *nm_args, str(path)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in listed.splitlines() if line.strip()}


@pytest.fixture(scope="module")
def wrapper_object(tmp_path_factory):
    out = tmp_path_factory.mktemp("append_attention_op") / "append_attention.o"
    cmd = _paddle_cuda_compile_command(gpu_harness.find_nvcc(), out)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 0, "nvcc failed on the Paddle op wrapper:\n" + "\n".join(errors or [proc.stderr[-4000:]])
    return out


def test_the_paddle_op_wrapper_compiles_for_sm80_and_sm90_with_paddles_cuda_defines(wrapper_object):
    needed = _symbols(wrapper_object, "-u")
    # The GPU-only part of Paddle's tensor API is really compiled in (PADDLE_WITH_CUDA took effect).
    assert any("Tensor6stream" in s for s in needed)
    assert {"append_attention_launch", "append_attention_workspace_bytes",
            "append_attention_last_error"} <= needed


def test_the_wrapper_and_the_kernels_link_with_every_launcher_symbol_resolved(wrapper_object, tmp_path):
    kernels = gpu_harness.cached_build(jobs=2).parent  # the harness build keeps each kernel's object
    objects = [kernels / (p.stem + ".o") for p in gpu_harness.cuda_sources() if p.name != "harness.cu"]
    library = tmp_path / "fastdeploy_ops_gpu.so"
    subprocess.run([gpu_harness.find_nvcc(), "-shared", "-o", str(library), str(wrapper_object), *map(str, objects)],
                   capture_output=True, text=True, check=True)
    unresolved = {s for s in _symbols(library, "-D", "-u") if "append_attention" in s or "append_attn" in s}
    assert unresolved == set()
    assert "append_attention_launch" in _symbols(library, "-D", "--defined-only")
