"""Start-up validation: every bad flag or spec fails with a message that names the field."""

import json

import pytest

from fastdeploy import envs
from fastdeploy.engine.args_utils import EngineArgs


def build(monkeypatch, head_wise="1", recycle="1", **kwargs):
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", head_wise)
    monkeypatch.setenv("FD_HEAD_WISE_SWA_RECYCLE", recycle)
    kwargs.setdefault("num_gpu_blocks_override", 64)
    return EngineArgs(**kwargs).create_engine_config()


@pytest.mark.parametrize("spec,message", [
    ({"sliding_window": 0, "sink_size": 0, "swa_kv_heads": [0]}, "head_wise_swa.sliding_window"),
    ({"sliding_window": 8, "sink_size": -1, "swa_kv_heads": [0]}, "head_wise_swa.sink_size"),
    ({"sliding_window": 8, "sink_size": 0, "swa_kv_heads": [4]}, "head 4 is out of range"),
    ({"sliding_window": 8, "sink_size": 0, "swa_kv_heads": [-1]}, "out of range"),
    ({"sliding_window": 8, "sink_size": 0, "swa_kv_heads": [1, 1]}, "lists a head twice"),
    ({"sliding_window": 8, "sink_size": 0, "swa_kv_heads": []}, "non-empty list"),
    ({"sliding_window": 8, "sink_size": 0}, "head_wise_swa.swa_kv_heads is required"),
    ({"sliding_window": 8, "sink_size": 0, "swa_kv_heads": [0], "windw": 3}, "unknown field"),
    ({"sliding_window": 2.5, "sink_size": 0, "swa_kv_heads": [0]}, "sliding_window"),
    ("{not json", "not valid JSON"),
])
def test_invalid_swa_spec_names_the_field(monkeypatch, spec, message):
    with pytest.raises(ValueError, match=message):
        build(monkeypatch, head_wise_swa_config=spec)


def test_swa_spec_accepts_json_strings(monkeypatch):
    cfg = build(monkeypatch, head_wise_swa_config=json.dumps({"sliding_window": 8, "sink_size": 2,
                                                              "swa_kv_heads": [2, 0]}))
    assert cfg.model_config.head_wise_swa.swa_kv_heads == (0, 2)
    assert cfg.head_wise_kv_cache and cfg.swa_recycle_active


def test_tensor_parallel_must_divide_kv_heads(monkeypatch):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide num_key_value_heads=4"):
        build(monkeypatch, tensor_parallel_size=3)


def test_head_wise_without_swa_heads_is_a_start_up_error(monkeypatch, tmp_path):
    from fastdeploy.model_executor.models.tiny_preset import TINY_PRESET_CONFIG

    cfg = {k: v for k, v in TINY_PRESET_CONFIG.items() if k != "head_wise_swa"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="declares no SWA KV heads"):
        build(monkeypatch, model=str(tmp_path))
    assert not build(monkeypatch, head_wise="0", model=str(tmp_path)).head_wise_kv_cache


def test_prefix_caching_is_on_by_default_and_works_with_head_wise(monkeypatch):
    assert build(monkeypatch).cache_config.enable_prefix_caching is True
    assert build(monkeypatch, enable_prefix_caching=False).cache_config.enable_prefix_caching is False


def test_recycle_off_without_head_wise_has_nothing_to_act_on(monkeypatch):
    with pytest.raises(ValueError, match="FD_HEAD_WISE_SWA_RECYCLE=0 has no effect"):
        build(monkeypatch, head_wise="0", recycle="0")


