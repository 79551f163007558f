"""Synthetic serving workloads: arrival times and (input, output) lengths, reproducible from a seed.

Arrivals follow benchmark_serving: a Poisson process of `request_rate` requests/s, or every
request at t = 0 when the rate is infinite (a burst). Lengths are fixed, or drawn uniformly from
[len * (1 - range_ratio), len * (1 + range_ratio)] like the random dataset of benchmark_serving.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class SimRequest:
    index: int
    arrival: float
    input_len: int
    output_len: int


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    input_len: int
    output_len: int
    request_rate: float = math.inf
    range_ratio: float = 0.0  # 0: fixed lengths
    seed: int = 0

    def __post_init__(self):
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("num_prompts, input_len and output_len must be >= 1")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf for a burst), got {self.request_rate}")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")

    @property
    def fixed_lengths(self) -> bool:
        return self.range_ratio == 0

    def requests(self) -> list:
        """The whole request stream; a prefix of a longer stream with the same seed is identical."""
        arrivals_rng = random.Random(self.seed)
        lengths_rng = random.Random(self.seed + 1)
        t = 0.0
        out = []
        for i in range(self.num_prompts):
            if i and not math.isinf(self.request_rate):
                t += arrivals_rng.expovariate(self.request_rate)
            out.append(SimRequest(i, t, self._length(lengths_rng, self.input_len),
                                  self._length(lengths_rng, self.output_len)))
        return out

    def _length(self, rng: random.Random, mean: int) -> int:
        if self.fixed_lengths:
            return mean
        lo = max(1, int(mean * (1 - self.range_ratio)))
        hi = max(lo, int(mean * (1 + self.range_ratio)))
        return rng.randint(lo, hi)
