"""Slots and lanes (cache_manager/slots.py): the lane assignment, each head's slot, and what the
page-need function makes of them."""

from collections import Counter

import pytest

from fastdeploy.cache_manager.head_wise import PageLayout
from fastdeploy.cache_manager.slots import FULL, AttentionType, assign_slots

W512 = AttentionType(512, 0)


def gemma3_270m_types():
    """18 layers, 1 KV head, window 512 but layers 5, 11 and 17 global."""
    return [[FULL] if layer % 6 == 5 else [W512] for layer in range(18)]


def check_pure(types, layout):
    """Every pair sits in a slot of its own type; no two pairs of one lane share a slot."""
    tp, hpr = layout.tensor_parallel_size, len(types[0]) // layout.tensor_parallel_size
    for lane in range(layout.num_lanes):
        seen = set()
        for layer in layout.layers_of_lane(lane):
            for h, t in enumerate(types[layer]):
                rank, slot = h // hpr, layout.head_slots[layer][h]
                assert 0 <= slot < layout.slots_per_rank
                assert layout.slot_types[rank * layout.slots_per_rank + slot] == t
                assert (rank, slot) not in seen
                seen.add((rank, slot))
        assert len(seen) == layout.slots_per_rank * tp  # every slot of the lane is used
    assert layout.num_lanes * layout.slots_per_rank * tp == len(types) * len(types[0])


def test_gemma3_270m_gets_three_lanes_of_six_layers():
    layout = assign_slots(gemma3_270m_types())
    assert (layout.num_lanes, layout.slots_per_rank) == (3, 6)
    assert layout.lane_of_layer == (0,) * 6 + (1,) * 6 + (2,) * 6
    assert Counter(layout.slot_types) == {W512: 5, FULL: 1}
    assert [row[0] for row in layout.head_slots] == [0, 1, 2, 3, 4, 5] * 3
    check_pure(gemma3_270m_types(), layout)


def test_layers_that_look_alike_get_a_lane_each_and_slot_h_for_head_h():
    """Today's head-wise model (SWA heads 0 and 2 of 4 in every layer) is the case k = L."""
    swa = AttentionType(128, 16)
    types = [[swa, FULL, swa, FULL] for _ in range(5)]
    layout = assign_slots(types)
    assert (layout.num_lanes, layout.slots_per_rank) == (5, 4)
    assert all(row == (0, 1, 2, 3) for row in layout.head_slots)
    assert layout.sliding_slots == (0, 2)


def test_uneven_per_layer_head_sets_share_slots_across_layers():
    """Layer 0 slides head 0, layer 1 head 1 (DuoAttention-style selection): both layers fit one lane
    count of 2 only if the SWA pairs line up; here k = 2 with the heads permuted in layer 1."""
    swa = AttentionType(64, 4)
    types = [[swa, FULL], [FULL, swa]]
    layout = assign_slots(types)
    assert layout.num_lanes == 2
    assert layout.head_slots == ((0, 1), (1, 0))
    check_pure(types, layout)


def test_uneven_counts_fall_back_to_fewer_lanes():
    """Layer 0 has two SWA heads, layers 1-3 one, layer 4 none: 5 SWA pairs of 10 over 5 layers. No
    split into 5 lanes; the largest equal split is a single lane."""
    swa = AttentionType(64, 0)
    types = [[swa, swa], [swa, FULL], [FULL, swa], [swa, FULL], [FULL, FULL]]
    layout = assign_slots(types)
    assert layout.num_lanes == 1 and layout.slots_per_rank == 10
    check_pure(types, layout)


def test_mixed_layers_need_a_search_not_just_equal_layer_kinds():
    """Layers of kinds (2 swa), (0 swa), (1 swa), (1 swa): lanes {A, B} and {C, D} balance although no
    kind appears an even number of times."""
    swa = AttentionType(32, 0)
    types = [[swa, swa], [FULL, FULL], [swa, FULL], [FULL, swa]]
    layout = assign_slots(types)
    assert layout.num_lanes == 2
    check_pure(types, layout)


def test_sliding_layers_and_head_wise_heads_of_two_windows():
    """Sliding layers (window 48) and a head-wise SWA head (window 128 + sink 16) in the global
    layers: three types, all slots pure."""
    layer_w, head_w = AttentionType(48, 0), AttentionType(128, 16)
    types = [[layer_w, layer_w]] * 2 + [[head_w, FULL]] + [[layer_w, layer_w]] * 2 + [[head_w, FULL]]
    layout = assign_slots(types)
    assert layout.num_lanes == 2 and layout.slots_per_rank == 6
    assert layout.sliding_types == (layer_w, head_w)
    check_pure(types, layout)


def test_tensor_parallel_slots_are_rank_local_and_pure_per_rank():
    swa = AttentionType(64, 0)
    types = [[swa, FULL, FULL, swa] if layer % 2 else [FULL, swa, swa, FULL] for layer in range(4)]
    layout = assign_slots(types, tensor_parallel_size=2)
    assert layout.num_slots == 2 * layout.slots_per_rank
    check_pure(types, layout)


def test_bad_tables_are_errors_naming_the_problem():
    with pytest.raises(ValueError, match="layer 1 has 1 attention types"):
        assign_slots([[FULL, FULL], [FULL]])
    with pytest.raises(ValueError, match="do not split over tensor_parallel_size=2"):
        assign_slots([[FULL, FULL, FULL]], tensor_parallel_size=2)
    with pytest.raises(ValueError, match="no layers"):
        assign_slots([])


def test_gemma3_page_need_at_4096_tokens_is_384_pages_1d_and_109_with_recycling():
    layout = assign_slots(gemma3_270m_types())
    kwargs = dict(block_size=64, num_slots=layout.num_slots, tensor_parallel_size=1,
                  sliding=layout.sliding_groups())
    off, on = PageLayout(**kwargs, recycle=False), PageLayout(**kwargs, recycle=True)
    # A request decoding up to a 4096-token context: 64 blocks x 6 slots without recycling; with it
    # the full slot keeps 64 pages and each sliding slot at most 9 (512 / 64 + the partial block).
    assert off.peak_pages_per_rank(1, 4096, 2048) == [384]
    assert on.peak_pages_per_rank(1, 4096, 2048) == [109]
    assert max(on.pages_per_rank(n, 1)[0] for n in range(4096)) == 64 + 5 * 9


@pytest.mark.parametrize("model", [None, "tiny-moe"])
def test_the_head_wise_presets_keep_the_per_head_layout(make_config, model):
    """A head-wise-only model is the case k = L: a lane per layer, slot h = KV head h, so its cache
    tensors, tables and page ids are exactly those of the per-head layout."""
    cfg = make_config("head_wise_recycle_on", model=model)
    slots, model_config = cfg.slot_layout, cfg.model_config
    heads = model_config.num_key_value_heads
    assert (slots.num_lanes, slots.slots_per_rank) == (model_config.num_hidden_layers, heads)
    assert slots.lane_of_layer == tuple(range(model_config.num_hidden_layers))
    assert all(row == tuple(range(heads)) for row in slots.head_slots)
    assert PageLayout.from_config(cfg).sliding_slots == model_config.swa_kv_heads
