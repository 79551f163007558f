"""A window per sliding head: `python -m fastdeploy.tools.find_swa_windows --model M --windows 256,512,1024,2048
--sink S --ceilings 1.5,1.7,2.0 --length 4096 --out FILE`.

Scores every (layer, KV head) under every window of the menu in one pass over calibration text (the
engine's dense reference, full attention; head_scores.py, on the queries past sink + the largest window),
then, for each page-need ceiling, chooses each pair's window or full attention so that a request of
`--length` tokens holds at most 1/ceiling of full attention's pages over its last `--decode-tokens` decode
steps, with the least summed score (window_menu.py). With `--retrieval-weight`, each pair's score adds
that weight times its score on the calibration split's retrieval prompts (retrieval_tasks.py: needles at
depths 0.05-0.95, only the question and answer queries scored), each score over its own mean: a head that
reads a far needle keeps its keys even where text barely needs them. Writes one servable `head_wise_swa`
section per ceiling (per-layer heads with `head_windows`), the `--ceiling` one as the file's
`head_wise_swa`, and the scores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from fastdeploy.tools import json_tool, window_menu
from fastdeploy.tools.calibration_text import CALIBRATION_SHARE, calibration_text, token_segments
from fastdeploy.tools.find_swa_heads import DEFAULT_SCORER, calibration_engine
from fastdeploy.tools.head_scores import ONE_PASS_SCORERS, one_pass_scores_by_window


def _numbers(text: str, flag: str, kind):
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r} must be numbers separated by commas") from None
    if not values:
        raise ValueError(f"{flag} is empty")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model directory or name (default: the tiny preset)")
    p.add_argument("--windows", default="256,512,1024,2048", help="the window menu, tokens")
    p.add_argument("--sink", type=int, default=64, help="attention sink S in tokens (every sliding head)")
    p.add_argument("--ceilings", default="1.5,1.7,2.0",
                   help="page-need ceilings to choose for (full attention's pages / the choice's, once decoding)")
    p.add_argument("--ceiling", type=float, default=1.7, help="the ceiling whose section is the file's head_wise_swa")
    p.add_argument("--length", type=int, default=4096, help="request length (prompt + output) the ceiling is for")
    p.add_argument("--decode-tokens", type=int, default=1,
                   help="the ceiling counts a pair's most pages over this many last decode steps (128: a request "
                        "of length - 128 prompt tokens and 128 output tokens, over its whole decode)")
    p.add_argument("--retrieval-weight", type=float, default=0.0,
                   help="weight of the calibration retrieval score next to the text score (0: text only)")
    p.add_argument("--retrieval-trials", type=int, default=2,
                   help="calibration retrieval prompts per variant, length and depth")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--scorer", choices=ONE_PASS_SCORERS, default=DEFAULT_SCORER)
    p.add_argument("--segments", type=int, default=1, help="calibration segments")
    p.add_argument("--segment-tokens", type=int, default=3072, help="tokens per calibration segment")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="prefill chunk of the engine")
    p.add_argument("--scores-from", default=None, metavar="FILE",
                   help="take the scores of an earlier run's output instead of running the model (choose again "
                        "with other ceilings, weights or lengths)")
    p.add_argument("--out", required=True, help="JSON file to write")
    return p.parse_args(argv)


def find(args, log=print) -> dict:
    windows = sorted(set(_numbers(args.windows, "--windows", int)))
    ceilings = sorted(set(_numbers(args.ceilings, "--ceilings", float)) | {args.ceiling})
    if windows[0] < 1 or args.sink < 0:
        raise ValueError("--windows must be >= 1 and --sink >= 0")
    if any(c < 1 for c in ceilings):
        raise ValueError("--ceilings must be >= 1 (1 = full attention's pages)")
    if args.segment_tokens <= args.sink + windows[-1]:
        raise ValueError(f"--segment-tokens {args.segment_tokens} must exceed sink + the largest window "
                         f"({args.sink + windows[-1]}): the scores compare windows on the queries past it")
    if args.length <= args.sink + windows[0]:
        raise ValueError(f"--length {args.length} is within sink + the smallest window: nothing would recycle")
    if args.decode_tokens < 1 or args.decode_tokens >= args.length:
        raise ValueError("--decode-tokens must be at least 1 and below --length")
    t0 = time.time()
    if args.scores_from:
        model_name, by_window, retrieval = earlier_scores(args, windows)
    else:
        llm = calibration_engine(args.model, max(args.segment_tokens, args.length), args.max_num_batched_tokens)
        cfg = llm.engine.model_config
        model_name = cfg.served_model_name
        segments = token_segments(llm.engine.tokenizer, calibration_text(), args.segment_tokens, args.segments)
        log(f"[find_swa_windows] {model_name}: {cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} KV heads, "
            f"windows {windows}, sink {args.sink}, {args.segments} x {args.segment_tokens} calibration tokens "
            f"(loaded in {time.time() - t0:.0f} s)")
        by_window = one_pass_scores_by_window(llm, segments, windows, args.sink, log)
        retrieval = retrieval_scores(llm, windows, args, log) if args.retrieval_weight else None
        llm.engine.close()
    harm = {w: by_window[w][args.scorer] for w in windows}
    if args.retrieval_weight:
        harm = combined_harm(harm, {w: retrieval[w][args.scorer] for w in windows}, args.retrieval_weight)
    layers, kv_heads = harm[windows[0]].shape
    pages = {w: window_menu.pair_pages(w, args.sink, args.length, args.block_size, args.decode_tokens)
             for w in [window_menu.FULL] + windows}
    full_pages = pages[window_menu.FULL] * layers * kv_heads
    choices = {}
    for c in ceilings:
        chosen = window_menu.choose_windows(harm, pages, int(full_pages / c))
        held = sum(pages[int(w)] for w in chosen.ravel())
        counts = {str(w): int((chosen == w).sum()) for w in [window_menu.FULL] + windows}
        choices[f"{c:g}"] = {"head_wise_swa": window_menu.section(chosen, args.sink), "pages": held,
                             "ceiling": round(full_pages / held, 4), "pairs_by_window": counts,
                             "summed_score": float(sum(harm[int(w)][i, h] for (i, h), w in np.ndenumerate(chosen)
                                                       if w))}
        log(f"[find_swa_windows] ceiling {c:g}: {held}/{full_pages} pages ({full_pages / held:.3f}x), "
            f"pairs by window {counts}")
    log(f"[find_swa_windows] done in {time.time() - t0:.0f} s")
    return {
        "model": model_name,
        "head_wise_swa": choices[f"{args.ceiling:g}"]["head_wise_swa"],
        "ceiling": args.ceiling,
        "choices": choices,
        "scorer": args.scorer,
        "scores": {str(w): {name: np.round(s, 8).tolist() for name, s in by_window[w].items()} for w in windows},
        "retrieval_scores": None if retrieval is None else {
            str(w): {name: np.round(s, 8).tolist() for name, s in retrieval[w].items()} for w in windows},
        "pages_per_pair": {str(w): p for w, p in pages.items()},
        "length": args.length, "decode_tokens": args.decode_tokens, "block_size": args.block_size,
        "windows": windows, "sink": args.sink,
        "calibration": {"text": f"pydoc_data.topics, first {CALIBRATION_SHARE:.0%} of the characters",
                        "segments": args.segments, "segment_tokens": args.segment_tokens,
                        "retrieval": None if retrieval is None else {
                            "split": "calibration", "weight": args.retrieval_weight, "trials": args.retrieval_trials,
                            "depths": list(RETRIEVAL_DEPTHS), "lengths": retrieval_lengths(args, windows)}},
    }


def earlier_scores(args, windows) -> tuple:
    """(model, text scores by window, retrieval scores by window or None) of an earlier run's output file."""
    with open(args.scores_from, encoding="utf-8") as f:
        doc = json.load(f)

    def arrays(section):
        return None if section is None else {int(w): {k: np.asarray(v) for k, v in s.items()} for w, s in section.items()}

    text, retrieval = arrays(doc["scores"]), arrays(doc.get("retrieval_scores"))
    missing = sorted(set(windows) - set(text))
    if missing:
        raise ValueError(f"{args.scores_from} has no scores for window(s) {missing} (it scored {sorted(text)})")
    if args.retrieval_weight and retrieval is None:
        raise ValueError(f"{args.scores_from} has no retrieval scores: run the model with --retrieval-weight once")
    if args.model and args.model != doc["model"]:
        raise ValueError(f"{args.scores_from} holds the scores of {doc['model']}, not of --model {args.model}")
    return doc["model"], text, retrieval