@pytest.mark.parametrize("name,value,message", [
    ("FD_HEAD_WISE_KV_CACHE", "yes", "must be an integer"),
    ("FD_HEAD_WISE_KV_CACHE", "2", "must be 0 or 1"),
    ("ENABLE_V1_KVCACHE_SCHEDULER", "0", "only has the V1"),
    ("FD_ATTENTION_BACKEND", "FLASH", "must be one of"),
    ("FD_ENC_DEC_BLOCK_NUM", "-1", "FD_ENC_DEC_BLOCK_NUM"),
])
def test_bad_env_flags_fail_at_config_creation(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        EngineArgs(num_gpu_blocks_override=8).create_engine_config()


def test_env_flags_are_read_lazily_with_upstream_defaults(monkeypatch):
    for name in ("FD_HEAD_WISE_KV_CACHE", "FD_HEAD_WISE_SWA_RECYCLE", "ENABLE_V1_KVCACHE_SCHEDULER",
                 "FD_ENC_DEC_BLOCK_NUM", "FD_ATTENTION_BACKEND"):
        monkeypatch.delenv(name, raising=False)
    assert (envs.FD_HEAD_WISE_KV_CACHE, envs.FD_HEAD_WISE_SWA_RECYCLE, envs.ENABLE_V1_KVCACHE_SCHEDULER,
            envs.FD_ENC_DEC_BLOCK_NUM, envs.FD_ATTENTION_BACKEND) == (0, 1, 1, 2, "APPEND_ATTN")
    monkeypatch.setenv("FD_HEAD_WISE_KV_CACHE", "1")
    assert envs.FD_HEAD_WISE_KV_CACHE == 1


@pytest.mark.parametrize("kwargs,message", [
    ({"block_size": 0}, "block_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"max_model_len": 1}, "max_model_len"),
    ({"max_model_len": 10 ** 9}, "max_position_embeddings"),
    ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override"),
    ({"cache_dtype": "int3"}, "cache_dtype"),
    ({"model": "/nonexistent/model/dir"}, "neither a model directory, a .gguf file"),
])
def test_bad_engine_args_name_the_flag(monkeypatch, kwargs, message):
    with pytest.raises(ValueError, match=message):
        build(monkeypatch, head_wise="0", **kwargs)


def test_kv_cache_memory_sets_the_number_of_blocks(monkeypatch):
    cfg = build(monkeypatch, num_gpu_blocks_override=None, kv_cache_memory=64 * 1024 * 1024, block_size=64)
    per_block = 2 * 2 * 4 * 64 * 32 * 4  # K+V, layers, KV heads, block, head_dim, fp32
    assert cfg.cache_config.num_gpu_blocks == 64 * 1024 * 1024 // per_block


def test_cli_flags_round_trip_into_engine_args():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--max-num-seqs", "32", "--block-size", "16", "--no-enable-prefix-caching",
                              "--head-wise-swa-config", '{"sliding_window": 8, "sink_size": 0, "swa_kv_heads": [1]}'])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.max_num_seqs == 32 and engine_args.block_size == 16
    assert json.loads(engine_args.head_wise_swa_config)["swa_kv_heads"] == [1]


# -- per-layer SWA heads (design §13): the tiny preset has 2 layers of 4 KV heads ------------------
PER_LAYER = {"sliding_window": 8, "sink_size": 2}


@pytest.mark.parametrize("heads,message", [
    ([[0], [4]], r"swa_kv_heads\[layer 1\]: head 4 is out of range \(the model has 4 KV heads\)"),
    ([[0], [-1]], r"swa_kv_heads\[layer 1\]: head -1 is out of range"),
    ([[2, 2], [0, 1]], r"swa_kv_heads\[layer 0\] lists a head twice"),
    ([[0], [1], [2]], "has 3 per-layer lists but the model has 2 layers"),
    ([[0]], "has 1 per-layer lists but the model has 2 layers"),
    ([[0], 1], "mixes head indices and per-layer lists"),
    ([[], []], "no layer lists a SWA head"),
    ([["0"], [1]], r"swa_kv_heads\[layer 0\]: head '0' is out of range"),
])
def test_invalid_per_layer_swa_heads_name_the_layer_and_field(monkeypatch, heads, message):
    with pytest.raises(ValueError, match=message):
        build(monkeypatch, head_wise_swa_config=dict(PER_LAYER, swa_kv_heads=heads))


def test_uneven_per_layer_counts_stay_in_place_and_the_slot_layout_serves_them(monkeypatch):
    spec = dict(PER_LAYER, swa_kv_heads=[[0], [1, 2]])
    paged = build(monkeypatch, head_wise="1", head_wise_swa_config=spec)
    assert paged.model_config.kv_head_orders is None  # no permutation can line uneven sets up
    slots = paged.slot_layout  # 3 SWA pairs of 8: one lane of both layers, 3 sliding slots of 8
    assert (slots.num_lanes, slots.slots_per_rank, len(slots.sliding_slots)) == (1, 8, 3)
    monkeypatch.setenv("FD_ATTENTION_BACKEND", "NATIVE_ATTN")
    model = build(monkeypatch, head_wise="0", head_wise_swa_config=spec).model_config
    assert [model.layer_swa_kv_heads(l) for l in range(2)] == [(0,), (1, 2)]
    assert model.swa_kv_heads == () and model.kv_head_orders is None


