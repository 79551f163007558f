"""A model with sliding *layers* (tiny-sliding-layers: five sliding layers of window 48 to one global,
2 KV heads) gives the NATIVE_ATTN oracle's greedy tokens in every memory mode: 1-D tables with the
sliding layers masked, and slots + lanes (one lane of 6 layers, 12 slots: 10 sliding, 2 full) with
recycling off and on; prompts far longer than the window, chunked prefill and preemption included.
The same holds with head-wise SWA added on the global layer (11 sliding slots, 1 full), of the
layers' window or of another one (two sliding types: each recycles with its own window)."""

import pytest

from greedy_run import greedy_tokens

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

PRESET = "tiny-sliding-layers"
PROMPT_LENGTHS = [1, 7, 16, 60, 130, 210]  # up to ~4x the window
MAX_TOKENS = 20
BOTH = {"sliding_window": 48, "sink_size": 0, "swa_kv_heads": [0]}  # the global layer's head 0 slides too
TWO_WINDOWS = {"sliding_window": 32, "sink_size": 4, "swa_kv_heads": [0]}  # ... with a window of its own


def prompts():
    return [[3 + (i * 41 + n * 13 + (i * i) % 29) % 250 for i in range(n)] for n in PROMPT_LENGTHS]


def generate(monkeypatch, backend, head_wise, recycle, reserve="1", **engine_args):
    engine_args = {"model": PRESET, "block_size": 16, "max_model_len": 512, "max_num_seqs": 8, **engine_args}
    return greedy_tokens(monkeypatch, prompts(), MAX_TOKENS, backend, head_wise, recycle, reserve, **engine_args)


def _oracle(**engine_args):
    mp = pytest.MonkeyPatch()
    try:
        tokens, _ = generate(mp, "NATIVE_ATTN", "0", "1", num_gpu_blocks_override=256, **engine_args)
    finally:
        mp.undo()
    assert all(len(t) == MAX_TOKENS for t in tokens)
    return tokens


@pytest.fixture(scope="module")
def oracle():
    return _oracle()


MODES = {"1d": ("0", "1"), "slots_recycle_off": ("1", "0"), "slots_recycle_on": ("1", "1")}


@pytest.mark.parametrize("mode", MODES)
def test_sliding_layers_match_the_oracle_in_every_mode(monkeypatch, oracle, mode):
    tokens, engine = generate(monkeypatch, "APPEND_ATTN", *MODES[mode], num_gpu_blocks_override=256)
    assert tokens == oracle
    layout = engine.fd_config.slot_layout
    assert (layout.num_lanes, layout.slots_per_rank, len(layout.sliding_slots)) == (1, 12, 10)
    if mode == "slots_recycle_on":
        assert engine.get_stats()["swa_pages_recycled_total"] > 0


# Blocks too few for all six requests at once (recycling on needs far fewer pages per request).
TIGHT_BLOCKS = {"1d": 20, "slots_recycle_off": 20, "slots_recycle_on": 10}


@pytest.mark.parametrize("mode", MODES)
def test_sliding_layers_chunked_prefill_and_preemption_match_the_oracle(monkeypatch, oracle, mode):
    tokens, engine = generate(monkeypatch, "APPEND_ATTN", *MODES[mode], reserve="0",
                              num_gpu_blocks_override=TIGHT_BLOCKS[mode], max_num_batched_tokens=40)
    assert engine.get_stats()["num_preemptions_total"] > 0
    assert tokens == oracle
    stats = engine.get_stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]


def test_the_sliding_layers_change_what_the_model_says(monkeypatch, oracle):
    """The oracle honours the layer windows: with every layer global the tokens differ (prompts are
    longer than the window), so the equalities above compare sliding attention, not full."""
    from fastdeploy.model_executor.models import tiny_preset

    monkeypatch.setitem(tiny_preset.PRESETS, PRESET, {**tiny_preset.PRESETS[PRESET], "layer_sliding_window": None})
    tokens, _ = generate(monkeypatch, "NATIVE_ATTN", "0", "1", num_gpu_blocks_override=256)
    assert tokens[:3] == oracle[:3]  # prompts within the window see the same keys
    assert tokens[3:] != oracle[3:]


@pytest.mark.parametrize("mode", ["1d", "slots_recycle_on"])
@pytest.mark.parametrize("swa, sliding_types", [(BOTH, 1), (TWO_WINDOWS, 2)], ids=["one_window", "two_windows"])
def test_sliding_layers_with_head_wise_swa_match_the_oracle(monkeypatch, mode, swa, sliding_types):
    oracle = _oracle(head_wise_swa_config=swa)
    tokens, engine = generate(monkeypatch, "APPEND_ATTN", *MODES[mode], num_gpu_blocks_override=40, reserve="0",
                              max_num_batched_tokens=40, head_wise_swa_config=swa)
    assert tokens == oracle
    layout = engine.fd_config.slot_layout
    assert len(layout.sliding_slots) == 11 and len(layout.sliding_types) == sliding_types
    if mode == "slots_recycle_on":  # every sliding slot recycles, each type with its own window
        assert engine.scheduler.layout.recycling_groups == layout.sliding_groups()
        assert engine.scheduler.layout.sliding_slots == layout.sliding_slots
        assert engine.get_stats()["swa_pages_recycled_total"] > 0
