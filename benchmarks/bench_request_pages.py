"""Pages one request holds over its life, step by step, with FD_HEAD_WISE_KV_CACHE off (1-D tables) and on
(per-head / per-slot tables with recycling), through a named model's real config, cache manager and
scheduler; no model runs (each step 'samples' one token).

    python benchmarks/bench_request_pages.py --plot docs/images/request_pages.png

With the flag off a request keeps every token of every KV head until it ends. With it on, a sliding head's
(or sliding layer's) pages that leave its window go back to the free lists while the request runs, and any
request may take them. `gemma-3-270m` slides five of its six layers (its own, window 512);
`smollm2-135m-instruct` slides 59 of its 90 (layer, KV head) pairs, each with its own window from 256 to
2048 tokens, sink 64 (its calibrated configuration). Counted from the tables after every step: a 1-D block
is one page of every slot, and a page holds one slot of every lane, so the curves count pages x lanes. With
`--head-wise-swa-config` (for instance a per-head window menu: `head_windows`) every model serves that spec
instead; each sliding type recycles with its own window. Every step's count is checked against the
page-need function (PageLayout.pages_per_rank), so the curve is also the one admission plans with.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, REPO_ROOT)  # runs from a checkout without installing

from fastdeploy import envs  # noqa: E402
from fastdeploy.engine.args_utils import EngineArgs  # noqa: E402
from fastdeploy.engine.request import Request, SamplingParams  # noqa: E402
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1  # noqa: E402

ARMS = {"flag off (1-D)": dict(FD_HEAD_WISE_KV_CACHE=0),
        "flag on (recycling)": dict(FD_HEAD_WISE_KV_CACHE=1, FD_HEAD_WISE_SWA_RECYCLE=1)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gemma-3-270m", "smollm2-135m-instruct"],
                   help="named models, presets or model paths (one panel each)")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="prefill chunk; at most the window, so no chunk limit of the scheduler changes the curve")
    p.add_argument("--head-wise-swa-config", default=None,
                   help="JSON head_wise_swa section served by every model (default: each model's own)")
    p.add_argument("--json", default=None, help="write every step's (tokens, pages) of each model and arm here")
    p.add_argument("--plot", default=None, help="write a PNG of pages held against tokens processed here")
    return p.parse_args(argv)


def pages_over_life(model: str, flags: dict, args) -> dict:
    """Run one request alone to its end; after each step record the tokens it has processed and the pages
    its tables hold."""
    total = args.prompt_len + args.output_len
    with envs.override(**flags):
        cfg = EngineArgs(model=model, max_model_len=total, block_size=args.block_size,
                         head_wise_swa_config=args.head_wise_swa_config,
                         num_gpu_blocks_override=math.ceil(total / args.block_size) + 2, max_num_seqs=1,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         enable_prefix_caching=False).create_engine_config()
    rm = ResourceManagerV1(cfg)
    request = Request("one", [5 + j % 200 for j in range(args.prompt_len)],
                      SamplingParams(max_tokens=args.output_len, ignore_eos=True), eos_token_id=-1)
    rm.add_request(request)
    tokens, pages = [0], [0]
    while rm.has_unfinished_requests():
        batch = rm.schedule()
        # Counted after schedule(): the pages the step runs with (recycled ones already returned), against
        # the tokens the request has once the step is done.
        pages.append(sum(rm.kv_cache_manager.held_pages_per_slot("one")))
        step = batch.requests[0]
        tokens.append(step.start + step.num_tokens)
        if cfg.head_wise_kv_cache and pages[-1] != sum(rm.layout.pages_per_rank(step.start, step.num_tokens)):
            raise AssertionError(f"{model}: the tables hold {pages[-1]} pages at {step.start} + {step.num_tokens}, "
                                 f"the page-need function says {rm.layout.pages_per_rank(step.start, step.num_tokens)}")
        rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
        rm.cache_manager.check_integrity()
    # A page is one slot in every lane: the two arms' pages differ in size where their lane counts differ
    # (SmolLM2's window menu: one lane of 90 slots against 1-D's 30 lanes of 3), so what is compared is
    # pages x lanes, the (layer, KV head) blocks held.
    lanes = cfg.slot_layout.num_lanes
    held = [p * lanes for p in pages]
    return {"layout": cfg.slot_layout.describe(), "tokens": tokens, "pages": pages, "pair_blocks": held,
            "prefill_peak": max(p for t, p in zip(tokens, held) if t <= args.prompt_len),
            "end": held[-1], "peak": max(held)}


def write_plot(path: str, results: dict, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.6 * len(results), 3.6), squeeze=False)
    for ax, (model, arms) in zip(axes[0], results.items()):
        (off_name, off), (on_name, on) = arms.items()
        ax.step(off["tokens"], off["pair_blocks"], where="pre", color="tab:gray", label=off_name)
        ax.step(on["tokens"], on["pair_blocks"], where="pre", color="tab:blue",
                label=f"{on_name}: {on['end'] / off['end']:.0%} of off at the end")
        ax.axvline(args.prompt_len, color="black", linestyle=":", linewidth=1)
        ax.text(args.prompt_len, 2, " prompt in: decoding", fontsize=7, va="bottom")
        slots = on["layout"][on["layout"].rfind("(") + 1:-1]  # "1 full, 5 window 512 + sink 0"
        ax.set_title(f"{model}\n" + textwrap.fill(f"slots per block, flag on: {slots}", 60), fontsize=8)
        ax.set_xlabel("tokens the request has processed")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=7)
    axes[0][0].set_ylabel("KV the request holds\n(blocks of one layer's KV head)")
    fig.suptitle(f"One request of {args.prompt_len} + {args.output_len} tokens "
                 f"(block {args.block_size}, prefill chunks of {args.max_num_batched_tokens})", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    results = {}
    for model in args.models:
        try:
            results[model] = {arm: pages_over_life(model, flags, args) for arm, flags in ARMS.items()}
        except ValueError as exc:
            print(f"error: {model}: {exc}", file=sys.stderr)
            return 2
        (_, off), (_, on) = results[model].items()
        print(f"{model}: {on['layout']}")
        print(f"  (layer, KV head) blocks held, flag off -> on: prefill peak {off['prefill_peak']} -> {on['prefill_peak']} "
              f"({on['prefill_peak'] / off['prefill_peak']:.0%}), at the end {off['end']} -> {on['end']} "
              f"({on['end'] / off['end']:.0%}), steps {len(off['tokens']) - 1}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "models": results}, f)
    if args.plot:
        write_plot(args.plot, results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
