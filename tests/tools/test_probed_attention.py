"""The dense reference with per-(layer, KV head) masks (fastdeploy/tools/probed_attention.py): one window
and sink for every sliding pair (bool masks, today's call), or each pair's own window and sink."""

import numpy as np
import pytest

from fastdeploy.engine.step_runner import StepRunner
from fastdeploy.tools.probed_attention import ProbedNativeAttention, pair_windows


def test_bool_masks_with_one_window_give_that_window_to_every_sliding_pair():
    windows, sinks = pair_windows(np.array([[True, False], [False, True]]), 20, 3)
    assert windows.tolist() == [[20, 0], [0, 20]]
    assert sinks.tolist() == [[3, 0], [0, 3]]  # a full pair has no sink


def test_each_pair_may_have_its_own_window_and_sink():
    windows, sinks = pair_windows(np.array([[20, 0], [9, 33]]), None, np.array([[3, 7], [0, 5]]))
    assert windows.tolist() == [[20, 0], [9, 33]]
    assert sinks.tolist() == [[3, 0], [0, 5]]
    assert pair_windows(np.array([[20, 0]]), None, 4)[1].tolist() == [[4, 0]]


@pytest.mark.parametrize("masks, window, sink, message", [
    (np.array([[True]]), 0, 0, "window must be >= 1"),
    (np.array([[-1, 0]]), None, 0, "must be >= 0"),
    (np.array([[8, 0]]), None, np.array([[1, 2, 3]]), r"sink must be an int or \[num_layers, num_kv_heads\]"),
    (np.array([8, 0]), None, 0, r"swa_masks must be \[num_layers, num_kv_heads\]"),
])
def test_bad_windows_and_sinks_are_refused(masks, window, sink, message):
    with pytest.raises(ValueError, match=message):
        pair_windows(masks, window, sink)


def test_the_probed_backend_masks_each_query_head_with_its_pairs_window(make_config):
    cfg = make_config("1d", num_gpu_blocks_override=40, block_size=8, max_num_seqs=2, max_model_len=128,
                      enable_prefix_caching=False)
    model = cfg.model_config
    layers, kv_heads = model.num_hidden_layers, model.num_key_value_heads
    group = model.num_attention_heads // kv_heads
    rng = np.random.default_rng(0)
    windows = rng.choice([0, 5, 12], size=(layers, kv_heads))
    sinks = rng.choice([0, 2], size=(layers, kv_heads))
    backend = ProbedNativeAttention(cfg, StepRunner(cfg).attn_backend.rotary, windows, None, sinks)
    start, n = 30, 4
    t = np.arange(start, start + n)[:, None]
    j = np.arange(start + n)[None, :]
    for layer in range(layers):
        got = backend.visibility(start, n, layer).numpy()
        for qh in range(model.num_attention_heads):
            w, s = windows[layer, qh // group], sinks[layer, qh // group]
            want = (j <= t) & ((w == 0) | (j < s) | (j > t - w))
            assert np.array_equal(got[qh], want), (layer, qh, w, s)
