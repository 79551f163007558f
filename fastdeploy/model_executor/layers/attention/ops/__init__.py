"""Attention custom ops: one entry, the CPU op (cpu_op_loader) or the CUDA op (gpu_op_loader) by tensor place."""

from .append_attention import append_attention, validate_append_attention_inputs

__all__ = ["append_attention", "validate_append_attention_inputs"]
