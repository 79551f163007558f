"""The retention rule and page-need arithmetic, checked against brute force over the SWA definition."""

import itertools
from dataclasses import replace

import pytest

from fastdeploy.cache_manager.head_wise import (
    PageLayout,
    cdiv,
    dead_block_range,
    first_window_block,
    num_dead_blocks,
    page_id,
    page_location,
    predicted_concurrency,
    sink_blocks,
    table_length,
    tokens_to_kill_block,
)
from fastdeploy.cache_manager.slots import AttentionType


def visible(j, t, window, sink):
    """docs/retention_rule.md: query t of a SWA head sees key j."""
    return j <= t and (j < sink or j > t - window)


def brute_dead_blocks(n, window, sink, bs):
    """Blocks (among those holding tokens [0, n)) no future query t >= n can see, by enumeration."""
    dead = []
    horizon = n + window + bs + 2  # beyond this, a later query sees strictly less
    for i in range(cdiv(n, bs)):
        keys = range(i * bs, (i + 1) * bs)
        if not any(visible(j, t, window, sink) for j in keys for t in range(n, horizon)):
            dead.append(i)
    return dead


@pytest.mark.parametrize("bs", [1, 4, 16])
def test_dead_blocks_match_brute_force_over_windows_sinks_and_lengths(bs):
    for window, sink, n in itertools.product([1, 3, 4, 5, 16, 17, 40], [0, 1, 3, 4, 5, 16, 21], range(0, 70)):
        got = list(dead_block_range(n, window, sink, bs))
        assert got == brute_dead_blocks(n, window, sink, bs), (n, window, sink, bs)
        assert num_dead_blocks(n, window, sink, bs) == len(got)


def test_tokens_to_kill_block_is_the_inverse_of_first_window_block():
    for block, window, bs in itertools.product(range(6), [1, 3, 16, 17], [1, 4, 16]):
        n = tokens_to_kill_block(block, window, bs)
        assert first_window_block(n, window, bs) > block >= first_window_block(n - 1, window, bs)


def test_window_longer_than_sequence_kills_nothing():
    assert num_dead_blocks(100, 1000, 0, 16) == 0


def test_window_smaller_than_a_block():
    # n=64, W=3: keys 62, 63 are still visible; blocks 0..2 are dead, block 3 holds 62 and 63.
    assert list(dead_block_range(64, 3, 0, 16)) == [0, 1, 2]


def test_sink_not_block_aligned_keeps_the_partial_sink_block():
    # S=5 with bs=4: tokens 0..4 are sink, so blocks 0 and 1 stay; the dead range starts at block 2.
    assert sink_blocks(5, 4) == 2
    assert list(dead_block_range(40, 4, 5, 4)) == list(range(2, first_window_block(40, 4, 4)))


def test_page_ids_round_trip_through_block_and_head():
    for block, head in itertools.product(range(5), range(4)):
        assert page_location(page_id(block, head, 4), 4) == (block, head)


def layout(swa_kv_heads=(0,), window=6, sink=2, **kw):
    """Four slots, `swa_kv_heads` of them sliding with one window and sink."""
    base = dict(block_size=4, num_slots=4, tensor_parallel_size=1, recycle=True)
    base.update(kw)
    return PageLayout(**base, sliding=((AttentionType(window, sink), tuple(swa_kv_heads)),))


def test_pages_needed_for_chunked_steps_counts_only_live_blocks():
    lay = layout()
    # Step computing [20, 28): the table covers 7 blocks; at n=20 blocks 1 and 2 are dead (sink block 0
    # is kept, and block 3 holds key 15, which query 20 still sees with W=6).
    assert list(dead_block_range(20, 6, 2, 4)) == [1, 2]
    assert lay.pages_needed(20, 8) == (7, 5)
    # Full heads and non-recycling layouts need the whole table.
    assert replace(lay, recycle=False).pages_needed(20, 8) == (7, 7)
    assert lay.pages_needed(0, 1) == (1, 1)


def test_pages_per_rank_splits_heads_across_ranks():
    lay = layout(tensor_parallel_size=2, swa_kv_heads=(0, 3))
    full, rec = lay.pages_needed(40, 1)
    assert lay.pages_per_rank(40, 1) == [full + rec, full + rec]
    lay = layout(tensor_parallel_size=2, swa_kv_heads=(0, 1))
    assert lay.pages_per_rank(40, 1) == [2 * rec, 2 * full]


