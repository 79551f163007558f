"""Per-head windows in the spec (design §17): `head_windows` / `head_sinks` give each listed (layer, KV
head) its own window and sink; they are validated with messages naming the field, layer and value,
round-trip through to_dict, move with their heads when start-up permutes the KV heads, and every
sliding type they make recycles with its own window and sink."""

import pytest

from fastdeploy.cache_manager.slots import FULL, AttentionType

SPEC = {"sliding_window": 8, "sink_size": 2, "swa_kv_heads": [[3, 1], [2, 0]]}


def build(monkeypatch, head_wise="1", recycle="1", **kwargs):
    from fastdeploy.engine.args_utils import EngineArgs

    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", head_wise)
    monkeypatch.setenv("FD_HEAD_WISE_SWA_RECYCLE", recycle)
    kwargs.setdefault("num_gpu_blocks_override", 64)
    return EngineArgs(**kwargs).create_engine_config()


@pytest.mark.parametrize("extra, message", [
    ({"head_windows": [[4, 0], [4, 4]]}, r"head_wise_swa\.head_windows\[layer 0\]: 0 must be an integer >= 1"),
    ({"head_windows": [[4, 4], [4, "16"]]}, r"head_wise_swa\.head_windows\[layer 1\]: '16' must be an integer"),
    ({"head_sinks": [[0, 0], [-1, 0]]}, r"head_wise_swa\.head_sinks\[layer 1\]: -1 must be an integer >= 0"),
    ({"head_windows": [[4, 4], [4]]}, r"head_windows\[layer 1\] must give one value for each of the 2 heads"),
    ({"head_windows": [[4, 4]]}, r"head_windows must be one list per layer like swa_kv_heads \(2 lists\)"),
    ({"head_sinks": 4}, r"head_sinks must be one list per layer"),
])
def test_invalid_per_head_windows_name_the_field_layer_and_value(extra, message):
    from fastdeploy.config import HeadWiseSWAConfig

    with pytest.raises(ValueError, match=message):
        HeadWiseSWAConfig.from_dict({**SPEC, **extra}, 4, 2)


def test_per_head_windows_need_the_per_layer_form():
    from fastdeploy.config import HeadWiseSWAConfig

    with pytest.raises(ValueError, match=r"head_wise_swa\.head_windows needs swa_kv_heads as one list per layer"):
        HeadWiseSWAConfig.from_dict({"sliding_window": 8, "sink_size": 0, "swa_kv_heads": [0],
                                     "head_windows": [[4]]}, 4, 2)


def test_per_head_windows_round_trip_through_to_dict_in_head_order():
    from fastdeploy.config import HeadWiseSWAConfig

    spec = HeadWiseSWAConfig.from_dict({**SPEC, "head_windows": [[16, 4], [32, 8]], "head_sinks": [[0, 1], [2, 3]]},
                                       4, 2)
    assert spec.layer_kv_heads == ((1, 3), (0, 2))
    assert spec.layer_head_windows == ((4, 16), (8, 32)) and spec.layer_head_sinks == ((1, 0), (3, 2))
    assert spec.head_type(0, 3) == (16, 0) and spec.head_type(1, 0) == (8, 3)
    assert HeadWiseSWAConfig.from_dict(spec.to_dict(), 4, 2) == spec
    assert spec.per_head_windows
    only_windows = HeadWiseSWAConfig.from_dict({**SPEC, "head_windows": [[16, 4], [32, 8]]}, 4, 2)
    assert "head_sinks" not in only_windows.to_dict() and only_windows.head_type(0, 1) == (4, 2)  # the default sink


def test_each_pair_gets_its_own_attention_type(monkeypatch):
    cfg = build(monkeypatch, head_wise_swa_config={**SPEC, "head_windows": [[16, 4], [32, 8]]})
    from fastdeploy.model_executor.layers.attention.swa_spec import attention_type_table

    assert attention_type_table(cfg.model_config) == (
        (FULL, AttentionType(4, 2), FULL, AttentionType(16, 2)),
        (AttentionType(8, 2), FULL, AttentionType(32, 2), FULL))


