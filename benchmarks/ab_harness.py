"""The skeleton of the benchmarks that compare arms of the real engine in one process: the arms take
turns round by round, and each arm's median and the per-round ratios between arms are reported.

Why turns: a shared machine drifts (the same 2048^3 numpy GEMM gave 141-188 GFLOP/s on these 2 cores in
one day), and one run per arm can land in different phases of it. Within a round the arms run back to
back, so machine noise hits them alike; the median hides a bad round, and the range of the per-round
ratios shows how far the noise moved the comparison.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


def turns(arms, rounds: int, rotate: bool = False):
    """(round, the arms in that round's order) for every round. With `rotate` the order shifts by one
    each round (two arms: A B, B A, A B...), so that each arm takes every place of the order in turn:
    none always runs first, or always in the state (caches, clocks) one particular place leaves."""
    arms = list(arms)
    for r in range(rounds):
        shift = r % len(arms) if rotate else 0
        yield r, arms[shift:] + arms[:shift]


def take_turns(arms, rounds: int, run, rotate: bool = False, between=None) -> dict:
    """arm -> [run(arm) of every round], the arms taking turns; `between(round, the results so far)` runs
    after each round (a progress line, a check, another measurement to pair with the round)."""
    got = {arm: [] for arm in arms}
    for r, order in turns(arms, rounds, rotate):
        for arm in order:
            got[arm].append(run(arm))
        if between is not None:
            between(r, got)
    return got


def timed(fn, clock=time.perf_counter) -> float:
    """Seconds one call of fn takes (by `clock`: wall time, or e.g. time.thread_time for CPU time)."""
    start = clock()
    fn()
    return clock() - start


def run_requests(engine, prompts: dict, params) -> dict:
    """Add every prompt (request id -> token ids) at once and step the engine until all finish, as an arm
    runs a job: {"outputs": the final output of each request in prompts' order, "first": id -> (wall, CPU)
    clocks at its first output, "start" and "end" (wall), "steps": engine steps}."""
    start, first, final, steps = time.perf_counter(), {}, {}, 0
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, (time.perf_counter(), time.process_time()))
            if out.finished:
                final[out.request_id] = out
        steps += 1
    return {"outputs": [final[r] for r in prompts], "first": first, "start": start, "end": time.perf_counter(),
            "steps": steps}


def median(values, lower: bool = False) -> float:
    """The median; `lower`: the median round itself (of an even count, the lower one), so that numbers
    taken from that round (its tokens, its fractions) belong to the time reported."""
    return float(sorted(values)[(len(values) - 1) // 2]) if lower else float(statistics.median(values))


def round_ratios(per_round: dict, arm, base) -> list:
    """arm's value over base's, round by round (the two ran back to back in each round)."""
    return [a / b for a, b in zip(per_round[arm], per_round[base])]


def summary(per_round: dict, base) -> dict:
    """{"median": arm -> median, "ratios": arm -> per-round ratios to base} of arm -> per-round values."""
    return {"median": {arm: median(v) for arm, v in per_round.items()},
            "ratios": {arm: round_ratios(per_round, arm, base) for arm in per_round if arm != base}}


def ratio_range(ratios: list) -> str:
    """'1.23x (1.10-1.31)': the median per-round ratio and the range of the rounds."""
    return f"{median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def print_table(rows: list, columns: list, title: str = "", markdown: bool = False) -> None:
    """rows: dicts; columns: (header, key, format spec) each, the key a field of the row or a function of
    it. Every column is as wide as its widest cell, the first left-aligned and the rest right-aligned; or
    a markdown table, to paste into the docs."""
    if title:
        print(f"\n{title}")
    cells = [[h for h, _, _ in columns]] + [[format(key(row) if callable(key) else row[key], spec)
                                            for _, key, spec in columns] for row in rows]
    if markdown:
        for k, line in enumerate(cells):
            print(f"| {' | '.join(line)} |" + ("\n|" + " --- |" * len(line) if k == 0 else ""))
        return
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    for k, line in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        if k == 0:
            print("-" * (sum(widths) + 2 * (len(widths) - 1)))


def log(message: str) -> None:
    """A progress line on stderr, stamped with the script's name and the time."""
    print(f"[{os.path.basename(sys.argv[0]).removesuffix('.py')} {time.strftime('%H:%M:%S')}] {message}",
          file=sys.stderr, flush=True)


def save_figure(fig, path) -> None:
    """A matplotlib figure to path as PNG (laid out tight, its folder made first), then closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_json(path, data, indent: int = 2) -> None:
    """data to path as JSON, its folder made first (nothing without a path: the --json flag unset)."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=indent, default=str)