def brute_peak(lay, prompt, max_new, chunk):
    """Max per-rank need over every step end point of both phases (no block_size shortcut)."""
    peak = [0] * lay.tensor_parallel_size
    shapes = [(max(0, e - chunk), e - max(0, e - chunk)) for e in range(1, prompt + 1)]
    shapes += [(n, 1) for n in range(prompt, prompt + max_new - 1)]
    for n, c in shapes:
        peak = [max(a, b) for a, b in zip(peak, lay.pages_per_rank(n, c))]
    return peak


@pytest.mark.parametrize("recycle", [True, False])
def test_peak_pages_shortcut_equals_brute_force(recycle):
    for prompt, max_new, chunk, window, sink in itertools.product(
            [1, 5, 17, 40], [1, 2, 9, 33], [1, 3, 8, 64], [1, 5, 8, 13], [0, 3, 8]):
        lay = layout(window=window, sink=sink, recycle=recycle, tensor_parallel_size=2, swa_kv_heads=(0, 1, 2))
        assert lay.peak_pages_per_rank(prompt, max_new, chunk) == brute_peak(lay, prompt, max_new, chunk), \
            (prompt, max_new, chunk, window, sink)


def test_peak_bounds_any_real_chunking():
    lay = layout(window=7, sink=3)
    prompt, max_new, chunk = 45, 20, 8
    peak = lay.peak_pages_per_rank(prompt, max_new, chunk)[0]
    for first in range(1, chunk + 1):  # every split of the prompt into a short first chunk, then full ones
        n, seen = 0, 0
        sizes = [first] + [chunk] * prompt
        for size in sizes:
            if n >= prompt:
                break
            c = min(size, prompt - n)
            seen = max(seen, lay.pages_per_rank(n, c)[0])
            n += c
        for n in range(prompt, prompt + max_new - 1):
            seen = max(seen, lay.pages_per_rank(n, 1)[0])
        assert seen <= peak


def test_the_cut_chunk_is_the_window_in_whole_blocks_wherever_heads_recycle():
    # A cut chunk holds the window rounded up to whole blocks (6 -> 8 with 4-token blocks), never below
    # one block and never above the budget, in every layout with a recycling head.
    assert layout(swa_kv_heads=(0, 1, 2)).cut_chunk(2048) == 8
    assert layout(swa_kv_heads=(0, 1, 2)).cut_chunk(5) == 5
    assert layout(swa_kv_heads=(0, 1, 2), window=1).cut_chunk(2048) == 4
    assert layout(swa_kv_heads=(0,)).cut_chunk(2048) == 8  # a minority of sliding heads too
    assert layout(tensor_parallel_size=2, swa_kv_heads=(0, 2)).cut_chunk(2048) == 8
    # Nothing recycles: a cut would free nothing, so the budget is the only chunk.
    assert layout(swa_kv_heads=(0, 1, 2), recycle=False).cut_chunk(2048) == 2048
    # The cut lowers a long prompt's peak to about twice the window per recycling head.
    mostly = layout(swa_kv_heads=(0, 1, 2))
    assert mostly.peak_pages_per_rank(64, 4, 8) < mostly.peak_pages_per_rank(64, 4, 64)


def test_the_chunk_rule_cuts_only_when_the_cut_lets_more_requests_run():
    lay = layout(swa_kv_heads=(0, 1, 2))
    asked = []

    def running_with(counts):
        return lambda chunk: asked.append(chunk) or counts[chunk]

    assert lay.chunk_for(2048, running_with({8: 3, 2048: 2})) == 8
    assert lay.chunk_for(2048, running_with({8: 2, 2048: 2})) == 2048  # pages to spare: no cut
    assert lay.chunk_for(2048, running_with({8: 0, 2048: 0})) == 2048  # nothing the cut would admit
    assert set(asked) == {8, 2048}
    # No recycling head: the budget without asking.
    asked.clear()
    assert layout(swa_kv_heads=(0,), recycle=False).chunk_for(2048, running_with({})) == 2048 and not asked


def test_table_length_is_ceiling_division():
    assert [table_length(n, 4) for n in range(0, 10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


def test_predicted_concurrency_ceiling_for_one_swa_head_of_four(make_config):
    cfg = make_config("head_wise_recycle_on", num_gpu_blocks_override=4000, max_num_seqs=256, max_model_len=8192,
                      max_num_batched_tokens=256,
                      head_wise_swa_config={"sliding_window": 64, "sink_size": 0, "swa_kv_heads": [0]})
    pred = predicted_concurrency(cfg, 4096, 1024)
    # Long context: the SWA head holds a few pages, the 3 full heads hold ~320 each -> ~4/3.
    assert pred["running_on"] > pred["running_off"] >= 1
    assert 1.25 <= pred["ceiling"] <= 4 / 3
