"""Concurrency at equal KV memory, recycling OFF (1-D tables) vs ON (slots + recycling), through the real
config, cache manager and scheduler — no model runs: every step 'samples' one token per request.

    python benchmarks/bench_slot_concurrency.py --model gemma-3-270m --num-gpu-blocks 1536 \\
        --prompt-len 3968 --output-len 128 --num-requests 128 --json results/slots_gemma3.json

Prints each arm's slot layout, peak running requests and engine steps, next to the page-need ceiling
(pages one request holds in one-token steps, OFF / ON, from the one page-need function), and the pages
one request alone holds at its prefill peak and at its decode peak (counted in its tables, step by step).
"""

from __future__ import annotations

import argparse
import json
import os

from fastdeploy import envs
from fastdeploy.cache_manager.head_wise import PageLayout
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

ARMS = {"off": dict(FD_HEAD_WISE_KV_CACHE=0), "on": dict(FD_HEAD_WISE_KV_CACHE=1, FD_HEAD_WISE_SWA_RECYCLE=1)}


def pages_held_alone(cfg, args) -> dict:
    """Most pages one request holds while it runs alone: over its prefill chunks and its decode steps."""
    rm = ResourceManagerV1(cfg)
    request = Request("alone", [5 + j % 200 for j in range(args.prompt_len)],
                      SamplingParams(max_tokens=args.output_len, ignore_eos=True), eos_token_id=-1)
    rm.add_request(request)
    held = {"prefill": 0, "decode": 0}
    while rm.has_unfinished_requests():
        batch = rm.schedule()
        phase = "prefill" if batch.requests[0].num_tokens > 1 else "decode"
        tables = request.block_tables_head_wise or [request.block_tables] * cfg.slot_layout.num_slots
        held[phase] = max(held[phase], sum(page >= 0 for row in tables for page in row))
        rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
    return held


def run_arm(args, flags: dict) -> dict:
    with envs.override(**flags):
        cfg = EngineArgs(model=args.model, max_model_len=args.prompt_len + args.output_len, block_size=args.block_size,
                         num_gpu_blocks_override=args.num_gpu_blocks, max_num_seqs=args.num_requests,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         enable_prefix_caching=False).create_engine_config()
    rm = ResourceManagerV1(cfg)
    for i in range(args.num_requests):
        prompt = [5 + (i * 7 + j) % 200 for j in range(args.prompt_len)]
        rm.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=args.output_len, ignore_eos=True),
                               eos_token_id=-1))
    peak = steps = 0
    while rm.has_unfinished_requests():
        batch = rm.schedule()
        steps += 1
        peak = max(peak, len(rm.running))
        rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
        rm.cache_manager.check_integrity()
    # What one request holds once its prompt is in (one-token steps): the page-need ceiling's basis.
    need = max(PageLayout.from_config(cfg).peak_pages_per_rank(args.prompt_len, args.output_len, 1))
    return {"layout": cfg.slot_layout.describe(), "pages": rm.cache_manager.num_total_pages, "peak_running": peak,
            "engine_steps": steps, "pages_per_request": need, "recycled": rm.swa_pages_recycled_total,
            "chunk_limit": rm.max_chunk, "alone": pages_held_alone(cfg, args)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--num-gpu-blocks", type=int, default=1536)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=3968)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    res = {arm: run_arm(args, flags) for arm, flags in ARMS.items()}
    off, on = res["off"], res["on"]
    out = {"peak_running_off": off["peak_running"], "peak_running_on": on["peak_running"],
           "concurrency_gain": on["peak_running"] / off["peak_running"],
           "steps_off": off["engine_steps"], "steps_on": on["engine_steps"],
           "ceiling": off["pages_per_request"] / on["pages_per_request"],
           "prefill_peak_share": on["alone"]["prefill"] / off["alone"]["prefill"],
           "decode_peak_share": on["alone"]["decode"] / off["alone"]["decode"], "arms": res}
    for arm in ("off", "on"):
        r = res[arm]
        print(f"{arm:>3}: {r['layout']}; {r['pages']} pages, {r['pages_per_request']} per request (one-token steps); "
              f"peak running {r['peak_running']}, engine steps {r['engine_steps']}, pages recycled {r['recycled']}")
    print(f"concurrency OFF -> ON {out['concurrency_gain']:.2f}x (page-need ceiling {out['ceiling']:.2f}x), "
          f"engine steps {off['engine_steps']} -> {on['engine_steps']}")
    print(f"one request alone, ON / OFF pages: prefill peak {on['alone']['prefill']} / {off['alone']['prefill']} = "
          f"{out['prefill_peak_share']:.2f} (chunks of {on['chunk_limit']} / {off['chunk_limit']} tokens), "
          f"decode peak {on['alone']['decode']} / {off['alone']['decode']} = {out['decode_peak_share']:.2f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
