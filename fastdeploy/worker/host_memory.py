"""Keep freed host memory in the process for the next step instead of handing it back to the kernel.

Paddle's CPU tensors come from the C library's malloc. glibc serves every block above its mmap
threshold (128 KiB at start, adjusting up to 32 MiB) with fresh pages from the kernel and unmaps
them on free, so each large activation of a prefill step, e.g. the [2048, 3072] gate/up output of
SmolLM2 (24 MiB), page-faults its pages in again, zeroed by the kernel, in every layer of every step.
Measured with `benchmarks/bench_linear_cpu.py --rows 2048` on 2 cores: the gate/up GEMM ran at 118
GFLOP/s with 437k page faults and at 177 GFLOP/s with these settings (77k faults for three shapes).

So a CPU worker raises the mmap threshold to glibc's maximum and lets the heap keep up to
`TRIM_THRESHOLD` bytes of free memory: the steady state reuses the same blocks, whatever their size.
FD_CPU_KEEP_FREED_MEMORY=0 leaves malloc as it is (memory goes back to the system sooner).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

from fastdeploy import envs

logger = logging.getLogger("fastdeploy.worker")

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20   # glibc's upper limit on 64-bit
TRIM_THRESHOLD = 512 << 20  # free memory the heap may keep at its top
TOP_PAD = 64 << 20          # extra the heap grows by, so growth is not a system call per step


def keep_freed_host_memory() -> bool:
    """Apply the settings once per process; False where they do not apply (not glibc, or turned off)."""
    if not envs.FD_CPU_KEEP_FREED_MEMORY or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD)))
    if not ok:
        logger.warning("mallopt refused the host-memory settings; large CPU tensors page-fault on every step")
    return ok
