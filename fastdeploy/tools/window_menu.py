"""A window per sliding head from a small menu, under a page budget (MoA's question on our retention rule).

Each (layer, KV head) pair either stays full or slides with one window of the menu (one sink for all).
A pair's cost is the pages it holds for one request of `length` tokens once decoding (the engine's own
page-need arithmetic, cache_manager/head_wise.py, for a slot of that type); its harm is a
score per window from the one-pass scorers (head_scores.py: `output_change` by default, measured on the
same queries for every window, so the windows of one head compare; full attention's harm is 0). The
choice is the multiple-choice knapsack: least summed harm with the summed pages at most
`full pages / ceiling`, solved exactly by dynamic programming over whole pages.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

FULL = 0  # the window of a pair that keeps every key


def pair_pages(window: int, sink: int, length: int, block_size: int, decode_tokens: int = 1) -> int:
    """Most pages one (layer, KV head) pair holds over the last `decode_tokens` decode steps of a request of
    `length` tokens (1: its last step); window 0 = full attention. A sliding pair's count rises and falls by
    a block as its window crosses block edges, so a request's peak can be before its last step."""
    from fastdeploy.cache_manager.head_wise import num_dead_blocks, table_length

    # PageLayout.pages_needed(n, 1) of one slot at each step computing token n
    return max(table_length(n + 1, block_size) - (num_dead_blocks(n, window, sink, block_size) if window else 0)
               for n in range(length - decode_tokens, length))


def choose_windows(harm: dict, pages: dict, budget: int) -> np.ndarray:
    """Window of every pair (int [layers, heads], FULL = full) of least summed harm within `budget` pages.

    harm: {window: [layers, heads] array} (FULL may be absent: its harm is 0); pages: {window: pages of one
    pair}, FULL included. Raises ValueError when even the cheapest choice of every pair exceeds the budget.
    """
    options = sorted(set(harm) | {FULL})
    shape = next(iter(harm.values())).shape
    cost = {w: int(pages[w]) for w in options}
    if min(cost.values()) * int(np.prod(shape)) > budget:
        raise ValueError(f"a page budget of {budget} is below every pair sliding with the cheapest window "
                         f"({min(cost.values())} pages each): lower the ceiling or add a smaller window")
    pairs = [(layer, head) for layer in range(shape[0]) for head in range(shape[1])]
    inf = float("inf")
    best = np.full(budget + 1, inf)  # best[b]: least harm of the pairs so far using exactly b pages
    best[0] = 0.0
    picks = []
    for layer, head in pairs:
        nxt = np.full(budget + 1, inf)
        pick = np.zeros(budget + 1, dtype=np.int64)
        for w in options:
            c = cost[w]
            h = 0.0 if w == FULL else float(harm[w][layer, head])
            if c > budget:
                continue
            cand = np.full(budget + 1, inf)
            cand[c:] = best[:budget + 1 - c] + h
            better = cand < nxt
            nxt[better], pick[better] = cand[better], w
        best = nxt
        picks.append(pick)
    b = int(np.argmin(best))
    chosen = np.zeros(shape, dtype=np.int64)
    for (layer, head), pick in zip(reversed(pairs), reversed(picks)):
        w = int(pick[b])
        chosen[layer, head] = w
        b -= cost[w]
    return chosen


def section(chosen: np.ndarray, sink: int) -> dict:
    """The servable `head_wise_swa` section of a window choice: per-layer sliding heads with their windows
    (`sliding_window` = the most common window, the one a head without its own entry would take)."""
    heads = [[int(h) for h in np.flatnonzero(row)] for row in chosen]
    windows = [[int(row[h]) for h in hs] for row, hs in zip(chosen, heads)]
    counts = Counter(w for ws in windows for w in ws)
    if not counts:
        raise ValueError("the window choice slides no head")
    return {"sliding_window": counts.most_common(1)[0][0], "sink_size": int(sink), "swa_kv_heads": heads,
            "head_windows": windows}
