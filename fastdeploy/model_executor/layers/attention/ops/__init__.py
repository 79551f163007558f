"""Attention custom ops (CPU op built on first use, see cpu_op_loader)."""

from .append_attention import append_attention

__all__ = ["append_attention"]
