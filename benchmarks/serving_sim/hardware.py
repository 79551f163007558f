"""Accelerator presets: the three numbers the step-time model needs, with where each comes from.

Peak figures are datasheet numbers (dense, i.e. without 2:4 sparsity). The model applies them as a
roofline; real kernels reach a fraction of them, which `bw_efficiency` / `flops_efficiency` (default
1.0) and the per-step overhead of the step model absorb.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024 ** 3


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes_per_s: float
    bf16_flops_per_s: float  # dense tensor-core peak
    memory_bytes: int

    def scaled(self, bw_efficiency: float = 1.0, flops_efficiency: float = 1.0) -> "Hardware":
        """The same device as seen by kernels that reach the given fraction of peak."""
        if not 0 < bw_efficiency <= 1 or not 0 < flops_efficiency <= 1:
            raise ValueError("efficiencies must be in (0, 1]")
        return Hardware(self.name, self.hbm_bytes_per_s * bw_efficiency,
                        self.bf16_flops_per_s * flops_efficiency, self.memory_bytes)


PRESETS = {
    # A800-80GB SXM is the A100-80GB SXM with NVLink cut to 400 GB/s; HBM and tensor cores are the
    # A100's. NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): 80 GB
    # HBM2e at 2,039 GB/s, BF16 tensor core 312 TFLOPS dense (624 with sparsity).
    "A800-80GB": Hardware("A800-80GB", 2039e9, 312e12, 80 * GIB),
    # NVIDIA H100 datasheet, SXM5 column: 80 GB HBM3 at 3.35 TB/s; BF16 tensor core 1,979 TFLOPS
    # "with sparsity", i.e. 989 TFLOPS dense.
    "H100-SXM": Hardware("H100-SXM", 3.35e12, 989e12, 80 * GIB),
    # NVIDIA H200 datasheet (SXM): 141 GB HBM3e at 4.8 TB/s; same GH100 compute as the H100 SXM
    # (BF16 1,979 TFLOPS with sparsity -> 989 dense). "141 GB" is taken as GiB: the driver reports
    # about 140 GiB, close enough that the utilization factor dominates the difference.
    "H200": Hardware("H200", 4.8e12, 989e12, 141 * GIB),
}


def get_hardware(name: str) -> Hardware:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(PRESETS)}") from None
