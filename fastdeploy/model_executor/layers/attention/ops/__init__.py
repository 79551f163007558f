"""Attention custom ops (CPU op built on first use, see cpu_op_loader)."""

from .append_attention import append_attention, validate_append_attention_inputs

__all__ = ["append_attention", "validate_append_attention_inputs"]