def test_windows_move_with_their_heads_under_tensor_parallel_placement_and_balancing(monkeypatch):
    """Two ranks: layer 1's heads move into layer 0's SWA slots and balancing permutes slots; each head
    takes its window along, so the attention type of every (layer, checkpoint head) is unchanged."""
    from fastdeploy.model_executor.layers.attention.swa_spec import attention_type_table

    spec = {**SPEC, "swa_kv_heads": [[0, 1], [2, 3]], "head_windows": [[4, 16], [8, 32]], "head_sinks": [[0, 1],
                                                                                                       [2, 3]]}
    model = build(monkeypatch, tensor_parallel_size=2, balance_swa_heads=True, head_wise_swa_config=spec).model_config
    assert model.kv_head_orders == ((0, 2, 1, 3), (2, 0, 3, 1))
    table = attention_type_table(model)
    by_checkpoint_head = [{model.layer_kv_head_order(l)[i]: table[l][i] for i in range(4)} for l in range(2)]
    assert by_checkpoint_head == [{0: AttentionType(4, 0), 1: AttentionType(16, 1), 2: FULL, 3: FULL},
                                  {0: FULL, 1: FULL, 2: AttentionType(8, 2), 3: AttentionType(32, 3)}]


def test_every_sliding_type_recycles_with_its_own_window(monkeypatch):
    """Layer 0 slides head 1 with window 4, layer 1 head 1 with window 12: two sliding types on different
    layers (one lane, slots of each type), and the page layout recycles both, each by its own window."""
    from fastdeploy.cache_manager.head_wise import PageLayout

    spec = {"sliding_window": 8, "sink_size": 0, "swa_kv_heads": [[1], [1]], "head_windows": [[4], [12]]}
    cfg = build(monkeypatch, block_size=4, head_wise_swa_config=spec)
    slots = cfg.slot_layout
    assert slots.sliding_types == (AttentionType(4, 0), AttentionType(12, 0))
    layout = PageLayout.from_config(cfg)
    assert layout.recycling_groups == slots.sliding_groups() and len(layout.sliding_slots) == 2
    # Columns: (keeping slots, window-4 slots, window-12 slots). At n = 20 a window-4 slot has blocks
    # [0, 4) dead, a window-12 slot [0, 2): the step computing token 20 holds 6, 2 and 4 pages.
    assert layout.rank_head_counts() == [(slots.slots_per_rank - 2, 1, 1)]
    assert layout.pages_needed(20, 1) == (6, 2, 4)
    assert layout.pages_per_rank(20, 1) == [6 * (slots.slots_per_rank - 2) + 2 + 4]
    off = build(monkeypatch, recycle="0", block_size=4, head_wise_swa_config=spec)
    assert PageLayout.from_config(off).pages_needed(20, 1) == (6, 6, 6)


def test_capacity_planning_counts_every_window(monkeypatch):
    """predicted_concurrency and rank_ceilings sum the page need over the sliding types: two one-head
    windows of 64 and 256 on different layers, 4096 + 256 tokens, block 64, chunks of 2048."""
    from fastdeploy.cache_manager.head_wise import PageLayout, predicted_concurrency, rank_ceilings

    spec = {"sliding_window": 64, "sink_size": 0, "swa_kv_heads": [[1], [1]], "head_windows": [[64], [256]]}
    cfg = build(monkeypatch, block_size=64, max_model_len=8192, max_num_batched_tokens=2048,
                num_gpu_blocks_override=1024, head_wise_swa_config=spec)
    layout = PageLayout.from_config(cfg)
    # The last decode step (4350 processed, token 4350 computed): 68 blocks per full slot; W 64 keeps
    # blocks 66..67, W 256 blocks 63..67.
    assert layout.pages_per_rank(4350, 1) == [6 * 68 + 2 + 5]
    ceilings = rank_ceilings(cfg, 4096, 256)
    assert ceilings["swa_heads_per_rank"] == [2] and ceilings["ceiling"] > 1.2
    predicted = predicted_concurrency(cfg, 4096, 256)
    assert predicted["peak_pages_on"] < predicted["peak_pages_off"] == 8 * 68
    assert predicted["running_on"] >= predicted["running_off"]