RETRIEVAL_DEPTHS = (0.05, 0.25, 0.5, 0.75, 0.95)
ANSWER_QUERIES = 16  # a retrieval prompt's last queries: its question and the answer's first words


def retrieval_lengths(args, windows) -> list:
    """Prompt lengths of the calibration retrieval prompts: past sink + the largest window (shorter ones
    lose nothing to any window of the menu), up to the request length."""
    shortest = args.sink + max(windows) + ANSWER_QUERIES + 256
    return sorted({max(shortest, (3 * args.length) // 4), args.length})


def retrieval_scores(llm, windows, args, log) -> dict:
    """{window: both one-pass scores} on the calibration split's retrieval prompts, their answer queries only."""
    from fastdeploy.tools.retrieval_tasks import VARIANTS, RetrievalTask

    task = RetrievalTask(llm.engine.tokenizer, "calibration")
    prompts = task.prompts(VARIANTS["calibration"], retrieval_lengths(args, windows), RETRIEVAL_DEPTHS,
                           args.retrieval_trials, seed=0)
    log(f"[find_swa_windows] retrieval scores over {len(prompts)} calibration prompts")
    return one_pass_scores_by_window(llm, [p["ids"] for p in prompts], windows, args.sink, log,
                                     last_queries=ANSWER_QUERIES)


def combined_harm(text: dict, retrieval: dict, weight: float) -> dict:
    """{window: text score / its mean + weight x retrieval score / its mean} (means over every pair and
    window): the two scores on one scale, whatever their units."""
    def mean(scores):
        return float(np.mean([s for s in scores.values()])) or 1.0

    t, r = mean(text), mean(retrieval)
    return {w: text[w] / t + weight * retrieval[w] / r for w in text}


def main(argv=None) -> int:
    return json_tool.run("find_swa_windows", parse_args(argv), find)


if __name__ == "__main__":
    sys.exit(main())
