"""Concurrency at equal KV memory, recycling OFF (1-D tables) vs ON (slots + recycling), through the real
config, cache manager and scheduler — no model runs: every step 'samples' one token per request.

    python benchmarks/bench_slot_concurrency.py --model gemma-3-270m --num-gpu-blocks 1536 \\
        --prompt-len 3968 --output-len 128 --num-requests 128 --json results/slots_gemma3.json
    python benchmarks/bench_slot_concurrency.py --model smollm2-135m-instruct --kv-cache-memory 1073741824 \\
        --kv-cache-quant-types none int8 --prompt-len 3968 --output-len 128 --num-requests 128

Prints each arm's slot layout, peak running requests and engine steps, next to the page-need ceiling
(pages one request holds in one-token steps, OFF / ON, from the one page-need function), and the pages
one request alone holds at its prefill peak and at its decode peak (counted in its tables, step by step).
With --kv-cache-memory the arms get the blocks those bytes hold, so --kv-cache-quant-types (the page
formats of --kv-cache-quant-type) compare at equal memory: every format runs OFF and ON, and the table
gives each arm's running requests against float32-OFF's (the compounded multiplier). A named model with
a calibrated head_wise_swa section (smollm2-135m-instruct) serves it in the ON arm, as it ships, or the
configuration --head-wise-swa-config gives (JSON or one of the model's named configurations).
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
        held[phase] = max(held[phase], sum(rm.kv_cache_manager.held_pages_per_slot("alone")))
        rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
    return held


def run_arm(args, flags: dict, quant: str = "none") -> dict:
    sizing = dict(num_gpu_blocks_override=args.num_gpu_blocks) if args.kv_cache_memory is None else \
        dict(kv_cache_memory=args.kv_cache_memory)
    with envs.override(**flags):
        cfg = EngineArgs(model=args.model, max_model_len=args.prompt_len + args.output_len, block_size=args.block_size,
                         max_num_seqs=args.num_requests, max_num_batched_tokens=args.max_num_batched_tokens,
                         enable_prefix_caching=False, kv_cache_quant_type=quant,
                         head_wise_swa_config=args.head_wise_swa_config if flags["FD_HEAD_WISE_KV_CACHE"] else None,
                         **sizing).create_engine_config()
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
    return {"layout": cfg.slot_layout.describe(), "kv_cache_quant_type": quant,
            "blocks": cfg.cache_config.num_gpu_blocks, "pages": rm.cache_manager.num_total_pages,
            "page_bytes": cfg.cache_config.block_bytes(cfg.model_config, 1) // cfg.slot_layout.slots_per_rank,
            "peak_running": peak, "engine_steps": steps, "pages_per_request": need,
            "recycled": rm.kv_cache_manager.swa_pages_recycled_total, "cut_chunk": rm.cut_chunk,
            "cut_steps": rm.cut_chunk_steps_total, "alone": pages_held_alone(cfg, args)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--num-gpu-blocks", type=int, default=1536)
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes of KV cache of every arm instead of --num-gpu-blocks (equal memory across formats)")
    p.add_argument("--kv-cache-quant-types", nargs="+", default=["none"], choices=["none", "int8", "block_wise_fp8", "block_wise_int4"],
                   help="page formats; each runs OFF and ON (the first one fills the top-level JSON keys)")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=3968)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--head-wise-swa-config", default=None,
                   help="the ON arm's configuration: JSON, or a named model's calibrated configuration by name "
                        "(default: what the model serves with FD_HEAD_WISE_KV_CACHE=1)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    runs = {q: {arm: run_arm(args, flags, q) for arm, flags in ARMS.items()} for q in args.kv_cache_quant_types}
    res = runs[args.kv_cache_quant_types[0]]
    off, on = res["off"], res["on"]
    out = {"peak_running_off": off["peak_running"], "peak_running_on": on["peak_running"],
           "concurrency_gain": on["peak_running"] / off["peak_running"],
           "steps_off": off["engine_steps"], "steps_on": on["engine_steps"],
           # in bytes: a page is one slot of every lane, and the two arms' layouts may differ in lanes
           "ceiling": off["pages_per_request"] * off["page_bytes"] / (on["pages_per_request"] * on["page_bytes"]),
           "prefill_peak_share": on["alone"]["prefill"] * on["page_bytes"] / (off["alone"]["prefill"] * off["page_bytes"]),
           "decode_peak_share": on["alone"]["decode"] * on["page_bytes"] / (off["alone"]["decode"] * off["page_bytes"]),
           "arms": res}
    for arm in ("off", "on"):
        r = res[arm]
        print(f"{arm:>3}: {r['layout']}; {r['pages']} pages, {r['pages_per_request']} per request (one-token steps); "
              f"peak running {r['peak_running']}, engine steps {r['engine_steps']}, pages recycled {r['recycled']}, "
              f"steps with chunks cut to {r['cut_chunk']} tokens {r['cut_steps']}")
    print(f"concurrency OFF -> ON {out['concurrency_gain']:.2f}x (page-need ceiling {out['ceiling']:.2f}x), "
          f"engine steps {off['engine_steps']} -> {on['engine_steps']}")
    print(f"one request alone, ON / OFF KV bytes: prefill peak {on['alone']['prefill']} x {on['page_bytes']} / "
          f"{off['alone']['prefill']} x {off['page_bytes']} = {out['prefill_peak_share']:.2f} (alone, nothing waits: "
          f"chunks of {args.max_num_batched_tokens} tokens), decode peak {on['alone']['decode']} x {on['page_bytes']} / "
          f"{off['alone']['decode']} x {off['page_bytes']} = {out['decode_peak_share']:.2f}")
    if len(runs) > 1 or args.kv_cache_memory is not None:
        base = off["peak_running"]
        print(f"\nat equal KV memory ({args.kv_cache_memory or 'blocks'} bytes), against the first format's OFF arm")
        print(f"{'pages':<16}{'arm':<5}{'page bytes':>11}{'pages':>8}{'pages/request':>15}{'running':>9}{'steps':>8}"
              f"{'x running':>11}")
        out["formats"] = {}
        for q, arms in runs.items():
            for arm, r in arms.items():
                r["running_x"] = r["peak_running"] / base
                print(f"{q:<16}{arm:<5}{r['page_bytes']:>11}{r['pages']:>8}{r['pages_per_request']:>15}"
                      f"{r['peak_running']:>9}{r['engine_steps']:>8}{r['running_x']:>10.2f}x")
            out["formats"][q] = arms
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
