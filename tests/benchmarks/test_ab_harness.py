"""benchmarks/ab_harness.py: the arms take turns in the order the A/B scripts rely on, and the summary
pairs each round's arms (a noisy round moves one ratio, not every arm's median)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import ab_harness as ab  # noqa: E402


def test_arms_take_turns_round_by_round_in_the_given_order_or_rotated():
    calls, between = [], []
    got = ab.take_turns(["a", "b", "c"], 3, lambda arm: calls.append(arm) or f"{arm}{len(calls)}",
                        between=lambda r, so_far: between.append((r, {k: len(v) for k, v in so_far.items()})))
    assert calls == ["a", "b", "c"] * 3
    assert got == {"a": ["a1", "a4", "a7"], "b": ["b2", "b5", "b8"], "c": ["c3", "c6", "c9"]}
    # After each round, every arm has run once more: a check or a paired measurement can follow it.
    assert between == [(r, {"a": r + 1, "b": r + 1, "c": r + 1}) for r in range(3)]

    calls.clear()
    ab.take_turns([1, 2], 4, calls.append, rotate=True)
    assert calls == [1, 2, 2, 1, 1, 2, 2, 1]  # two arms: neither always goes first
    assert [order for _, order in ab.turns("xyz", 4, rotate=True)] == [
        list("xyz"), list("yzx"), list("zxy"), list("xyz")]


def test_summary_pairs_the_rounds_and_the_lower_median_is_a_round():
    seconds = {"engine": [2.0, 1.0, 4.0], "base": [3.0, 6.0, 4.0]}
    s = ab.summary(seconds, "base")
    assert s["median"] == {"engine": 2.0, "base": 4.0}
    assert s["ratios"] == {"engine": [2 / 3, 1 / 6, 1.0]}  # round by round, not median over median
    assert ab.round_ratios(seconds, "base", "engine") == [1.5, 6.0, 1.0]
    assert ab.median([1.0, 3.0]) == 2.0 and ab.median([3.0, 1.0], lower=True) == 1.0
    assert ab.ratio_range([1.5, 6.0, 1.0]) == "1.50x (1.00-6.00)"
    assert ab.timed(lambda: None) >= 0


def test_table_columns_fit_their_widest_cell_and_json_lands_in_a_new_folder(tmp_path, capsys):
    rows = [{"arm": "off", "tok_s": 12.345}, {"arm": "on", "tok_s": 1234.5}]
    columns = [("arm", "arm", ""), ("tok/s", "tok_s", ".1f"), ("x off", lambda r: r["tok_s"] / 12.345, ".2f")]
    ab.print_table(rows, columns, title="speed")
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["", "speed", "arm   tok/s   x off", "-" * 19, "off    12.3    1.00", "on   1234.5  100.00"]
    ab.print_table(rows[:1], columns, markdown=True)
    assert capsys.readouterr().out.splitlines() == ["| arm | tok/s | x off |", "| --- | --- | --- |",
                                                    "| off | 12.3 | 1.00 |"]
    ab.write_json(str(tmp_path / "new" / "out.json"), rows)
    assert json.loads((tmp_path / "new" / "out.json").read_text()) == rows
    ab.write_json(None, rows)  # the --json flag unset: nothing written, no error

