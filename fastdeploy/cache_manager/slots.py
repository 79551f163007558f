"""Slots and lanes: the generalised page (docs/memory_model.md, "Slots and lanes").

A *slot* is k (layer, KV head) pairs that share one attention type (full, or one window + sink). The
cache is k *lanes*, each a tensor `[num_blocks, G, block_size, head_dim]` (G slots per block); every
layer lives in one lane and its H heads occupy H of that lane's G slots. A page id p names the same
slot position in every lane, `lane[p // G, p % G]` (head_wise.page_location with G for H), so a page
holds `block_size` tokens of all k pairs of its slot, and a request's table has one row per slot.

Layers are assigned to lanes so that every lane holds the same number of pairs of each type (per
tensor-parallel rank); then slot s can have one type in every lane ("every slot is pure") and the
SWA retention rule recycles it as a whole, with its own type's window and sink. k is the largest lane count for which such an assignment
exists. A model whose layers all look alike (today's head-wise presets) gets k = L: a lane per
layer, G = H and slot h = head h, so its pages are exactly those of the per-head layout.

Everything here is pure arithmetic on the per-(layer, KV head) attention type table; the engine asks
only `SlotLayout` where a head's rows are, never how they were chosen.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

logger = logging.getLogger("fastdeploy.cache_manager.slots")

# Search steps the lane partition may take for one lane count before that count is given up
# (the search is exact below it; real models have a handful of distinct layer shapes).
_SEARCH_BUDGET = 200_000


@dataclass(frozen=True, order=True)
class AttentionType:
    """What one (layer, KV head) pair attends: `window` 0 = full attention, else window W >= 1 and
    sink S >= 0 tokens (the rule of docs/retention_rule.md)."""

    window: int = 0
    sink: int = 0

    @property
    def sliding(self) -> bool:
        return self.window > 0

    def __str__(self) -> str:
        return f"window {self.window} + sink {self.sink}" if self.sliding else "full"


FULL = AttentionType()


@dataclass(frozen=True)
class SlotLayout:
    """Lanes, slots and each head's slot, for one model on one tensor-parallel split.

    Slots are numbered globally: rank r owns slots [r * G, (r + 1) * G) (G = `slots_per_rank`),
    like KV heads. `head_slots[layer][h]` is the rank-local slot of global KV head h in `layer`
    (its rank is h's rank); the kernels get a layer's row of it as the head -> table-row map.
    """

    num_lanes: int                # k
    slots_per_rank: int           # G: slots per block of a lane, on one rank
    tensor_parallel_size: int
    lane_of_layer: tuple          # [L] lane of each layer
    head_slots: tuple             # [L][H] rank-local slot of each (layer, global KV head)
    slot_types: tuple             # [tp * G] AttentionType of each global slot

    @property
    def num_layers(self) -> int:
        return len(self.lane_of_layer)

    @property
    def num_slots(self) -> int:
        return len(self.slot_types)

    @property
    def sliding_slots(self) -> tuple:
        return tuple(s for s, t in enumerate(self.slot_types) if t.sliding)

    @property
    def sliding_types(self) -> tuple:
        """The distinct sliding attention types, in order."""
        return tuple(sorted({t for t in self.slot_types if t.sliding}))

    def slots_of(self, kind: AttentionType) -> tuple:
        return tuple(s for s, t in enumerate(self.slot_types) if t == kind)

    def sliding_groups(self) -> tuple:
        """((type, its global slots), ...) for every sliding type, in type order: with recycling on, each
        group's slots recycle with that type's window and sink (docs/retention_rule.md)."""
        return tuple((kind, self.slots_of(kind)) for kind in self.sliding_types)

    def layers_of_lane(self, lane: int) -> tuple:
        return tuple(i for i, l in enumerate(self.lane_of_layer) if l == lane)

    def layer_head_slots(self, layer: int, heads: Sequence[int]) -> list:
        """The rank-local slot (table row) of each of `heads` (one rank's global KV heads) in `layer`."""
        return [self.head_slots[layer][h] for h in heads]

    def describe(self) -> str:
        counts = Counter(self.slot_types[:self.slots_per_rank])
        mix = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
        return (f"{self.num_lanes} lane(s) of {self.num_layers // self.num_lanes} layer(s), "
                f"{self.slots_per_rank} slot(s) per block per rank ({mix})")


def assign_slots(types: Sequence[Sequence[AttentionType]], tensor_parallel_size: int = 1) -> SlotLayout:
    """The slot layout with the most lanes for a per-(layer, KV head) type table `types[L][H]`.

    Raises ValueError naming the problem for a table that is not a rectangle of AttentionType, or
    KV heads that do not split over the ranks.
    """
    num_layers = len(types)
    if num_layers < 1:
        raise ValueError("slot layout: the attention type table has no layers")
    num_heads = len(types[0])
    for layer, row in enumerate(types):
        if len(row) != num_heads or not all(isinstance(t, AttentionType) for t in row):
            raise ValueError(f"slot layout: layer {layer} has {len(row)} attention types, expected one "
                             f"AttentionType for each of {num_heads} KV heads")
    tp = tensor_parallel_size
    if num_heads < 1 or num_heads % tp:
        raise ValueError(f"slot layout: {num_heads} KV heads do not split over tensor_parallel_size={tp}")
    hpr = num_heads // tp
    # A layer's demand: how many pairs of each (rank, type) it brings to its lane.
    demand = [Counter((h // hpr, t) for h, t in enumerate(row)) for row in types]
    totals = sum(demand, Counter())
    for k in range(num_layers, 0, -1):
        if num_layers % k or any(n % k for n in totals.values()):
            continue
        lanes = _partition(demand, k, {key: n // k for key, n in totals.items()})
        if lanes is not None:
            return _place_slots(types, lanes, k, tp)
    raise AssertionError("unreachable: one lane always holds every layer")


def _partition(demand: list, k: int, per_lane: dict) -> Optional[list]:
    """Lane of each layer such that every lane's summed demand equals `per_lane`, or None.

    Depth-first over the layers in order; lanes are interchangeable, so the search state is the
    multiset of lanes' remaining capacities (memoised), and a layer tries each distinct lane state once.
    """
    keys = sorted(per_lane)
    vectors = [tuple(d.get(key, 0) for key in keys) for d in demand]
    start = tuple(per_lane[key] for key in keys)
    remaining = [start] * k
    assignment = [0] * len(vectors)
    failed: set = set()
    steps = [0]

    def search(i: int) -> bool:
        if i == len(vectors):
            return True
        state = (i, tuple(sorted(remaining)))
        if state in failed:
            return False
        steps[0] += 1
        if steps[0] > _SEARCH_BUDGET:
            return False
        tried = set()
        for lane in range(k):
            cap = remaining[lane]
            if cap in tried:
                continue
            tried.add(cap)
            left = tuple(c - v for c, v in zip(cap, vectors[i]))
            if min(left, default=0) < 0:
                continue
            remaining[lane], assignment[i] = left, lane
            if search(i + 1):
                return True
            remaining[lane] = cap
        failed.add(state)
        return False

    if search(0):
        return assignment
    if steps[0] > _SEARCH_BUDGET:
        logger.warning("slot layout: gave up searching for %d lanes after %d steps", k, _SEARCH_BUDGET)
    return None


def _place_slots(types, lanes: list, k: int, tp: int) -> SlotLayout:
    """Slot of every pair: lane 0's pairs in (layer, head) order fix the slot types of each rank;
    every other lane's pairs take, in the same order, the lowest free slot of their type."""
    num_layers, num_heads = len(types), len(types[0])
    hpr = num_heads // tp
    # Lanes renumbered by their first layer, so lane 0 holds layer 0 (deterministic, readable logs).
    order = {}
    for lane in lanes:
        order.setdefault(lane, len(order))
    lane_of_layer = tuple(order[lane] for lane in lanes)
    slots_per_rank = (num_layers // k) * hpr
    head_slots = [[-1] * num_heads for _ in range(num_layers)]
    slot_types = []
    for rank in range(tp):
        heads = range(rank * hpr, (rank + 1) * hpr)
        rank_types = [types[layer][h] for layer in range(num_layers) if lane_of_layer[layer] == 0 for h in heads]
        slot_types.extend(rank_types)
        for lane in range(k):
            used = [False] * slots_per_rank
            for layer in (i for i in range(num_layers) if lane_of_layer[i] == lane):
                for h in heads:
                    s = next(s for s in range(slots_per_rank) if not used[s] and rank_types[s] == types[layer][h])
                    used[s] = True
                    head_slots[layer][h] = s
    return SlotLayout(num_lanes=k, slots_per_rank=slots_per_rank, tensor_parallel_size=tp,
                      lane_of_layer=lane_of_layer, head_slots=tuple(tuple(r) for r in head_slots),
                      slot_types=tuple(slot_types))
