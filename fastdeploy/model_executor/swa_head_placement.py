"""Where each layer's SWA KV heads sit at load time: the per-layer KV-head orders of the served model.

The paged backend and the page model see one set of sliding *slots* for every layer (a page is one
slot's `block_size` tokens in every lane, design §14). A spec that lists different heads per layer
(§13) needs each layer's SWA heads in the slots layer 0's SWA heads occupy. On one rank that is the
slot layout's job alone (cache_manager/slots.py): the attention op takes each layer's KV head -> slot
map (`kv_head_slots`), so the weights stay in the checkpoint's order and keep the file's format
(GGUF blocks, bf16 / fp16) — nothing is permuted and the flag costs no weight bytes.

Under tensor parallelism a head's position also decides its rank, so there the heads still move:
each layer's KV heads are permuted (a KV head with its GQA query heads, its q/k/v rows and its o_proj
columns) so that its SWA heads land in layer 0's SWA slots, and `--balance-swa-heads` then permutes
whole slots the same way in every layer so that the ranks share the SWA heads. Both steps compose
into one order per layer (ModelConfig.kv_head_orders), which each rank applies together with its
slice as one row / column selection that keeps the file's format (tensor_parallel.rank_tensor).
Attention is per head and o_proj sums over heads, so the outputs do not change.

NATIVE_ATTN, the dense oracle, masks per (layer, head) and needs no shared slots: there the
per-layer heads stay where the checkpoint has them, any pattern (uneven counts too) is evaluable,
and only balancing permutes.

Uneven counts (layers sliding different numbers of heads) cannot share slots by permutation; they
stay where the checkpoint has them and the slot layout serves them (fewer lanes, several layers per
lane, each head in a slot of its own type).
"""

from __future__ import annotations

from dataclasses import replace

from fastdeploy.model_executor.tensor_parallel import balanced_kv_head_order

DENSE_BACKEND = "NATIVE_ATTN"


def place_swa_heads(model, attention_backend: str, tp: int, balance: bool):
    """The model config with the load-time KV-head orders this backend serves (the same object when
    nothing moves). Idempotent: a placed config places to itself."""
    spec = model.head_wise_swa
    if (spec is not None and tp > 1 and attention_backend != DENSE_BACKEND and not spec.same_in_every_layer
            and len({len(heads) for heads in spec.layer_kv_heads}) == 1):
        model = reorder_kv_heads(model, aligning_orders(spec.layer_kv_heads, model.num_key_value_heads))
    if balance:
        if spec is None:
            raise ValueError("balance_swa_heads: the model declares no SWA KV heads to balance")
        if tp == 1:
            return model  # one rank holds every head: nothing to balance
        if not model.swa_kv_heads:
            raise ValueError("balance_swa_heads: no KV head slides in every layer, so no page can be recycled "
                             "and there is nothing to balance")
        order = balanced_kv_head_order(model.num_key_value_heads, model.swa_kv_heads, tp)
        model = reorder_kv_heads(model, [order] * model.num_hidden_layers)
    return model


def aligning_orders(layers: tuple, num_kv_heads: int) -> list:
    """Per layer, a KV-head order that puts its SWA heads into the slots of layer 0's SWA heads and its
    full heads into the other slots, each kind in its original order (identity where a layer already
    matches layer 0). All layers must list the same number of heads."""
    target = sorted(layers[0])
    rest = [s for s in range(num_kv_heads) if s not in set(target)]
    orders = []
    for heads in layers:
        order = [0] * num_kv_heads
        for slot, h in zip(target, sorted(heads)):
            order[slot] = h
        for slot, h in zip(rest, [h for h in range(num_kv_heads) if h not in set(heads)]):
            order[slot] = h
        orders.append(order)
    return orders


def reorder_kv_heads(model, steps: list):
    """Apply one more permutation per layer: new slot i of layer l takes what slot steps[l][i] held.
    Composes with the orders already there; the SWA head sets (and their windows) follow their heads."""
    if all(list(step) == list(range(model.num_key_value_heads)) for step in steps):
        return model
    layers = range(model.num_hidden_layers)
    orders = tuple(tuple(model.layer_kv_head_order(l)[s] for s in steps[l]) for l in layers)
    identity = tuple(range(model.num_key_value_heads))
    spec = model.head_wise_swa
    if spec is not None:
        spec = spec.permuted([list(steps[l]) for l in layers])
    return replace(model, kv_head_orders=None if all(o == identity for o in orders) else orders,
                   head_wise_swa=spec)
