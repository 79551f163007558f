"""Roofline step-time model: how long one engine step takes on a given model and accelerator.

    step time = max(FLOPs / peak FLOP/s, bytes / HBM bandwidth) + fixed per-step overhead

Bytes are what must cross HBM once per step: the weights the batch touches (every dense weight,
plus, for MoE layers, the expected number of *distinct* routed experts the batch's tokens select),
the KV each head actually reads, and the KV the step writes. FLOPs are 2 x active parameters per
token plus attention (4 x head_dim per query-key pair per query head).

Which keys a SWA head reads is a property of the attention kernel, modelled two ways (in *both*
A/B arms alike; recycling changes only how long dead pages stay allocated):
- "skip" (our head-wise kernels): a SWA head loads and attends only its sink and window keys;
- "masked" (upstream's 1-D kernel, and the Hackathon submission's PR1, which kept the 1-D table):
  every head loads and computes every key in [0, t] and masks the ones outside the window, so a
  SWA head costs what a full head costs.

Activations, norms, rotary and sampling are left out: at these shapes they are a few percent of
the weight and KV traffic, and the overhead term absorbs what a calibration finds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from .hardware import Hardware

BF16_BYTES = 2
ATTENTION_READS = ("skip", "masked")


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts of a decoder-only (optionally MoE) transformer, from its config.json."""

    num_layers: int
    hidden: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    tie_word_embeddings: bool
    dense_mlp_layers: int
    dense_intermediate: int
    moe_layers: int
    num_experts: int
    experts_per_token: int
    expert_intermediate: int
    shared_intermediate: int

    @classmethod
    def from_config(cls, raw: dict) -> "ModelShape":
        layers = int(raw["num_hidden_layers"])
        hidden = int(raw["hidden_size"])
        q_heads = int(raw["num_attention_heads"])
        experts = int(raw.get("moe_num_experts") or raw.get("num_experts") or 0)
        moe_layers = 0
        if experts:
            # ERNIE-4.5 places MoE layers at start, start+interval, ... up to end (inclusive).
            start = int(raw.get("moe_layer_start_index", 0))
            end = int(raw.get("moe_layer_end_index", layers - 1))
            end = layers - 1 if end < 0 else end
            interval = int(raw.get("moe_layer_interval", 1))
            moe_layers = len(range(start, end + 1, interval))
        moe_inter = int(raw.get("moe_intermediate_size", 0))
        return cls(
            num_layers=layers,
            hidden=hidden,
            num_q_heads=q_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or q_heads),
            head_dim=int(raw.get("head_dim") or hidden // q_heads),
            vocab=int(raw["vocab_size"]),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            dense_mlp_layers=layers - moe_layers,
            dense_intermediate=int(raw.get("intermediate_size", 4 * hidden)),
            moe_layers=moe_layers,
            num_experts=experts,
            experts_per_token=int(raw.get("moe_k") or raw.get("num_experts_per_tok") or 0),
            expert_intermediate=moe_inter,
            shared_intermediate=moe_inter * int(raw.get("moe_num_shared_experts", 0)),
        )

    # -- parameter counts (weights only; norms are negligible) -----------------------------------
    @property
    def attention_params(self) -> int:
        """q, k, v and o projections of one layer."""
        q = self.num_q_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv)

    @property
    def expert_params(self) -> int:
        """One routed expert: SwiGLU gate, up and down projections."""
        return 3 * self.hidden * self.expert_intermediate

    @property
    def always_read_params(self) -> int:
        """Weights every non-empty step reads: all but the routed experts and the LM head."""
        moe_fixed = 3 * self.hidden * self.shared_intermediate + self.hidden * self.num_experts  # + router
        return (self.num_layers * self.attention_params
                + self.dense_mlp_layers * 3 * self.hidden * self.dense_intermediate
                + self.moe_layers * moe_fixed)

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        embeddings = self.lm_head_params * (1 if self.tie_word_embeddings else 2)
        return (self.always_read_params + self.moe_layers * self.num_experts * self.expert_params
                + embeddings)

    @property
    def active_params_per_token(self) -> int:
        """Parameters one token multiplies through, LM head excluded (only sampled tokens pay it)."""
        return self.always_read_params + self.moe_layers * self.experts_per_token * self.expert_params

    def expected_distinct_experts(self, num_tokens: int) -> float:
        """Routed experts a layer must load for `num_tokens` tokens, if routing were uniform.

        Each token picks k of E experts; an expert escapes one token with probability 1 - k/E, so
        E * (1 - (1 - k/E)^T) are touched. Real routing is skewed, which loads fewer.
        """
        if not self.num_experts or num_tokens <= 0:
            return 0.0
        miss = 1.0 - self.experts_per_token / self.num_experts
        return self.num_experts * (1.0 - miss ** num_tokens)

    @property
    def weight_bytes(self) -> int:
        return self.total_params * BF16_BYTES


# -- key counting: which keys a query, or a chunk of queries, sees (docs/retention_rule.md) ----
def _sum_min(m: int, cap: int) -> int:
    """sum_{u=1..m} min(u, cap) for m >= 0."""
    if m <= cap:
        return m * (m + 1) // 2
    return cap * (cap + 1) // 2 + (m - cap) * cap


def attended_pairs_prefix(m: int, window: Optional[int], sink: int) -> int:
    """Query-key pairs of queries at positions [0, m).

    Query t sees key j <= t iff (j < sink or j > t - window); a full head (window None) sees all.
    Count for query t: min(t + 1, W) + min(S, max(0, t - W + 1)).
    """
    if window is None:
        return m * (m + 1) // 2
    return _sum_min(m, window) + _sum_min(max(0, m - window), sink)


