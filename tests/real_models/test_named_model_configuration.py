"""`--model smollm2-135m-instruct` carries the head finder's calibrated SWA configuration: it serves
only when the user turns the feature on, the override wins, and with the flag off the model is the
full-attention model it was trained as."""

import json

from fastdeploy import envs
from fastdeploy.config import ModelConfig
from fastdeploy.model_executor.models.named_models import CALIBRATED_DIR


def _shipped() -> dict:
    with open(f"{CALIBRATED_DIR}/smollm2-135m-instruct.json", encoding="utf-8") as f:
        return json.load(f)["head_wise_swa"]


def test_the_calibrated_configuration_serves_only_with_the_feature_on(smollm2_path):
    on = ModelConfig.create("smollm2-135m-instruct", 1024, None, calibrated=True)  # the engine: the flag on
    off = ModelConfig.create("smollm2-135m-instruct", 1024, None, calibrated=False)
    by_path = ModelConfig.create(smollm2_path, 1024, None, calibrated=True)  # a path names no calibration
    shipped = _shipped()
    assert on.head_wise_swa.to_dict()["swa_kv_heads"] == shipped["swa_kv_heads"]
    assert (on.head_wise_swa.sliding_window, on.head_wise_swa.sink_size) == (shipped["sliding_window"],
                                                                              shipped["sink_size"])
    assert "calibrated configuration of smollm2-135m-instruct" in on.head_wise_swa_source
    assert off.head_wise_swa is None and by_path.head_wise_swa is None


def test_the_override_wins_over_the_calibrated_configuration():
    override = {"sliding_window": 4096, "sink_size": 4, "swa_kv_heads": [0]}
    cfg = ModelConfig.create("smollm2-135m-instruct", 1024, override, calibrated=True)
    assert cfg.head_wise_swa.to_dict() == override and cfg.head_wise_swa_source == "--head-wise-swa-config"


def test_the_shipped_configuration_holds_at_most_half_the_flag_off_pages_over_the_decode():
    """A 3968 + 128-token request at its peak over every decode step (a window's count rises as it
    crosses a block edge), counted by the engine's own page accounting (the slot layout and PageLayout of
    the configuration it serves) with the flag on and off, as a share of the cache (a page holds one slot
    of every lane: its size differs between the two layouts)."""
    from fastdeploy.cache_manager.head_wise import PageLayout
    from fastdeploy.engine.args_utils import EngineArgs

    held = {}
    for flag in (0, 1):
        with envs.override(FD_HEAD_WISE_KV_CACHE=flag):
            fd = EngineArgs(model="smollm2-135m-instruct", max_model_len=4096, block_size=64,
                            num_gpu_blocks_override=4096).create_engine_config()
        layout = PageLayout.from_config(fd)
        peak = max(sum(layout.pages_per_rank(t, 1)) for t in range(3968, 3968 + 128))
        held[flag] = peak / (fd.slot_layout.slots_per_rank * 4096)
    assert held[0] / held[1] >= 2.0, held


def _named(name: str) -> dict:
    with open(f"{CALIBRATED_DIR}/smollm2-135m-instruct.json", encoding="utf-8") as f:
        return json.load(f)["named_configurations"][name]["head_wise_swa"]


def test_an_earlier_calibrated_configuration_serves_by_its_name():
    with envs.override(FD_HEAD_WISE_KV_CACHE=1):
        cfg = ModelConfig.create("smollm2-135m-instruct", 1024, "one-head-per-layer-w512")
    old = _named("one-head-per-layer-w512")
    assert cfg.head_wise_swa.to_dict()["swa_kv_heads"] == old["swa_kv_heads"]
    assert [len(layer) for layer in old["swa_kv_heads"]] == [1] * 30 and old["sliding_window"] == 512


def test_an_unknown_configuration_name_is_one_line_listing_the_names():
    import pytest

    with envs.override(FD_HEAD_WISE_KV_CACHE=1), pytest.raises(ValueError) as err:
        ModelConfig.create("smollm2-135m-instruct", 1024, "no-such-configuration")
    assert "not a named configuration of smollm2-135m-instruct" in str(err.value)
    assert "one-head-per-layer-w512" in str(err.value) and "\n" not in str(err.value)
