"""Which kernels the CPU ops run on this machine, and the machine's memory read bandwidth: what the
start-up log and the benchmarks print beside their numbers.

The ops pick their instruction set once per process (custom_ops/cpu_ops/cpu_isa.h): AVX-512, AVX2 + FMA,
or portable C++, capped by FD_CPU_LINEAR_ISA (`avx2`, `generic`), which also caps the attention op;
FD_CPU_ATTN_ISA=generic puts the attention op alone on its portable kernels. Every choice gives the same
bits, so the tokens do not depend on the machine; only the speed does.
"""

from __future__ import annotations

from functools import lru_cache

ISAS = ("avx512", "avx2", "generic")
INT8_KERNELS = ("avx512-vnni", "avx2", "generic")


def cpu_name() -> str:
    """The CPU's model name and the vector extensions the kernels care about, e.g.
    "AMD EPYC (avx2 fma f16c)" or "Intel Xeon ... (avx512f avx512_vnni avx2 fma f16c)"."""
    name, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name == "unknown CPU":
                    name = " ".join(value.split())
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "avx2", "fma", "f16c")
    return f"{name} ({' '.join(f for f in wanted if f in flags) or 'no AVX2'})"


@lru_cache(maxsize=None)
def kernel_isas() -> dict:
    """{"dense": ..., "int8_activations": ..., "attention": ...}: the instruction set each CPU op family
    runs in this process (dense: the GGUF-block and packed GEMMs, norms and activation)."""
    import paddle

    from fastdeploy import envs
    from fastdeploy.model_executor.layers.attention.ops.cpu_op_loader import load_library
    from fastdeploy.model_executor.layers.blas_gemm import GEMM_OPS

    dense, int8 = (int(v) for v in load_library(GEMM_OPS).cpu_kernel_isas(paddle.zeros([1])).numpy())
    attention = "generic" if envs.FD_CPU_ATTN_ISA.strip().lower() == "generic" else ISAS[dense]
    return {"dense": ISAS[dense], "int8_activations": INT8_KERNELS[int8], "attention": attention}


def describe() -> str:
    """One line: the CPU and the kernels it runs, for logs and benchmark headers."""
    isas = kernel_isas()
    return (f"{cpu_name()}; kernels: dense {isas['dense']}, attention {isas['attention']}, "
            f"int8 activations {isas['int8_activations']}")


def memory_read_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """The machine's memory read bandwidth in GB/s: every usable CPU streaming its share of an `nbytes`
    buffer (default 1 GiB, far past any last-level cache), the best of `repeats` passes."""
    import paddle

    from fastdeploy.model_executor.layers.attention.ops.cpu_op_loader import load_library
    from fastdeploy.model_executor.layers.blas_gemm import GEMM_OPS

    return float(load_library(GEMM_OPS).memory_read_gbs(paddle.zeros([1]), int(nbytes), int(repeats)).numpy()[0])