def attended_pairs(start: int, count: int, window: Optional[int], sink: int) -> int:
    """Query-key pairs of the queries at positions [start, start + count)."""
    return attended_pairs_prefix(start + count, window, sink) - attended_pairs_prefix(start, window, sink)


def keys_read(start: int, count: int, window: Optional[int], sink: int) -> int:
    """Distinct keys any query in [start, start + count) sees: what the kernel must load."""
    end = start + count
    if window is None:
        return end
    first_in_window = max(0, start - window + 1)
    return end - first_in_window + min(sink, first_in_window)


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float
    seconds: float


class StepModel:
    """Per-step time of a batch of (start, num_tokens, samples) chunks on one accelerator."""

    def __init__(self, shape: ModelShape, hardware: Hardware, overhead_s: float, num_swa_heads: int,
                 window: int, sink: int, dtype_bytes: int = BF16_BYTES, attention: str = "skip",
                 num_swa_pairs: Optional[int] = None):
        """`num_swa_heads` KV heads slide in every layer; or, for sliding *layers* (Gemma 3, gpt-oss),
        `num_swa_pairs` (layer, KV head) pairs slide (num_swa_heads is then ignored)."""
        pairs = shape.num_layers * shape.num_kv_heads
        if num_swa_pairs is None:
            if not 0 <= num_swa_heads <= shape.num_kv_heads:
                raise ValueError(f"num_swa_heads={num_swa_heads} must be within 0..{shape.num_kv_heads}")
            num_swa_pairs = num_swa_heads * shape.num_layers
        elif not 0 <= num_swa_pairs <= pairs:
            raise ValueError(f"num_swa_pairs={num_swa_pairs} must be within 0..{pairs}")
        if attention not in ATTENTION_READS:
            raise ValueError(f"attention={attention!r} must be one of {', '.join(ATTENTION_READS)}")
        if overhead_s < 0:
            raise ValueError(f"per-step overhead must be >= 0, got {overhead_s}")
        self.shape, self.hardware, self.overhead_s = shape, hardware, overhead_s
        self.window, self.sink, self.attention = window, sink, attention
        # (layer, KV head) pairs by the keys their kernel reads: a masked kernel reads a SWA pair like a
        # full one. (A head sliding in every layer is num_layers pairs.)
        self.num_swa_pairs = num_swa_pairs if attention == "skip" else 0
        self.num_full_pairs = pairs - self.num_swa_pairs
        # Per token, per (layer, KV head) pair: K and V of head_dim elements.
        self.kv_bytes_per_token_pair = 2 * shape.head_dim * dtype_bytes
        # Per query-key pair, per (layer, KV head) pair, over the query heads that share it:
        # QK^T and PV are 2 * head_dim FLOPs each.
        q_per_kv = shape.num_q_heads // shape.num_kv_heads
        self.flops_per_pair_head = q_per_kv * 4 * shape.head_dim
        # Weights and KV share one dtype: bf16 on the GPUs; float32 for the CPU tiny preset.
        self._always_bytes = shape.always_read_params * dtype_bytes
        self._expert_bytes = shape.moe_layers * shape.expert_params * dtype_bytes
        self._lm_head_bytes = shape.lm_head_params * dtype_bytes
        # Decode steady state: a SWA head past W + S reads exactly W + S keys per step.
        self._swa_steady_from = window + sink - 1

    def cost(self, chunks: Iterable[tuple]) -> StepCost:
        """`chunks`: (start, num_tokens, samples) of every request scheduled this step."""
        window, sink, has_swa, steady = self.window, self.sink, self.num_swa_pairs > 0, self._swa_steady_from
        tokens = sampled = 0
        full_keys = swa_keys = 0  # keys loaded, per head of each kind
        full_pairs = swa_pairs = 0  # query-key pairs of multi-token chunks (a decode's pairs == its keys)
        for start, count, samples in chunks:
            tokens += count
            sampled += samples
            if count == 1:
                full_keys += start + 1
                if has_swa:
                    swa_keys += window + sink if start >= steady else keys_read(start, 1, window, sink)
                continue
            full_keys += start + count
            full_pairs += attended_pairs(start, count, None, 0) - (start + count)
            if has_swa:
                read = keys_read(start, count, window, sink)
                swa_keys += read
                swa_pairs += attended_pairs(start, count, window, sink) - read
        if tokens == 0:
            return StepCost(0.0, 0.0, 0.0)
        # Pairs = keys read + the extra pairs of multi-token chunks (whose queries share keys).
        full_pairs += full_keys
        swa_pairs += swa_keys
        shape = self.shape
        kv_read = (self.num_full_pairs * full_keys + self.num_swa_pairs * swa_keys) * self.kv_bytes_per_token_pair
        kv_written = tokens * shape.num_layers * shape.num_kv_heads * self.kv_bytes_per_token_pair
        weights = (self._always_bytes + self._expert_bytes * shape.expected_distinct_experts(tokens)
                   + (self._lm_head_bytes if sampled else 0))
        nbytes = weights + kv_read + kv_written
        flops = (2.0 * (shape.active_params_per_token * tokens + shape.lm_head_params * sampled)
                 + self.flops_per_pair_head * (self.num_full_pairs * full_pairs + self.num_swa_pairs * swa_pairs))
        busy = max(flops / self.hardware.bf16_flops_per_s, nbytes / self.hardware.hbm_bytes_per_s)
        return StepCost(flops, nbytes, busy + self.overhead_s)

    def step_time(self, chunks: Iterable[tuple]) -> float:
        return self.cost(chunks).seconds
