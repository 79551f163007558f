"""Builds the CUDA custom ops (append_attention_gpu) with Paddle's CUDAExtension.

    python custom_ops/setup_ops.py install

Only a CUDA build of Paddle can compile them; with a CPU Paddle this prints that it is skipping
and exits 0 (the CPU op is built on first use by the attention backend instead). The kernels
themselves are compile-checked by tests/custom_ops/test_append_attention_gpu_build.py wherever
nvcc exists, Paddle or not.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GPU_OPS = HERE / "gpu_ops"
# The test harness is ctypes-only; it is not part of the Paddle op.
KERNEL_SOURCES = sorted(p for p in (GPU_OPS / "append_attn").glob("*.cu") if p.name != "harness.cu")
# cpu_ops/ holds append_attention_checks.h, the input checks shared with the CPU op.
INCLUDE_DIRS = [GPU_OPS, HERE / "cpu_ops"]
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


def main() -> int:
    try:
        import paddle
    except ImportError:
        print("setup_ops: paddle is not installed; skipping the CUDA custom ops")
        return 0
    if not paddle.is_compiled_with_cuda():
        print("setup_ops: this Paddle has no CUDA; skipping the CUDA custom ops")
        return 0

    from paddle.utils.cpp_extension import CUDAExtension, setup

    setup(
        name="fastdeploy_ops_gpu",
        ext_modules=CUDAExtension(
            sources=[str(GPU_OPS / "append_attention.cu"), *map(str, KERNEL_SOURCES)],
            include_dirs=[str(d) for d in INCLUDE_DIRS],
            extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": NVCC_FLAGS},
        ),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