def test_per_layer_heads_keep_their_place_and_the_slot_map_puts_them_in_layer_zeros_slots(monkeypatch):
    """One rank: no weight moves (the file's format is kept); the op's head -> slot map lines the SWA heads up."""
    cfg = build(monkeypatch, head_wise_swa_config=dict(PER_LAYER, swa_kv_heads=[[3, 1], [2, 0]]))
    model, slots = cfg.model_config, cfg.slot_layout
    assert model.kv_head_orders is None
    assert [model.layer_swa_kv_heads(l) for l in range(2)] == [(1, 3), (0, 2)]
    assert slots.num_lanes == 2 and slots.head_slots == ((0, 1, 2, 3), (1, 0, 3, 2))
    assert [slots.slot_types[s].sliding for s in range(4)] == [False, True, False, True]
    same = build(monkeypatch, head_wise_swa_config=dict(PER_LAYER, swa_kv_heads=[[2], [2]])).model_config
    assert same.kv_head_orders is None and same.swa_kv_heads == (2,)  # nothing to move


def test_per_layer_heads_move_to_layer_zeros_slots_under_tensor_parallelism(monkeypatch):
    """Two ranks: a head's position decides its rank, so the heads themselves move (in the file's format)."""
    model = build(monkeypatch, tensor_parallel_size=2,
                  head_wise_swa_config=dict(PER_LAYER, swa_kv_heads=[[3, 1], [2, 0]])).model_config
    assert model.kv_head_orders == ((0, 1, 2, 3), (1, 0, 3, 2))
    assert model.swa_kv_heads == (1, 3) and [model.layer_swa_kv_heads(l) for l in range(2)] == [(1, 3), (1, 3)]


def test_per_layer_placement_composes_with_balancing_and_is_idempotent(monkeypatch):
    from fastdeploy.config import FDConfig

    cfg = build(monkeypatch, tensor_parallel_size=2, balance_swa_heads=True,
                head_wise_swa_config=dict(PER_LAYER, swa_kv_heads=[[0, 1], [2, 3]]))
    model = cfg.model_config
    # Layer 1 first moves (2, 3) into slots (0, 1), then balancing swaps slots 1 and 2 in every layer.
    assert model.kv_head_orders == ((0, 2, 1, 3), (2, 0, 3, 1))
    assert model.swa_kv_heads == (0, 2) and model.head_wise_swa.layer_kv_heads == ((0, 2), (0, 2))
    with pytest.raises(ValueError, match="permuted differently per layer"):
        model.kv_head_order
    again = FDConfig(model_config=model, cache_config=cfg.cache_config, scheduler_config=cfg.scheduler_config,
                     parallel_config=cfg.parallel_config)
    assert again.model_config.kv_head_orders == model.kv_head_orders


@pytest.mark.parametrize("heads", [[2, 0], [[0, 3], []], [[1], [1]]])
def test_per_layer_spec_round_trips_through_to_dict(heads):
    from fastdeploy.config import HeadWiseSWAConfig

    spec = HeadWiseSWAConfig.from_dict(dict(PER_LAYER, swa_kv_heads=heads), 4, 2)
    assert HeadWiseSWAConfig.from_dict(spec.to_dict(), 4, 2) == spec
    assert spec.to_dict()["swa_kv_heads"] == ([sorted(h) for h in heads] if isinstance(heads[0], list)
                                              else sorted(heads))


@pytest.mark.parametrize("windows, message", [
    ([48, 48], r"layer_sliding_window must list a window \(or null\) for each of 6 layers"),
    ([48, 0, None, None, None, None], r"layer_sliding_window\[1\] must be an integer >= 1 or null, got 0"),
    ([48, "wide", None, None, None, None], r"layer_sliding_window\[1\] must be an integer >= 1"),
])
def test_bad_sliding_layers_are_start_up_errors_naming_the_field(monkeypatch, windows, message):
    from fastdeploy.model_executor.models import tiny_preset

    preset = tiny_preset.PRESETS["tiny-sliding-layers"]
    monkeypatch.setitem(tiny_preset.PRESETS, "tiny-sliding-layers", {**preset, "layer_sliding_window": windows})
    with pytest.raises(ValueError, match=message):
        build(monkeypatch, model="tiny-sliding-layers")


def test_sliding_layers_turn_head_wise_mode_on_without_head_wise_swa_and_are_logged(monkeypatch, caplog):
    """A model trained with sliding layers has something to recycle: FD_HEAD_WISE_KV_CACHE=1 needs no
    head_wise_swa section, and start-up logs the lanes it chose."""
    with caplog.at_level("INFO", logger="fastdeploy.config"):
        cfg = build(monkeypatch, model="tiny-sliding-layers")
    assert cfg.swa_recycle_active and cfg.model_config.head_wise_swa is None
    assert "KV slots: 1 lane(s) of 6 layer(s), 12 slot(s) per block per rank (2 full, 10 window 48 + sink 0)" \
        in caplog.text
