"""A window per sliding head under a page budget (fastdeploy/tools/window_menu.py, find_swa_windows.py).

- the dynamic program finds the least-harm choice within the budget (brute force over every choice of
  small random instances is the oracle), and never exceeds the budget;
- a pair's pages are the engine's page-need arithmetic for one slot of that window;
- on a tiny model with a planted retrieval head (it reads one early token from everywhere), the finder
  keeps that head full at every ceiling while the others slide, and its file meets each ceiling.
"""

import itertools
import json
import os

import numpy as np
import pytest

from fastdeploy.tools import window_menu


def _brute_force(harm: dict, pages: dict, budget: int, shape) -> float:
    options = [window_menu.FULL] + sorted(harm)
    cells = list(np.ndindex(*shape))
    best = float("inf")
    for pick in itertools.product(options, repeat=len(cells)):
        if sum(pages[w] for w in pick) > budget:
            continue
        best = min(best, sum(harm[w][c] for w, c in zip(pick, cells) if w))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_choose_windows_is_the_least_harm_choice_within_the_budget(seed):
    rng = np.random.default_rng(seed)
    shape = (2, 3)
    harm = {w: rng.random(shape) / w ** 0.5 for w in (8, 16, 32)}
    pages = {window_menu.FULL: 20, 8: 3, 16: 5, 32: 9}
    budget = int(rng.integers(3 * 6, 20 * 6))
    chosen = window_menu.choose_windows(harm, pages, budget)
    held = sum(pages[int(w)] for w in chosen.ravel())
    got = sum(harm[int(w)][c] for c, w in np.ndenumerate(chosen) if w)
    assert held <= budget
    assert got == pytest.approx(_brute_force(harm, pages, budget, shape), abs=1e-12)


def test_a_budget_below_every_pair_sliding_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="page budget of 5"):
        window_menu.choose_windows({8: np.zeros((1, 2))}, {window_menu.FULL: 10, 8: 3}, 5)


def test_a_pairs_pages_are_the_page_need_of_one_slot_of_its_window():
    from fastdeploy.cache_manager.head_wise import num_dead_blocks, table_length

    bs, sink, length = 64, 64, 4096
    assert window_menu.pair_pages(window_menu.FULL, sink, length, bs) == table_length(length, bs) == 64
    # a window-512 slot at the last decode step: the sink's block plus the blocks the window overlaps
    assert window_menu.pair_pages(512, sink, length, bs) == 64 - num_dead_blocks(length - 1, 512, sink, bs) == 9
    assert [window_menu.pair_pages(w, sink, length, bs) for w in (128, 256, 1024, 2048)] == [3, 5, 17, 33]


def test_scores_by_window_keep_a_planted_retrieval_head_full_at_every_ceiling(tmp_path):
    from fastdeploy.tools.head_scores import one_pass_scores_by_window
    from test_find_swa_heads import PLANT_HEAD, PLANT_LAYER, _native_llm, _segments, _write_model

    llm = _native_llm(_write_model(tmp_path / "planted", plant=True))
    by_window = one_pass_scores_by_window(llm, _segments(), (16, 32, 64), 16, log=lambda m: None)
    harm = {w: s["output_change"] for w, s in by_window.items()}
    pages = {w: window_menu.pair_pages(w, 16, 512, 16) for w in (window_menu.FULL, 16, 32, 64)}
    full = pages[window_menu.FULL] * harm[16].size
    for ceiling in (1.3, 1.6, 2.0):
        chosen = window_menu.choose_windows(harm, pages, int(full / ceiling))
        assert chosen[PLANT_LAYER, PLANT_HEAD] == window_menu.FULL, (ceiling, chosen)
        assert (chosen != window_menu.FULL).sum() >= 3  # the others slide to pay for it
    # the scores of one head compare across windows: a longer window loses fewer keys
    mass = [by_window[w]["outside_mass"] for w in (16, 32, 64)]
    assert np.all(mass[0] >= mass[1] - 1e-6) and np.all(mass[1] >= mass[2] - 1e-6)


