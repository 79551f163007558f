"""Per-layer SWA heads (design §13): the paged backend serves a spec that slides different KV heads in
different layers by mapping each layer's KV heads to shared slots (the op's `kv_head_slots`), the
weights left in the checkpoint's order; the dense NATIVE_ATTN oracle runs the same checkpoint with one
mask per (layer, head). Greedy tokens must agree in every memory mode."""

import pytest

from greedy_run import MODES, greedy_tokens

# The tiny preset: 2 layers, 4 KV heads. Layer 0 slides heads 1 and 3, layer 1 heads 0 and 2, so
# serving must put layer 1's heads 0, 2 into slots 1, 3 (head -> slot map (1, 0, 3, 2)).
SPEC = {"sliding_window": 32, "sink_size": 4, "swa_kv_heads": [[1, 3], [0, 2]]}
PROMPT_LENGTHS = [7, 40, 130, 300]  # past the window of 32 by up to ~9x
MAX_TOKENS = 16


def prompts():
    return [[3 + (i * 37 + n * 11 + (i * i) % 23) % 250 for i in range(n)] for n in PROMPT_LENGTHS]


def generate(monkeypatch, backend, head_wise="0", recycle="1", spec=SPEC):
    return greedy_tokens(monkeypatch, prompts(), MAX_TOKENS, backend, head_wise, recycle, block_size=16,
                         max_model_len=512, max_num_seqs=4, num_gpu_blocks_override=256,
                         head_wise_swa_config=spec)


@pytest.fixture(scope="module")
def unpermuted_oracle():
    mp = pytest.MonkeyPatch()
    try:
        tokens, engine = generate(mp, "NATIVE_ATTN")
    finally:
        mp.undo()
    model = engine.model_config
    assert model.kv_head_orders is None  # the oracle masks per layer and moves nothing
    assert [model.layer_swa_kv_heads(l) for l in range(2)] == [(1, 3), (0, 2)]
    return tokens


@pytest.mark.parametrize("mode", MODES)
def test_slot_mapped_paged_model_matches_the_per_layer_oracle(monkeypatch, unpermuted_oracle, mode):
    tokens, engine = generate(monkeypatch, "APPEND_ATTN", *MODES[mode])
    model = engine.model_config
    assert model.kv_head_orders is None  # no weight moves: the op's head -> slot map lines the heads up
    assert [model.layer_swa_kv_heads(l) for l in range(2)] == [(1, 3), (0, 2)]
    slots = engine.fd_config.slot_layout
    assert slots.num_lanes == 2 and slots.head_slots == ((0, 1, 2, 3), (1, 0, 3, 2))
    assert tokens == unpermuted_oracle
    if mode == "head_wise_recycle_on":
        assert engine.get_stats()["swa_pages_recycled_total"] > 0


def test_the_oracle_depends_on_which_heads_slide_in_each_layer(monkeypatch, unpermuted_oracle):
    """Without the per-layer slot map the paged model would slide layer 0's heads in every layer:
    that is a different model, so the comparison above can fail."""
    same_everywhere = dict(SPEC, swa_kv_heads=[1, 3])
    tokens, _ = generate(monkeypatch, "NATIVE_ATTN", spec=same_everywhere)
    assert tokens != unpermuted_oracle


UNEVEN = dict(SPEC, swa_kv_heads=[[0, 1, 2], []])


@pytest.fixture(scope="module")
def uneven_oracle():
    mp = pytest.MonkeyPatch()
    try:
        tokens, engine = generate(mp, "NATIVE_ATTN", *MODES["head_wise_recycle_on"], spec=UNEVEN)
    finally:
        mp.undo()
    assert all(len(t) == MAX_TOKENS for t in tokens)
    assert engine.model_config.swa_kv_heads == ()  # no head slides in every layer
    return tokens


@pytest.mark.parametrize("mode", MODES)
def test_an_uneven_pattern_is_served_by_slots_and_matches_the_oracle(monkeypatch, uneven_oracle, mode):
    """3 SWA pairs of 8 cannot share per-head slots: one lane holds both layers, 3 of its 8 slots slide
    (and recycle), the heads stay where the checkpoint has them."""
    tokens, engine = generate(monkeypatch, "APPEND_ATTN", *MODES[mode], spec=UNEVEN)
    slots = engine.fd_config.slot_layout
    assert (slots.num_lanes, slots.slots_per_rank, len(slots.sliding_slots)) == (1, 8, 3)
    assert engine.model_config.kv_head_orders is None
    assert tokens == uneven_oracle
    if mode == "head_wise_recycle_on":
        assert engine.get_stats()["swa_pages_recycled_total"] > 0
