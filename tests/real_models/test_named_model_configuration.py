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
    with envs.override(FD_HEAD_WISE_KV_CACHE=1):
        on = ModelConfig.create("smollm2-135m-instruct", 1024, None)
    with envs.override(FD_HEAD_WISE_KV_CACHE=0):
        off = ModelConfig.create("smollm2-135m-instruct", 1024, None)
        by_path = ModelConfig.create(smollm2_path, 1024, None)
    shipped = _shipped()
    assert on.head_wise_swa.to_dict()["swa_kv_heads"] == shipped["swa_kv_heads"]
    assert (on.head_wise_swa.sliding_window, on.head_wise_swa.sink_size) == (shipped["sliding_window"],
                                                                              shipped["sink_size"])
    assert "calibrated configuration of smollm2-135m-instruct" in on.head_wise_swa_source
    assert off.head_wise_swa is None and by_path.head_wise_swa is None


def test_the_override_wins_over_the_calibrated_configuration():
    override = {"sliding_window": 4096, "sink_size": 4, "swa_kv_heads": [0]}
    with envs.override(FD_HEAD_WISE_KV_CACHE=1):
        cfg = ModelConfig.create("smollm2-135m-instruct", 1024, override)
    assert cfg.head_wise_swa.to_dict() == override and cfg.head_wise_swa_source == "--head-wise-swa-config"


def test_the_shipped_configuration_slides_one_of_three_kv_heads_per_layer_within_512_tokens():
    shipped = _shipped()
    assert shipped["sliding_window"] <= 512
    assert len(shipped["swa_kv_heads"]) == 30 and all(len(layer) == 1 for layer in shipped["swa_kv_heads"])
