"""Offline A/B: head-wise SWA recycling OFF vs ON at the same KV memory, through the real engine.

Both arms use the same model (the dense tiny preset, `--model tiny-moe`, a named real model such
as `--model smollm2-135m-instruct`, a .gguf file or a checkpoint directory) with identical settings and the same fixed-length prompts; the page
budget is sized so memory, not max_num_seqs, limits concurrency. Prints output tokens/s, peak
running requests, peak pages in use, the most pages one request held (any step, and once decoding),
engine steps, the gain next to the ceiling predicted by the page-need
function, and checks that both arms produced identical tokens.

    python benchmarks/bench_offline.py
    python benchmarks/bench_offline.py --model tiny-moe --num-prompts 32 --output-len 128
    python benchmarks/bench_offline.py --num-prompts 64 --input-len 2048 --output-len 256 --window 256
    python benchmarks/bench_offline.py --model smollm2-135m-instruct \
        --head-wise-swa-config '{"sliding_window": 256, "sink_size": 16, "swa_kv_heads": [0]}' \
        --num-prompts 48 --input-len 128 --output-len 512 --concurrency-off 16
    python benchmarks/bench_offline.py --model gemma-3-270m --block-size 64 --input-len 3968 --output-len 128 \
        --num-prompts 12 --concurrency-off 4 --max-num-batched-tokens 1024

A model trained with sliding layers (Gemma 3) slides by itself: without --window / --sink / --swa-heads /
--head-wise-swa-config no head-wise section is added, and the arms are the issue's A/B: OFF = 1-D
(FD_HEAD_WISE_KV_CACHE=0, every layer keeps every token, sliding layers masked), ON = slots + recycling.
Every other model runs head-wise tables in both arms, recycling off vs on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Optional

import numpy as np


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=str, default=None,
                   help="preset (tiny-moe), named real model (smollm2-135m-instruct), .gguf file or model "
                        "directory; default: the dense tiny preset")
    p.add_argument("--num-prompts", type=int, default=160,
                   help="several waves of both arms, so the steady state dominates")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--window", type=int, default=None,
                   help=f"head-wise SWA window (default {DEFAULT_SWA['sliding_window']})")
    p.add_argument("--sink", type=int, default=None, help=f"head-wise SWA sink (default {DEFAULT_SWA['sink_size']})")
    p.add_argument("--swa-heads", type=int, nargs="+", default=None,
                   help="SWA KV heads (the presets have 4, smollm2-135m-instruct 3; default 0)")
    p.add_argument("--head-wise-swa-config", type=str, default=None,
                   help='JSON {"sliding_window": W, "sink_size": S, "swa_kv_heads": [..]}, as the engine flag '
                        "takes it; replaces --window, --sink and --swa-heads")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--concurrency-off", type=int, default=32,
                   help="size the KV cache so the recycle-OFF arm fits this many requests")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, help="explicit KV blocks (overrides the above)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--cache-dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="default: float32 on the CPU, the compute dtype on the GPU")
    p.add_argument("--kv-cache-quant-type", choices=["none", "int8", "block_wise_fp8", "block_wise_int4"], default="none",
                   help="KV page format of both arms (8-bit pages + scales; the cache is still sized in blocks)")
    p.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--admission-policy", choices=["reserve", "on_demand", "projected"], default=None,
                   help="admission policy of both arms (default: FD_ADMISSION_POLICY, else the engine's default)")
    p.add_argument("--speculative-config", type=str, default=None,
                   help="both arms speculate with this --speculative-config (JSON): the recycling A/B with drafts")
    p.add_argument("--json", type=str, default=None, help="write the results (docs/benchmarks.md keys) here")
    p.add_argument("--plot", type=str, default=None,
                   help="write a PNG of running requests and pages in use per engine step, OFF vs ON, here")
    args = p.parse_args(argv)
    if args.head_wise_swa_config is not None:
        try:
            args.head_wise_swa_config = json.loads(args.head_wise_swa_config)
        except json.JSONDecodeError as exc:
            p.error(f"--head-wise-swa-config is not valid JSON: {exc}")
        if not isinstance(args.head_wise_swa_config, dict):
            p.error("--head-wise-swa-config must be a JSON object")
    return args


DEFAULT_SWA = {"sliding_window": 64, "sink_size": 16, "swa_kv_heads": [0]}


def model_slides_layers(args) -> bool:
    """The model has sliding layers of its own (Gemma 3's layer pattern, a config's layer_types)."""
    from fastdeploy.config import ModelConfig

    return ModelConfig.create(args.model, None, None).layer_sliding_window is not None


def sliding_layers_ab(args) -> bool:
    """The A/B of a model with its own sliding layers and no head-wise SWA asked for: OFF is 1-D."""
    asked = (args.head_wise_swa_config, args.window, args.sink, args.swa_heads)
    return all(a is None for a in asked) and model_slides_layers(args)


def swa_config(args) -> Optional[dict]:
    if args.head_wise_swa_config is not None:
        return args.head_wise_swa_config
    if args.sliding_layers:
        return None
    given = {"sliding_window": args.window, "sink_size": args.sink, "swa_kv_heads": args.swa_heads}
    return {k: DEFAULT_SWA[k] if v is None else v for k, v in given.items()}


def arm_flags(args, recycle: bool) -> dict:
    """FD_HEAD_WISE_KV_CACHE / FD_HEAD_WISE_SWA_RECYCLE of one arm."""
    if args.sliding_layers:
        return {"FD_HEAD_WISE_KV_CACHE": "1" if recycle else "0", "FD_HEAD_WISE_SWA_RECYCLE": "1"}
    return {"FD_HEAD_WISE_KV_CACHE": "1", "FD_HEAD_WISE_SWA_RECYCLE": "1" if recycle else "0"}


def engine_args(args) -> dict:
    cached = args.input_len + args.output_len - 1
    blocks = args.num_gpu_blocks_override or args.concurrency_off * math.ceil(cached / args.block_size)
    return dict(model=args.model, block_size=args.block_size, num_gpu_blocks_override=blocks,
                max_num_seqs=args.max_num_seqs,
                cache_dtype=args.cache_dtype, device=args.device, admission_policy=args.admission_policy,
                kv_cache_quant_type=args.kv_cache_quant_type,
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.input_len + args.output_len + args.block_size,
                head_wise_swa_config=swa_config(args), speculative_config=args.speculative_config)


def run_arm(name: str, recycle: bool, args, prompts) -> dict:
    from fastdeploy.engine.args_utils import EngineArgs
    from fastdeploy.engine.engine import LLMEngine
    from fastdeploy.engine.request import SamplingParams

    os.environ.update(arm_flags(args, recycle))
    engine = LLMEngine.from_engine_args(EngineArgs(**engine_args(args)))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engine.add_request("warmup", prompts[0][:8], SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished_requests():  # builds/loads the op outside the timed region
        engine.step()

    for i, prompt in enumerate(prompts):
        engine.add_request(f"{name}-{i}", prompt, params)
    total = engine.get_stats()["kv_pages_total"]
    tokens, peak_running, peak_pages, steps = {}, 0, 0, 0
    peak_per_request, peak_per_decoding, counting_s = 0, 0, 0.0
    timeline = []
    start = time.perf_counter()
    last_print = start
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs.token_ids
        t0 = time.perf_counter()  # the count is bookkeeping of this script: kept out of the timed region
        held = [(pages_held(engine, r), r.num_computed_tokens > r.num_prompt_tokens) for r in engine.scheduler.running]
        peak_per_request = max([peak_per_request] + [n for n, _ in held])
        peak_per_decoding = max([peak_per_decoding] + [n for n, decoding in held if decoding])
        counting_s += time.perf_counter() - t0
        s = engine.get_stats()
        used = total - s["kv_pages_free"]
        peak_running, peak_pages, steps = max(peak_running, s["num_requests_running"]), max(peak_pages, used), steps + 1
        now = time.perf_counter()
        timeline.append((now - start - counting_s, s["num_requests_running"], used))
        if now - last_print > 5:
            print(f"  [{name}] {len(tokens)}/{len(prompts)} done, running={s['num_requests_running']} "
                  f"pages_used={used}/{total}", file=sys.stderr, flush=True)
            last_print = now
    elapsed = time.perf_counter() - start - counting_s
    out_tokens = sum(len(t) for t in tokens.values())
    stats = engine.get_stats()
    # Time-averaged pages in use: each step's pages weighted by how long that step took.
    avg_pages = sum(used * (t - prev) for (t, _, used), prev in zip(timeline, [0.0] + [p[0] for p in timeline]))
    avg_pages /= elapsed
    return {"avg_pages": avg_pages, "median_full_step_s": median_full_step(timeline, peak_running),
            "recomputed_tokens": stats["recomputed_tokens_total"],
            "throughput": out_tokens / elapsed, "elapsed_s": elapsed, "output_tokens": out_tokens,
            "peak_running": peak_running, "peak_pages": peak_pages, "pages_total": total, "steps": steps,
            "peak_pages_per_request": peak_per_request, "peak_pages_per_decoding_request": peak_per_decoding,
            "swa_pages_recycled": stats["swa_pages_recycled_total"], "preemptions": stats["num_preemptions_total"],
            "spec_decode": {k: v for k, v in stats.items() if k.startswith("spec_decode_")},
            "tokens": [tokens[f"{name}-{i}"] for i in range(len(prompts))], "timeline": timeline}


def median_full_step(timeline: list, peak_running: int):
    """Median duration of the steps that ran at the arm's peak concurrency (mostly pure decode steps):
    the cost of one full step, robust to a noisy machine's bursts, unlike elapsed / steps, which also
    spreads the prefill and the half-empty steps between waves of requests over the steps."""
    times = [0.0] + [t for t, _, _ in timeline]
    full = [times[i + 1] - times[i] for i, (_, running, _) in enumerate(timeline) if running == peak_running]
    return float(np.median(full)) if full else None


def pages_held(engine, request) -> int:
    """Live pages a running request holds: its table entries that are not recycled (-1), one page per slot
    and block; in 1-D mode a block is a page of every slot."""
    return sum(engine.scheduler.kv_cache_manager.held_pages_per_slot(request.request_id))


def steps_gain_share(gain: float, steps_ratio: float):
    """How much of what recycling saves in engine steps reaches output tok/s (None: no steps saved)."""
    return (gain - 1) / (steps_ratio - 1) if steps_ratio > 1 else None


def write_plot(args, off: dict, on: dict, cfg) -> None:
    """Both arms step by step: what recycling does to the pool over a run (x = engine step, which, unlike
    seconds, does not depend on how busy the machine was)."""
    from ab_plot import ArmSeries, plot_running_and_pages

    names = ("1-D", "slots + recycling") if args.sliding_layers else ("recycle OFF", "recycle ON")
    arms = [ArmSeries(f"{name}: {r['steps']} steps", list(range(1, r["steps"] + 1)),
                      [running for _, running, _ in r["timeline"]], [used for _, _, used in r["timeline"]])
            for name, r in zip(names, (off, on))]
    model = args.model or "the tiny preset"
    title = (f"{model}: {args.num_prompts} requests of {args.input_len} + {args.output_len} tokens, "
             f"{off['pages_total']} pages in both arms")
    plot_running_and_pages(args.plot, title, arms, off["pages_total"], "engine step")


def main(argv=None) -> int:
    args = parse_args(argv)
    from fastdeploy.cache_manager.head_wise import predicted_concurrency
    from fastdeploy.engine.args_utils import EngineArgs

    try:
        args.sliding_layers = sliding_layers_ab(args)
        os.environ.update(arm_flags(args, True))
        cfg = EngineArgs(**engine_args(args)).create_engine_config()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    pred = predicted_concurrency(cfg, args.input_len, args.output_len)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, cfg.model_config.vocab_size, args.input_len).tolist() for _ in range(args.num_prompts)]
    swa = swa_config(args)
    if swa is not None:  # the JSON's args say what ran (simulate_serving.py --calibrate-offline reads them)
        args.window, args.sink, args.swa_heads = swa["sliding_window"], swa["sink_size"], swa["swa_kv_heads"]
    if args.sliding_layers:
        what = (f"the model's sliding layers, OFF = 1-D, ON = slots + recycling ({cfg.slot_layout.describe()})")
    else:
        what = (f"SWA heads {swa.get('swa_kv_heads')} of {cfg.model_config.num_key_value_heads} "
                f"W={swa.get('sliding_window')} S={swa.get('sink_size')}; slots {cfg.slot_layout.describe()}")
    print(f"workload: {args.num_prompts} prompts x (in {args.input_len}, out {args.output_len}); {what}; "
          f"{cfg.cache_config.num_gpu_blocks} blocks ({pred['pages_per_rank']} pages); predicted running "
          f"off={pred['running_off']} on={pred['running_on']}, pages per request at the peak (page-need function) "
          f"off={pred['peak_pages_off']} on={pred['peak_pages_on']}", file=sys.stderr, flush=True)

    off = run_arm("off", False, args, prompts)
    on = run_arm("on", True, args, prompts)
    gain = on["throughput"] / off["throughput"]
    ceiling = pred["ceiling"]
    target = 1 + 0.9 * (ceiling - 1)
    identical = off["tokens"] == on["tokens"]

    print(f"\nadmission policy: {cfg.admission_policy}; pages in use: peak and time-averaged, "
          f"% of {off['pages_total']}")
    print(f"{'arm':<14}{'out tok/s':>11}{'elapsed s':>11}{'peak running':>14}{'peak pages':>12}{'avg pages':>11}"
          f"{'pages/req':>11}{'decoding':>10}{'steps':>8}{'preemptions':>13}{'recomputed':>12}")
    for name, r in (("recycle OFF", off), ("recycle ON", on)):
        total = r["pages_total"]
        print(f"{name:<14}{r['throughput']:>11.1f}{r['elapsed_s']:>11.2f}{r['peak_running']:>14}"
              f"{r['peak_pages'] / total:>12.1%}{r['avg_pages'] / total:>11.1%}{r['peak_pages_per_request']:>11}"
              f"{r['peak_pages_per_decoding_request']:>10}{r['steps']:>8}{r['preemptions']:>13}"
              f"{r['recomputed_tokens']:>12}")

    def share(key):
        return on[key] / off[key] if off[key] else 0.0

    print(f"pages/req: the most pages one running request held after a step, any step (ON/OFF "
          f"{share('peak_pages_per_request'):.1%}; page-need function {pred['peak_pages_on']}/{pred['peak_pages_off']}) "
          f"and once its prompt is in (decoding: ON/OFF {share('peak_pages_per_decoding_request'):.1%})"
          + ("; OFF = 1-D (FD_HEAD_WISE_KV_CACHE=0), ON = slots + recycling" if args.sliding_layers else ""))
    print(f"\ngain ON/OFF = {gain:.3f}   ceiling = {ceiling:.3f}   target (1 + 0.9 x (ceiling - 1)) = {target:.3f}"
          f"   -> {'met' if gain >= target else 'NOT met'}")
    print(f"peak running ratio = {on['peak_running'] / off['peak_running']:.3f} (predicted "
          f"{pred['running_on']}/{pred['running_off']}); identical tokens in both arms: {identical}; "
          f"SWA pages recycled OFF {off['swa_pages_recycled']}, ON {on['swa_pages_recycled']}")
    if on["spec_decode"]:
        print("speculation: " + "; ".join(
            f"{name} accepted {r['spec_decode']['spec_decode_num_accepted_tokens_total']}/"
            f"{r['spec_decode']['spec_decode_num_draft_tokens_total']} drafts, "
            f"{r['spec_decode']['spec_decode_mean_accepted_length']:.2f} tokens per verification step"
            for name, r in (("OFF", off), ("ON", on))))
    # gain = (steps OFF / steps ON) x (mean step time OFF / mean step time ON): the first factor is
    # what recycling buys, the second is what a bigger batch costs per step on this machine.
    steps_ratio = off["steps"] / on["steps"]
    step_time_ratio = (on["elapsed_s"] / on["steps"]) / (off["elapsed_s"] / off["steps"])
    print(f"gain = steps ratio OFF/ON {steps_ratio:.3f} / mean step time ratio ON/OFF {step_time_ratio:.3f} "
          f"({(on['elapsed_s'] / on['steps']) * 1e3:.1f} vs {(off['elapsed_s'] / off['steps']) * 1e3:.1f} ms); "
          f"the step-time factor is ~1 only where a step's cost does not grow with the batch")
    share = steps_gain_share(gain, steps_ratio)
    if share is not None:
        print(f"tok/s gain is {share:.0%} of the engine-steps gain ((gain - 1) / (steps ratio - 1))")
    full_step_ratio = None
    if on["median_full_step_s"] and off["median_full_step_s"]:
        full_step_ratio = on["median_full_step_s"] / off["median_full_step_s"]
        print(f"median step at each arm's peak concurrency: ON/OFF {full_step_ratio:.3f} "
              f"({on['median_full_step_s'] * 1e3:.1f} vs {off['median_full_step_s'] * 1e3:.1f} ms): what one full step "
              f"costs more with {on['peak_running']} rows than with {off['peak_running']}")

    if args.plot:
        write_plot(args, off, on, cfg)
    if args.json:
        result = {"throughput_off": off["throughput"], "throughput_on": on["throughput"], "gain": gain,
                  "ceiling": ceiling, "target": target, "peak_running_off": off["peak_running"],
                  "peak_running_on": on["peak_running"], "peak_pages_off": off["peak_pages"],
                  "peak_pages_on": on["peak_pages"], "steps_off": off["steps"], "steps_on": on["steps"],
                  "peak_pages_per_request_off": off["peak_pages_per_request"],
                  "peak_pages_per_request_on": on["peak_pages_per_request"],
                  "peak_pages_per_decoding_request_off": off["peak_pages_per_decoding_request"],
                  "peak_pages_per_decoding_request_on": on["peak_pages_per_decoding_request"],
                  "predicted_pages_per_request_off": pred["peak_pages_off"],
                  "predicted_pages_per_request_on": pred["peak_pages_on"],
                  "off_arm": "1-D" if args.sliding_layers else "head-wise, recycle off",
                  "slot_layout": cfg.slot_layout.describe(),
                  "admission_policy": cfg.admission_policy, "pages_total": off["pages_total"],
                  "avg_pages_off": off["avg_pages"], "avg_pages_on": on["avg_pages"],
                  "preemptions_off": off["preemptions"], "preemptions_on": on["preemptions"],
                  "recomputed_tokens_off": off["recomputed_tokens"], "recomputed_tokens_on": on["recomputed_tokens"],
                  "steps_ratio": steps_ratio, "step_time_ratio": step_time_ratio,
                  "median_full_step_s_off": off["median_full_step_s"], "median_full_step_s_on": on["median_full_step_s"],
                  "median_full_step_ratio": full_step_ratio,
                  "gain_share_of_steps_gain": share,
                  "swa_pages_recycled_off": off["swa_pages_recycled"],
                  "swa_pages_recycled_on": on["swa_pages_recycled"],
                  "spec_decode_off": off["spec_decode"], "spec_decode_on": on["spec_decode"],
                  "identical_tokens": identical, "args": vars(args)}
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
