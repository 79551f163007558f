"""Per-head windows (design §17) end to end: the tiny preset (2 layers, 4 KV heads) slides heads 1 and 3
of layer 0 with window 24 + sink 4 and heads 0 and 2 of layer 1 with window 48, no sink: two sliding types
on different layers (one lane of both layers, 8 slots: 4 full, 2 of each window). The paged engine gives
the dense NATIVE_ATTN oracle's greedy tokens in every memory mode, with each type's pages recycled by
its own window, through chunked prefill and preemption."""

import pytest

from greedy_run import MODES, greedy_tokens

from fastdeploy.cache_manager.slots import AttentionType

SPEC = {"sliding_window": 32, "sink_size": 0, "swa_kv_heads": [[1, 3], [0, 2]],
        "head_windows": [[24, 24], [48, 48]], "head_sinks": [[4, 4], [0, 0]]}
NARROW, WIDE = AttentionType(24, 4), AttentionType(48, 0)
PROMPT_LENGTHS = [7, 40, 130, 300]  # past both windows by up to ~12x
MAX_TOKENS = 16


def prompts():
    return [[3 + (i * 29 + n * 17 + (i * i) % 31) % 250 for i in range(n)] for n in PROMPT_LENGTHS]


def generate(monkeypatch, backend, head_wise="0", recycle="1", reserve="1", spec=SPEC, **engine_args):
    engine_args = {"block_size": 16, "max_model_len": 512, "max_num_seqs": 4, "num_gpu_blocks_override": 256,
                   **engine_args}
    return greedy_tokens(monkeypatch, prompts(), MAX_TOKENS, backend, head_wise, recycle, reserve,
                         head_wise_swa_config=spec, **engine_args)


@pytest.fixture(scope="module")
def oracle():
    mp = pytest.MonkeyPatch()
    try:
        tokens, _ = generate(mp, "NATIVE_ATTN")
    finally:
        mp.undo()
    return tokens


def record_recycled_slots(monkeypatch):
    """The slots whose pages the recycle step returns (the real cache manager, observed)."""
    from fastdeploy.cache_manager.prefix_cache_manager import PrefixCacheManager

    seen = set()
    real = PrefixCacheManager.free

    def free(self, rows, req_id=None, slots=None):
        if slots is not None:  # the recycle step frees some slots' rows; a release frees every row
            seen.update(s for s, pages in zip(slots, rows) if pages)
        return real(self, rows, req_id, slots)

    monkeypatch.setattr(PrefixCacheManager, "free", free)
    return seen


# Roomy: the whole batch at once; tight: chunks of 40 tokens and too few blocks for every request at once
# (on-demand admission, so decodes that outgrow the cache preempt). Recycling needs far fewer pages.
SHAPES = {"roomy": {}, "tight": {"reserve": "0", "max_num_batched_tokens": 40}}
TIGHT_BLOCKS = {"1d": 24, "head_wise_recycle_off": 24, "head_wise_recycle_on": 16}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", MODES)
def test_two_windows_on_different_layers_match_the_oracle_with_each_window_recycled(monkeypatch, oracle, mode,
                                                                                     shape):
    recycled = record_recycled_slots(monkeypatch)
    blocks = {"num_gpu_blocks_override": TIGHT_BLOCKS[mode]} if shape == "tight" else {}
    tokens, engine = generate(monkeypatch, "APPEND_ATTN", *MODES[mode], **SHAPES[shape], **blocks)
    assert tokens == oracle
    slots = engine.fd_config.slot_layout
    assert slots.num_lanes == 1 and slots.sliding_types == (NARROW, WIDE)
    stats = engine.get_stats()
    assert stats["kv_pages_free"] == stats["kv_pages_total"]
    if shape == "tight":
        assert stats["num_preemptions_total"] > 0
    if mode == "head_wise_recycle_on":
        assert recycled == set(slots.slots_of(NARROW)) | set(slots.slots_of(WIDE))  # both windows recycle
    else:
        assert not recycled


def test_the_oracle_depends_on_each_heads_window(monkeypatch, oracle):
    """Both layers with the wider window is a different model: the comparison above can fail."""
    one_window = {**SPEC, "head_windows": [[48, 48], [48, 48]]}
    tokens, _ = generate(monkeypatch, "NATIVE_ATTN", spec=one_window)
    assert tokens[:1] == oracle[:1]  # a prompt within both windows sees the same keys
    assert tokens[2:] != oracle[2:]
