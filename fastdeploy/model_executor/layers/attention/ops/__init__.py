"""Attention custom ops: one entry, the CPU op (cpu_op_loader) or the CUDA op (gpu_op_loader) by tensor place."""

from .append_attention import append_attention

__all__ = ["append_attention"]
