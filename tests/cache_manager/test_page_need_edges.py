"""The page-need arithmetic at its edges, against values worked out by hand (docs/retention_rule.md)."""

import json

import pytest

from fastdeploy.cache_manager.head_wise import PageLayout, predicted_concurrency
from fastdeploy.cache_manager.slots import AttentionType
from fastdeploy.model_executor.models.tiny_preset import TINY_PRESET_CONFIG

TWO_SWA = {"sliding_window": 17, "sink_size": 0, "swa_kv_heads": [0, 1]}


def config(make_config, mode="head_wise_recycle_on", blocks=50):
    return make_config(mode, block_size=16, num_gpu_blocks_override=blocks, max_num_seqs=64,
                       max_num_batched_tokens=64, max_model_len=1024, head_wise_swa_config=TWO_SWA)


# 64 + 65 tokens compute positions 0..127: 8 blocks per head. OFF: 4 x 8 = 32 pages. ON: the full
# heads 2 x 8, the SWA heads (W 17: blocks (n - 16) // 16 .. n // 16) 2 x 2 at the last decode = 20
# (the 64-token prefill chunk needs only 4 x 4 = 16). 50 blocks x 4 heads = 200 pages: 200 // 32 = 6
# (rounded down) and 200 // 20 = 10 requests.
EXPECTED = {"running_off": 6, "running_on": 10, "ceiling": 10 / 6, "peak_pages_off": 32, "peak_pages_on": 20,
            "pages_per_rank": 200}


@pytest.mark.parametrize("mode", ["head_wise_recycle_on", "head_wise_recycle_off"])
def test_predicted_concurrency_by_hand_whichever_arm_the_config_runs(make_config, mode):
    # The prediction is of both arms: a config with recycling off predicts the same ON arm.
    assert predicted_concurrency(config(make_config, mode), 64, 65) == EXPECTED


def test_a_ceiling_with_no_request_fitting_without_recycling_is_infinite(make_config):
    # 6 blocks = 24 pages: 32 do not fit OFF, 20 fit ON.
    pred = predicted_concurrency(config(make_config, blocks=6), 64, 65)
    assert (pred["running_off"], pred["running_on"], pred["ceiling"]) == (0, 1, float("inf"))


def test_a_whole_prompt_chunk_at_block_size_1_and_window_1_holds_every_prompt_page():
    # Prefill [0, 8) at n = 0: nothing is dead yet, 8 one-token pages. Decode at n >= 8 needs 1.
    lay = PageLayout(block_size=1, num_slots=1, tensor_parallel_size=1, sliding=((AttentionType(1, 0), (0,)),),
                     recycle=True)
    assert lay.peak_pages_per_rank(8, 4, 16) == [8]
    assert lay.pages_per_rank(8, 1) == [1]


def test_a_model_without_swa_heads_has_a_plain_layout(make_config, tmp_path):
    model = {k: v for k, v in TINY_PRESET_CONFIG.items() if k != "head_wise_swa"}
    (tmp_path / "config.json").write_text(json.dumps(model))
    fd = make_config("1d", model=str(tmp_path))
    assert PageLayout.from_config(fd) == PageLayout(block_size=16, num_slots=4, tensor_parallel_size=1)
