"""Find which KV heads can slide: `python -m fastdeploy.tools.find_swa_heads --model M --window W
--sink S --swa-heads-per-layer K --out FILE`.

Runs the engine (dense reference backend, full attention) over calibration text from
`pydoc_data.topics` (calibration_text.py), scores every (layer, KV head) (head_scores.py) and writes
JSON with a `head_wise_swa` section — the K lowest-scoring heads of every layer, servable with
FD_HEAD_WISE_KV_CACHE=1 — plus `global_ranking` (the same total count chosen over the whole model,
uneven per layer: evaluable, not servable) and every scorer's scores.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from fastdeploy.tools import json_tool, swa_patterns
from fastdeploy.tools.calibration_text import CALIBRATION_SHARE, calibration_text, token_segments
from fastdeploy.tools.head_scores import ONE_PASS_SCORERS, ablation_kl_scores, one_pass_scores

SCORERS = ONE_PASS_SCORERS + ("ablation_kl",)
# The scorer whose choice the evaluation preferred on SmolLM2-135M-Instruct (docs/swa_quality.md).
DEFAULT_SCORER = "output_change"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="model directory or name (default: the tiny preset)")
    p.add_argument("--window", type=int, required=True, help="sliding window W in tokens")
    p.add_argument("--sink", type=int, default=16, help="attention sink S in tokens")
    p.add_argument("--swa-heads-per-layer", type=int, required=True, help="K: KV heads that slide in every layer")
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--scorer", choices=SCORERS, default=DEFAULT_SCORER,
                   help=f"the scorer whose choice goes into head_wise_swa (default {DEFAULT_SCORER})")
    p.add_argument("--ablation", action="store_true",
                   help="also compute ablation_kl (one pass per (layer, head): slow)")
    p.add_argument("--segments", type=int, default=2, help="calibration segments")
    p.add_argument("--segment-tokens", type=int, default=2048, help="tokens per calibration segment")
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="prefill chunk of the engine")
    return p.parse_args(argv)


def calibration_engine(model, segment_tokens: int, max_num_batched_tokens: int):
    """The engine the scorers probe: full attention on the dense reference backend (which carries
    per-(layer, head) masks and the probe), one request at a time."""
    os.environ["FD_ATTENTION_BACKEND"] = "NATIVE_ATTN"
    os.environ["FD_HEAD_WISE_KV_CACHE"] = "0"
    from fastdeploy import LLM

    return LLM(model=model, max_model_len=segment_tokens + 8, max_num_seqs=1,
               max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False)


def find(args, log=print) -> dict:
    """Scores and the chosen heads as the JSON document the command writes."""
    if args.window < 1 or args.sink < 0:
        raise ValueError("--window must be >= 1 and --sink >= 0")
    if args.segment_tokens <= args.window + args.sink:
        raise ValueError(f"--segment-tokens {args.segment_tokens} must exceed window + sink "
                         f"({args.window + args.sink}): shorter text never reaches a key a sliding head loses")
    t0 = time.time()
    llm = calibration_engine(args.model, args.segment_tokens, args.max_num_batched_tokens)
    cfg = llm.engine.model_config
    num_layers, num_kv = cfg.num_hidden_layers, cfg.num_key_value_heads
    if not 1 <= args.swa_heads_per_layer <= num_kv:
        raise ValueError(f"--swa-heads-per-layer must be in [1, {num_kv}] (the model's KV heads)")
    segments = token_segments(llm.engine.tokenizer, calibration_text(), args.segment_tokens, args.segments)
    log(f"[find_swa_heads] {cfg.served_model_name}: {num_layers} layers x {num_kv} KV heads, "
        f"{args.segments} x {args.segment_tokens} calibration tokens, window {args.window}, sink {args.sink} "
        f"(loaded in {time.time() - t0:.0f} s)")
    scores = one_pass_scores(llm, segments, args.window, args.sink, log)
    if args.ablation or args.scorer == "ablation_kl":
        scores["ablation_kl"] = ablation_kl_scores(llm, segments, args.window, args.sink, log)
    llm.engine.close()

    k = args.swa_heads_per_layer
    choices = {name: {"per_layer": swa_patterns.lowest_per_layer(s, k),
                      "global": swa_patterns.lowest_global(s, k * num_layers)} for name, s in scores.items()}
    chosen = choices[args.scorer]
    log(f"[find_swa_heads] done in {time.time() - t0:.0f} s; {args.scorer} per layer: {chosen['per_layer']}")
    return {
        "model": cfg.served_model_name,
        "head_wise_swa": swa_patterns.section(chosen["per_layer"], args.window, args.sink),
        "global_ranking": {"head_wise_swa": swa_patterns.section(chosen["global"], args.window, args.sink),
                           "servable": swa_patterns.is_even(chosen["global"])},
        "scorer": args.scorer,
        "swa_heads_per_layer": k,
        "scores": {name: np.round(s, 8).tolist() for name, s in scores.items()},
        "choices": choices,
        "calibration": {"text": f"pydoc_data.topics, first {CALIBRATION_SHARE:.0%} of the characters",
                        "segments": args.segments, "segment_tokens": args.segment_tokens},
        "window": args.window, "sink": args.sink,
    }


def main(argv=None) -> int:
    return json_tool.run("find_swa_heads", parse_args(argv), find)

if __name__ == "__main__":
    sys.exit(main())