def test_the_window_finder_writes_a_section_per_ceiling_that_meets_it(tmp_path):
    from test_find_swa_heads import _write_model

    model = _write_model(tmp_path / "plain", plant=False)
    from fastdeploy.tools.find_swa_windows import main

    out = tmp_path / "windows.json"
    assert main(["--model", model, "--windows", "16,32,64", "--sink", "16", "--segment-tokens", "200",
                 "--length", "512", "--block-size", "16", "--ceilings", "1.3,1.6", "--ceiling", "1.6",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    for ceiling, choice in doc["choices"].items():
        assert choice["ceiling"] >= float(ceiling)
        section = choice["head_wise_swa"]
        assert [len(w) for w in section["head_windows"]] == [len(h) for h in section["swa_kv_heads"]]
        held = sum(doc["pages_per_pair"][str(w)] for ws in section["head_windows"] for w in ws)
        held += doc["pages_per_pair"]["0"] * (8 - sum(len(h) for h in section["swa_kv_heads"]))
        assert held == choice["pages"]
    assert doc["head_wise_swa"] == doc["choices"]["1.6"]["head_wise_swa"]


def test_the_window_finder_refuses_calibration_text_shorter_than_the_largest_window(tmp_path, capsys):
    from fastdeploy.tools.find_swa_windows import main

    assert main(["--windows", "64,512", "--segment-tokens", "300", "--out", str(tmp_path / "x.json")]) != 0
    assert "--segment-tokens 300 must exceed" in capsys.readouterr().err


def test_a_pairs_peak_over_the_decode_is_the_page_need_of_its_slot_at_every_step():
    """decode_tokens: the most pages over the last steps, which for a window can come before the last step."""
    from fastdeploy.cache_manager.head_wise import table_length
    from fastdeploy.tools.window_menu import pair_pages

    bs, sink = 64, 64
    for window in (window_menu.FULL, 256, 512, 1000):
        steps = [pair_pages(window, sink, n + 1, bs) for n in range(3967, 4095)]
        assert pair_pages(window, sink, 4096, bs, decode_tokens=128) == max(steps)
    # window 1000 (not a block multiple): its count drops by one block right after a block edge
    assert pair_pages(1000, sink, 4096, bs, decode_tokens=128) > pair_pages(1000, sink, 4096, bs)
    assert pair_pages(window_menu.FULL, sink, 4096, bs, decode_tokens=128) == table_length(4096, bs)


def test_retrieval_scores_keep_a_head_that_reads_a_far_needle_where_text_alone_lets_it_slide(tmp_path):
    """Text without the planted token gives the planted head no reason to stay full; prompts with it far
    back, scored at their last queries only (the answer), do (find_swa_windows --retrieval-weight)."""
    from test_find_swa_heads import PLANT_HEAD, PLANT_LAYER, _native_llm, _segments, _write_model

    from fastdeploy.tools.find_swa_windows import combined_harm
    from fastdeploy.tools.head_scores import one_pass_scores_by_window

    llm = _native_llm(_write_model(tmp_path / "planted", plant=True))
    rng = np.random.default_rng(5)
    text = [rng.integers(40, 250, size=320).tolist() for _ in range(2)]  # never the planted token
    windows = (16, 32, 64)
    scores = {name: one_pass_scores_by_window(llm, segs, windows, 16, log=lambda m: None, last_queries=last)
              for name, segs, last in (("text", text, 0), ("retrieval", _segments(), 8))}
    text_harm, retrieval_harm = ({w: scores[name][w]["output_change"] for w in windows}
                                 for name in ("text", "retrieval"))
    assert int(np.argmax(retrieval_harm[16][PLANT_LAYER])) == PLANT_HEAD
    pages = {w: window_menu.pair_pages(w, 16, 512, 16) for w in (window_menu.FULL, *windows)}
    budget = int(pages[window_menu.FULL] * text_harm[16].size / 2.0)
    alone = window_menu.choose_windows(text_harm, pages, budget)
    both = window_menu.choose_windows(combined_harm(text_harm, retrieval_harm, 1.0), pages, budget)
    assert alone[PLANT_LAYER, PLANT_HEAD] != window_menu.FULL
    assert both[PLANT_LAYER, PLANT_HEAD] == window_menu.FULL


def test_the_window_finder_scores_calibration_retrieval_prompts_when_asked(tmp_path):
    from test_find_swa_heads import _write_model

    from fastdeploy.tools.find_swa_windows import main

    out = tmp_path / "windows.json"
    assert main(["--model", _write_model(tmp_path / "plain", plant=False), "--windows", "16,32,64", "--sink", "16",
                 "--segment-tokens", "200", "--length", "512", "--decode-tokens", "64", "--block-size", "16",
                 "--ceilings", "1.3", "--ceiling", "1.3", "--retrieval-weight", "1", "--retrieval-trials", "1",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    retrieval = doc["calibration"]["retrieval"]
    assert retrieval["split"] == "calibration" and retrieval["lengths"] == [384, 512]
    assert set(doc["retrieval_scores"]) == {"16", "32", "64"} and doc["choices"]["1.3"]["ceiling"] >= 1.3
    # the same scores choose again for another ceiling and weight without running the model
    again = tmp_path / "again.json"
    assert main(["--scores-from", str(out), "--windows", "16,32,64", "--sink", "16", "--segment-tokens", "200",
                 "--length", "512", "--decode-tokens", "64", "--block-size", "16", "--ceilings", "1.6",
                 "--ceiling", "1.6", "--retrieval-weight", "3", "--out", str(again)]) == 0
    redo = json.loads(again.read_text())
    assert redo["scores"] == doc["scores"] and redo["choices"]["1.6"]["ceiling"] >= 1.6


def test_choosing_again_from_scores_without_retrieval_scores_asks_for_them(tmp_path, capsys):
    from fastdeploy.tools.find_swa_windows import main

    prior = tmp_path / "prior.json"
    prior.write_text(json.dumps({"model": "m", "scores": {"64": {"output_change": [[0.1, 0.2]]}}}))
    assert main(["--scores-from", str(prior), "--windows", "64", "--sink", "16", "--segment-tokens", "200",
                 "--length", "512", "--block-size", "16", "--retrieval-weight", "1", "--out",
                 str(tmp_path / "x.json")]) != 0
    assert "has no retrieval scores" in capsys.readouterr().err
