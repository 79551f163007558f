"""Tensor-parallel step time: each rank runs 1/N of every layer on its own GPU, then all-reduces.

Rank r holds 1/N of the query and KV heads (whole KV-head groups), of the MLP / expert / shared
widths and of the vocabulary (the engine's sharding, fastdeploy/model_executor/tensor_parallel.py);
the MoE router is replicated. A step lasts as long as its slowest rank (the one whose KV heads read
the most keys: the rank with the fewest SWA heads), plus two ring all-reduces of the step's
activations per layer and one for the vocab-parallel embedding.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from .hardware import Hardware
from .step_model import ModelShape, StepCost, StepModel

# One direction of a GPU's NVLink, bytes/s (A800: NVLink capped at 400 GB/s bidirectional).
LINK_BYTES_PER_S = {"A800-80GB": 200e9, "H100-SXM": 450e9, "H200": 450e9}
DEFAULT_LINK_BYTES_PER_S = 200e9
ALL_REDUCE_LATENCY_S = 10e-6  # per collective: launch and synchronisation


def rank_shape(shape: ModelShape, tp: int) -> ModelShape:
    """The parameter shape one rank multiplies through."""
    for name, value in (("num_kv_heads", shape.num_kv_heads), ("dense_intermediate", shape.dense_intermediate),
                        ("expert_intermediate", shape.expert_intermediate)):
        if value % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={value}")
    return dataclasses.replace(
        shape, num_q_heads=shape.num_q_heads // tp, num_kv_heads=shape.num_kv_heads // tp,
        vocab=-(-shape.vocab // tp), dense_intermediate=shape.dense_intermediate // tp,
        expert_intermediate=shape.expert_intermediate // tp, shared_intermediate=shape.shared_intermediate // tp)


class TensorParallelStepModel:
    """Same interface as StepModel (`cost`, `step_time`) for N ranks with their SWA-head counts."""

    def __init__(self, shape: ModelShape, hardware: Hardware, overhead_s: float, swa_heads_per_rank: list,
                 window: int, sink: int, dtype_bytes: int, link_bytes_per_s: float = None):
        self.tp = len(swa_heads_per_rank)
        self.shape, self.overhead_s, self.dtype_bytes = shape, overhead_s, dtype_bytes
        per_rank = rank_shape(shape, self.tp)
        self.ranks = [StepModel(per_rank, hardware, 0.0, n, window, sink, dtype_bytes) for n in swa_heads_per_rank]
        self.link = link_bytes_per_s or LINK_BYTES_PER_S.get(hardware.name.split(" ")[0], DEFAULT_LINK_BYTES_PER_S)

    def all_reduce_seconds(self, num_tokens: int) -> float:
        ops = 2 * self.shape.num_layers + 1
        nbytes = num_tokens * self.shape.hidden * self.dtype_bytes
        return ops * (ALL_REDUCE_LATENCY_S + 2 * (self.tp - 1) / self.tp * nbytes / self.link)

    def cost(self, chunks: Iterable[tuple]) -> StepCost:
        chunks = list(chunks)
        tokens = sum(count for _, count, _ in chunks)
        if tokens == 0:
            return StepCost(0.0, 0.0, 0.0)
        costs = [rank.cost(chunks) for rank in self.ranks]
        slowest = max(costs, key=lambda c: c.seconds)
        return StepCost(sum(c.flops for c in costs), sum(c.bytes for c in costs),
                        slowest.seconds + self.all_reduce_seconds(tokens) + self.overhead_s)

    def step_time(self, chunks: Iterable[tuple]) -> float:
        return self.cost(chunks).seconds
