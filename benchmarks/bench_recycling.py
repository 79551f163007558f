"""What head-wise SWA page recycling buys: recycling OFF vs ON at the same KV memory, on one of four engines.

    python benchmarks/bench_recycling.py --engine dry --model gemma-3-270m --num-gpu-blocks-override 1536
    python benchmarks/bench_recycling.py --engine dry --one-request --plot docs/images/request_pages.png
    python benchmarks/bench_recycling.py --engine dry --tp-placements
    python benchmarks/bench_recycling.py --engine sim --table --json sim.json
    python benchmarks/bench_recycling.py --engine offline --model smollm2-135m-instruct --num-prompts 24
    python benchmarks/bench_recycling.py --engine server --config benchmarks/yaml/swa_1of4.yaml

dry      the real scheduler and KV cache manager, no model (fastdeploy/engine/sched/driver.py): exact page
         counts, independent of the machine; a step is one unit of time, so "throughput" is output tokens per
         step. --one-request: the pages one request holds over its life (one panel per --model);
         --tp-placements: per-rank ceilings over tensor-parallel degrees and SWA-head placements.
sim      the same scheduler on a virtual clock, each step timed by a roofline model of a GPU (serving_sim/):
         one scenario, --table (the report table) or --sliding-layers (models trained with sliding layers).
offline  the real engine on this machine (the LLM API): both arms must produce identical tokens.
server   the real api_server, started once per arm, driven over HTTP by benchmark_serving.py, /metrics sampled.

Both arms run the same fixed-length workload at the same KV memory: OFF = head-wise tables without
recycling (FD_HEAD_WISE_SWA_RECYCLE=0), ON = recycling; a model with sliding layers of its own and no
head-wise section asked for (Gemma 3) runs OFF as 1-D (FD_HEAD_WISE_KV_CACHE=0). Every engine reports the
A/B keys of docs/benchmarks.md (throughput_off/on, gain, ceiling: the running ratio the page-need function
predicts, peak_running_off/on) in --json, and draws running requests and pages in use with --plot.
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, REPO)  # runs from a checkout without installing

from ab_harness import log, print_table, save_figure, write_json  # noqa: E402,F401  (write_json: serving_sim/cli.py's too)
from fastdeploy import envs  # noqa: E402

ENGINES = ("dry", "sim", "offline", "server")
QUANT_TYPES = ("none", "int8", "block_wise_fp8", "block_wise_int4", "k8v4")
# Each engine's defaults where the shared options are not given (sim: serving_sim/report.py's table workload).
DEFAULTS = {
    "dry": dict(model=["gemma-3-270m"], num_prompts=128, input_len=3968, output_len=128, block_size=64,
                max_num_batched_tokens=2048, num_gpu_blocks_override=1536),
    "offline": dict(model=[None], num_prompts=160, input_len=256, output_len=512, block_size=16,
                    max_num_batched_tokens=512, concurrency_off=32, max_num_seqs=256),
    "server": dict(model=[None]),
    "sim": dict(model=[None]),
    # --one-request: one request of 2048 + 2048 tokens of each named model (README's picture)
    "one_request": dict(model=["gemma-3-270m", "smollm2-135m-instruct"], num_prompts=1, input_len=2048,
                        output_len=2048, block_size=64, max_num_batched_tokens=512, concurrency_off=1),
    # --tp-placements: the simulator's seed workload on four KV heads, the cache sized so OFF fits 39 requests
    "tp": dict(model=[None], input_len=10600, output_len=4096, block_size=64, max_num_batched_tokens=2048,
               concurrency_off=39, window=4096, sink=64, num_prompts=1),
}
DEFAULT_SWA = {"sliding_window": 64, "sink_size": 16, "swa_kv_heads": [0]}  # offline and server, a model without one


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=ENGINES, default="dry")
    m = p.add_argument_group("model, cache and scheduler (both arms)")
    m.add_argument("--model", nargs="+", default=None,
                   help="named model, preset, .gguf file or directory (dry --one-request: several, a panel each; "
                        "sim: --model-config)")
    m.add_argument("--block-size", type=int)
    m.add_argument("--num-gpu-blocks-override", "--num-gpu-blocks", type=int, help="KV blocks of both arms")
    m.add_argument("--concurrency-off", type=int, help="size the cache so the OFF arm fits this many requests")
    m.add_argument("--kv-cache-memory", type=int, help="KV bytes of both arms (equal memory across page formats)")
    m.add_argument("--kv-cache-quant-types", nargs="+", choices=QUANT_TYPES, default=["none"],
                   help="page formats; each runs OFF and ON (dry, offline: the first; dry compares them all)")
    m.add_argument("--max-num-seqs", type=int)
    m.add_argument("--max-num-batched-tokens", type=int)
    m.add_argument("--admission-policy", "--admission", dest="admission_policy", default=None,
                   help="reserve, on_demand or projected (sim: a comma-separated list, 'both' or 'all', a row each)")
    m.add_argument("--head-wise-swa-config", default=None,
                   help="the ON arm's heads: JSON, or one of a named model's calibrated configurations by name; "
                        "replaces --window / --sink / --swa-heads")
    m.add_argument("--window", type=int)
    m.add_argument("--sink", type=int)
    m.add_argument("--swa-heads", type=int, nargs="+", help="KV heads that slide (sim: how many, the first N)")
    m.add_argument("--tensor-parallel-size", type=int)
    m.add_argument("--balance-swa-heads", action="store_const", const=True)
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int)
    w.add_argument("--input-len", type=int)
    w.add_argument("--output-len", type=int)
    w.add_argument("--request-rate", type=float, help="sim, server: Poisson arrivals per second (default inf)")
    w.add_argument("--range-ratio", type=float, help="sim: lengths drawn in len * (1 +- ratio)")
    w.add_argument("--max-concurrency", type=int, help="server: benchmark_serving's --max-concurrency")
    w.add_argument("--seed", type=int, default=None)
    d = p.add_argument_group("dry")
    d.add_argument("--one-request", action="store_true", help="the pages one request holds over its life")
    d.add_argument("--tp-placements", action="store_true",
                   help="per-rank ceilings: --tensor-parallel-sizes x 1 or 2 SWA heads of 4 x load order or balanced")
    d.add_argument("--tensor-parallel-sizes", type=int, nargs="+", default=[1, 2, 4])
    s = p.add_argument_group("sim (serving_sim/)")
    s.add_argument("--table", action="store_true", help="the report table (ERNIE-4.5-21B-A3B, A800 and H200)")
    s.add_argument("--sliding-layers", action="store_true", help="Gemma-3-27B and gpt-oss-20b shapes, A800 and H200")
    s.add_argument("--model-config", help="config.json or a directory holding one (default ERNIE-4.5-21B-A3B)")
    s.add_argument("--hardware")
    s.add_argument("--gpu-memory-utilization", type=float)
    s.add_argument("--max-model-len", type=int)
    s.add_argument("--bw-efficiency", type=float)
    s.add_argument("--flops-efficiency", type=float)
    s.add_argument("--overhead-ms", type=float, default=3.0, help="fixed per-step overhead")
    s.add_argument("--attention", choices=("skip", "masked"), default="skip",
                   help="keys a SWA head's kernel reads: skip (ours) or masked (upstream's 1-D kernel)")
    s.add_argument("--max-sim-prompts", type=int, default=100,
                   help="simulate at most max(this, 2.5 x predicted concurrency) prompts, extrapolate the rest; 0: all")
    s.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    o = p.add_argument_group("offline and server")
    o.add_argument("--device", choices=["auto", "gpu", "cpu"], default="auto")
    o.add_argument("--cache-dtype", choices=["float32", "bfloat16", "float16"], default=None)
    o.add_argument("--speculative-config", default=None, help="both arms speculate with this (JSON)")
    o.add_argument("--config", default=None, help="server: YAML with server: and workload: sections")
    o.add_argument("--port", type=int, default=None)
    o.add_argument("--startup-timeout", type=float, default=300.0)
    o.add_argument("--log-dir", default=None)
    out = p.add_argument_group("output")
    out.add_argument("--json", default=None, help="write the results (docs/benchmarks.md keys) here")
    out.add_argument("--plot", default=None, help="write a PNG of running requests and pages in use here")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    which = "tp" if args.tp_placements else "one_request" if args.one_request else args.engine
    for key, value in DEFAULTS[which].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.head_wise_swa_config and args.head_wise_swa_config.lstrip().startswith("{"):
        try:
            args.head_wise_swa_config = json.loads(args.head_wise_swa_config)
        except json.JSONDecodeError as exc:
            parser.error(f"--head-wise-swa-config is not valid JSON: {exc}")
    return args


# -- the two arms -------------------------------------------------------------------------------
def model_slides_layers(model: Optional[str]) -> bool:
    """The model has sliding layers of its own (Gemma 3's pattern, a config's layer_types)."""
    from fastdeploy.config import ModelConfig

    return ModelConfig.create(model, None, None).layer_sliding_window is not None


def flag_off_arm(args, model: Optional[str]) -> bool:
    """Whether OFF is the flag off (1-D, FD_HEAD_WISE_KV_CACHE=0, full attention as trained): always in the
    dry engine (what the flag buys), elsewhere where the model's own sliding layers are compared. Otherwise
    both arms serve the same sliding heads and OFF only keeps their pages (the same tokens in both)."""
    asked = (args.head_wise_swa_config, args.window, args.sink, args.swa_heads) != (None,) * 4
    return args.engine == "dry" or (not asked and model_slides_layers(model))


def swa_spec(args, model: Optional[str], recycle: bool = True):
    """The head-wise section an arm serves: the one asked for; in the dry engine's ON arm, else the model's
    own (sliding layers, or a named model's calibrated section, which FD_HEAD_WISE_KV_CACHE=1 serves); a
    default one sliding head for the other engines on a model without sliding layers."""
    if flag_off_arm(args, model):
        return args.head_wise_swa_config if recycle else None
    if args.head_wise_swa_config is not None:
        return args.head_wise_swa_config
    given = {"sliding_window": args.window, "sink_size": args.sink, "swa_kv_heads": args.swa_heads}
    return {k: DEFAULT_SWA[k] if v is None else v for k, v in given.items()}


def arm_flags(args, model: Optional[str], recycle: bool) -> dict:
    if flag_off_arm(args, model):
        return {"FD_HEAD_WISE_KV_CACHE": int(recycle), "FD_HEAD_WISE_SWA_RECYCLE": 1}
    return {"FD_HEAD_WISE_KV_CACHE": 1, "FD_HEAD_WISE_SWA_RECYCLE": int(recycle)}


def engine_kwargs(args, model: Optional[str], recycle: bool, quant: str = "none") -> dict:
    max_len = args.input_len + args.output_len + args.block_size
    sizing = {"kv_cache_memory": args.kv_cache_memory} if args.kv_cache_memory else {
        "num_gpu_blocks_override": args.num_gpu_blocks_override
        or args.concurrency_off * math.ceil((args.input_len + args.output_len - 1) / args.block_size)}
    return dict(model=model, block_size=args.block_size, max_model_len=max_len,
                max_num_seqs=args.max_num_seqs or max(args.num_prompts, 8),
                max_num_batched_tokens=args.max_num_batched_tokens, head_wise_swa_config=swa_spec(args, model, recycle),
                admission_policy=args.admission_policy, kv_cache_quant_type=quant,
                tensor_parallel_size=args.tensor_parallel_size or 1, balance_swa_heads=bool(args.balance_swa_heads),
                **sizing)


def engine_config(args, model: Optional[str], recycle: bool, quant: str = "none", **extra):
    from fastdeploy.engine.args_utils import EngineArgs

    with envs.override(**arm_flags(args, model, recycle)):
        return EngineArgs(**{**engine_kwargs(args, model, recycle, quant), **extra}).create_engine_config()


def prediction(args, model: Optional[str], quant: str = "none") -> dict:
    """The page-need function's prediction for the ON arm's layout, recycling off vs on (predicted_concurrency:
    the scheduler's own arithmetic)."""
    from fastdeploy.cache_manager.head_wise import predicted_concurrency

    cfg = engine_config(args, model, True, quant, enable_prefix_caching=False)
    return dict(predicted_concurrency(cfg, args.input_len, args.output_len))


# -- the report ---------------------------------------------------------------------------------
def summary(off: dict, on: dict, pred: dict, **extra) -> dict:
    """The A/B keys every engine writes (docs/benchmarks.md), then each arm's own numbers."""
    gain = on["throughput"] / off["throughput"]
    out = {"throughput_off": off["throughput"], "throughput_on": on["throughput"], "gain": gain,
           "ceiling": pred["ceiling"], "target": 1 + 0.9 * (pred["ceiling"] - 1),
           "peak_running_off": off["peak_running"], "peak_running_on": on["peak_running"],
           "predicted_running_off": pred["running_off"], "predicted_running_on": pred["running_on"],
           "predicted_pages_per_request_off": pred.get("peak_pages_off"),
           "predicted_pages_per_request_on": pred.get("peak_pages_on"),
           "steps_off": off.get("steps"), "steps_on": on.get("steps"), **extra}
    for name, arm in (("off", off), ("on", on)):
        out.update({f"{k}_{name}": v for k, v in arm.items() if k not in ("throughput", "peak_running", "steps")})
    return out


def print_summary(s: dict, unit: str) -> None:
    rows = [{"": label, **{arm: s.get(f"{key}_{arm}") for arm in ("off", "on")}} for label, key in (
        ("output throughput " + unit, "throughput"), ("peak running", "peak_running"),
        ("predicted running", "predicted_running"), ("peak pages in use", "peak_pages"), ("steps", "steps"),
        ("preemptions", "preemptions"), ("SWA pages recycled", "swa_pages_recycled")) if f"{key}_off" in s]
    shown = lambda v: "n/a" if v is None else round(v, 1) if isinstance(v, float) else v  # noqa: E731
    print_table(rows, [("", "", ""), ("recycle OFF", lambda r: shown(r["off"]), ""),
                       ("recycle ON", lambda r: shown(r["on"]), "")])
    print(f"gain ON/OFF {s['gain']:.3f}   ceiling {s['ceiling']:.3f}   target (1 + 0.9 x (ceiling - 1)) "
          f"{s['target']:.3f}: {'met' if s['gain'] >= s['target'] else 'NOT met'}")
    if s.get("steps_off") and s.get("steps_on") and s.get("elapsed_s_on"):
        steps_ratio = s["steps_off"] / s["steps_on"]
        step_time = (s["elapsed_s_on"] / s["steps_on"]) / (s["elapsed_s_off"] / s["steps_off"])
        print(f"gain = steps ratio OFF/ON {steps_ratio:.3f} / step time ratio ON/OFF {step_time:.3f} (~1 only where a "
              f"step's cost does not grow with the batch)")


def plot(path: str, title: str, arms: list, pages_total: float, xlabel: str) -> None:
    """Both arms' running requests and pages in use on one x axis (arms: (label, x, running, pages))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_run, ax_pages) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for (label, x, running, pages), color in zip(arms, ("tab:gray", "tab:blue")):  # the feature stands out
        ax_run.step(x, running, where="post", color=color, label=label)
        ax_pages.step(x, pages, where="post", color=color, label=label)
    if pages_total:
        ax_pages.axhline(pages_total, color="black", linestyle=":", linewidth=1, label="pages in the pool")
    ax_run.set_ylabel("running requests")
    ax_pages.set_ylabel("KV pages in use")
    ax_pages.set_xlabel(xlabel)
    ax_run.set_title(title, fontsize=10)
    for ax in (ax_run, ax_pages):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, path)


# -- dry: the scheduler alone -------------------------------------------------------------------
def dry_arm(args, model: Optional[str], recycle: bool, quant: str) -> dict:
    """Every request at once through the real scheduler (driver.py), a step one unit of time."""
    from fastdeploy.engine.sched.driver import drive
    from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1
    from serving_sim.workload import Workload

    cfg = engine_config(args, model, recycle, quant, enable_prefix_caching=False)
    rm = ResourceManagerV1(cfg)
    run = drive(rm, Workload(args.num_prompts, args.input_len, args.output_len).requests(), check=False)
    page_bytes = cfg.cache_config.block_bytes(cfg.model_config, cfg.parallel_config.tensor_parallel_size) \
        // cfg.slot_layout.slots_per_rank
    return {"throughput": args.num_prompts * args.output_len / run.steps, "peak_running": run.peak_running,
            "steps": run.steps, "peak_pages": run.peak_pages_used, "pages": rm.cache_manager.num_total_pages,
            "page_bytes": page_bytes, "layout": cfg.slot_layout.describe(), "kv_cache_quant_type": quant,
            "swa_pages_recycled": rm.kv_cache_manager.swa_pages_recycled_total,
            "preemptions": rm.num_preemptions_total, "cut_chunk_steps": rm.cut_chunk_steps_total,
            "pages_per_request": max(rm.layout.peak_pages_per_rank(args.input_len, args.output_len, 1)),
            "alone": one_request(args, model, recycle, quant),
            "series": {"x": list(range(1, run.steps + 1)), "running": run.series["running"],
                       "pages": run.series["pages_used"]}}


def one_request(args, model: Optional[str], recycle: bool, quant: str = "none") -> dict:
    """One request alone to its end: after each step, the tokens it has processed and the (layer, KV head)
    blocks its table holds (pages x lanes: arms whose lanes differ compare), checked against the page-need
    function; its prefill and decode peaks."""
    from fastdeploy.engine.request import Request, SamplingParams
    from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1

    cfg = engine_config(args, model, recycle, quant, enable_prefix_caching=False, max_num_seqs=1)
    rm, lanes = ResourceManagerV1(cfg), cfg.slot_layout.num_lanes
    kv = rm.kv_cache_manager
    rm.add_request(Request("one", [5 + j % 200 for j in range(args.input_len)],
                           SamplingParams(max_tokens=args.output_len, ignore_eos=True), eos_token_id=-1))
    tokens, blocks, peaks = [0], [0], {"prefill": 0, "decode": 0}

    while rm.has_unfinished_requests():
        batch = rm.schedule()  # counted after the recycle step and table growth: the pages the step runs with
        step, held = batch.requests[0], sum(kv.held_pages_per_slot("one"))
        if cfg.head_wise_kv_cache and held != sum(rm.layout.pages_per_rank(step.start, step.num_tokens)):
            raise AssertionError(f"{model}: the table holds {held} pages at {step.start} + {step.num_tokens}, the "
                                 f"page-need function says {rm.layout.pages_per_rank(step.start, step.num_tokens)}")
        phase = "prefill" if step.num_tokens > 1 else "decode"
        peaks[phase] = max(peaks[phase], held)
        tokens.append(step.start + step.num_tokens)
        blocks.append(held * lanes)
        rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
    return {"layout": cfg.slot_layout.describe(), "tokens": tokens, "pair_blocks": blocks, **peaks,
            "prefill_peak": max(b for t, b in zip(tokens, blocks) if t <= args.input_len), "end": blocks[-1],
            "peak": max(blocks)}


def run_dry(args) -> dict:
    if args.tp_placements:
        return tp_placements(args)
    if args.one_request:
        results = {str(m): {arm: one_request(args, m, arm == "on") for arm in ("off", "on")} for m in args.model}
        for model, arms in results.items():
            off, on = arms["off"], arms["on"]
            print(f"{model}: {on['layout']}\n  (layer, KV head) blocks held, flag off -> on: prefill peak "
                  f"{off['prefill_peak']} -> {on['prefill_peak']} ({on['prefill_peak'] / off['prefill_peak']:.0%}), "
                  f"at the end {off['end']} -> {on['end']} ({on['end'] / off['end']:.0%}), steps {len(off['tokens']) - 1}")
        if args.plot:
            plot_one_request(args, results)
        return {"models": results}
    model = args.model[0]
    runs = {q: {arm: dry_arm(args, model, arm == "on", q) for arm in ("off", "on")} for q in args.kv_cache_quant_types}
    off, on = runs[args.kv_cache_quant_types[0]].values()
    result = summary(off, on, prediction(args, model, args.kv_cache_quant_types[0]))
    # In bytes: a page is one slot of every lane, and the arms' layouts may differ in lanes.
    result.update(ceiling=off["pages_per_request"] * off["page_bytes"] / (on["pages_per_request"] * on["page_bytes"]),
                  concurrency_gain=on["peak_running"] / off["peak_running"],
                  prefill_peak_share=_share(on, off, "prefill"), decode_peak_share=_share(on, off, "decode"),
                  formats=runs)
    for arm, r in (("off", off), ("on", on)):
        print(f"{arm:>3}: {r['layout']}; {r['pages']} pages ({r['page_bytes']} bytes), {r['pages_per_request']} per "
              f"request (one-token steps); peak running {r['peak_running']}, steps {r['steps']}, pages recycled "
              f"{r['swa_pages_recycled']}")
    print(f"concurrency OFF -> ON {result['concurrency_gain']:.2f}x (page-need ceiling {result['ceiling']:.2f}x); one "
          f"request alone, ON / OFF KV bytes: prefill peak {result['prefill_peak_share']:.2f}, decode peak "
          f"{result['decode_peak_share']:.2f}")
    if len(runs) > 1:
        print(f"\n{'pages':<16}{'arm':<5}{'page bytes':>11}{'pages':>8}{'pages/request':>15}{'running':>9}"
              f"{'x running':>11}")
        for q, arms in runs.items():
            for arm, r in arms.items():
                r["running_x"] = r["peak_running"] / off["peak_running"]
                print(f"{q:<16}{arm:<5}{r['page_bytes']:>11}{r['pages']:>8}{r['pages_per_request']:>15}"
                      f"{r['peak_running']:>9}{r['running_x']:>10.2f}x")
    if args.plot:
        plot(args.plot, f"{model}: {args.num_prompts} requests of {args.input_len} + {args.output_len} tokens",
             [(f"recycle {arm.upper()}: {r['steps']} steps", r["series"]["x"], r["series"]["running"],
               r["series"]["pages"]) for arm, r in (("off", off), ("on", on))], off["pages"], "engine step")
    for arms in runs.values():
        for r in arms.values():
            del r["series"]
    return result


def _share(on: dict, off: dict, phase: str) -> float:
    return on["alone"][phase] * on["page_bytes"] / (off["alone"][phase] * off["page_bytes"])


def plot_one_request(args, results: dict) -> None:
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.6 * len(results), 3.6), squeeze=False)
    for ax, (model, arms) in zip(axes[0], results.items()):
        off, on = arms["off"], arms["on"]
        ax.step(off["tokens"], off["pair_blocks"], where="pre", color="tab:gray", label="flag off (1-D)")
        ax.step(on["tokens"], on["pair_blocks"], where="pre", color="tab:blue",
                label=f"flag on (recycling): {on['end'] / off['end']:.0%} of off at the end")
        ax.axvline(args.input_len, color="black", linestyle=":", linewidth=1)
        ax.text(args.input_len, 2, " prompt in: decoding", fontsize=7, va="bottom")
        slots = on["layout"][on["layout"].rfind("(") + 1:-1]
        ax.set_title(f"{model}\n" + textwrap.fill(f"slots per block, flag on: {slots}", 60), fontsize=8)
        ax.set_xlabel("tokens the request has processed")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=7)
    axes[0][0].set_ylabel("KV the request holds\n(blocks of one layer's KV head)")
    fig.suptitle(f"One request of {args.input_len} + {args.output_len} tokens (block {args.block_size}, prefill "
                 f"chunks of {args.max_num_batched_tokens})", fontsize=9)
    save_figure(fig, args.plot)


def tp_placements(args) -> dict:
    """Exact page arithmetic per tensor-parallel degree, number of SWA KV heads (1 or 2 of 4) and placement
    (load order vs --balance-swa-heads): what fits at once OFF and ON, and each rank's ceiling."""
    from fastdeploy.cache_manager.head_wise import predicted_concurrency, rank_ceilings

    rows = []
    for tp in args.tensor_parallel_sizes:
        for heads in ([0], [0, 1]):
            for balance in (False, True)[:1 + (tp > 1)]:
                cfg = engine_config(args, None, True, tensor_parallel_size=tp, balance_swa_heads=balance,
                                    max_num_seqs=4096, head_wise_swa_config={
                                        "sliding_window": args.window, "sink_size": args.sink, "swa_kv_heads": heads})
                pred, ranks = (f(cfg, args.input_len, args.output_len) for f in (predicted_concurrency, rank_ceilings))
                rows.append({"tp": tp, "swa_heads": f"{len(heads)}/4", "balanced": balance,
                             "swa_heads_per_rank": ranks["swa_heads_per_rank"], "running_off": pred["running_off"],
                             "running_on": pred["running_on"], "ceiling": pred["ceiling"],
                             "per_rank_ceiling": [round(c, 3) for c in ranks["per_rank"]]})
    print_table(rows, [("TP", "tp", ""), ("SWA heads", "swa_heads", ""),
                       ("placement", lambda r: "balanced" if r["balanced"] else "load order", ""),
                       ("SWA heads per rank", "swa_heads_per_rank", ""),
                       ("running OFF→ON", lambda r: f"{r['running_off']}→{r['running_on']}", ""),
                       ("ceiling", "ceiling", ".2f"),
                       ("per-rank ceiling", lambda r: ", ".join(f"{c:.2f}" for c in r["per_rank_ceiling"]), "")],
                markdown=True)
    return {"rows": rows}


# -- offline: the real engine -------------------------------------------------------------------
def offline_arm(args, recycle: bool, prompts: list) -> dict:
    from fastdeploy.engine.args_utils import EngineArgs
    from fastdeploy.engine.engine import LLMEngine
    from fastdeploy.engine.request import SamplingParams

    model, quant = args.model[0], args.kv_cache_quant_types[0]
    with envs.override(**arm_flags(args, model, recycle)):
        engine = LLMEngine.from_engine_args(EngineArgs(**engine_kwargs(args, model, recycle, quant), device=args.device,
                                                       cache_dtype=args.cache_dtype,
                                                       speculative_config=args.speculative_config))
    engine.add_request("warmup", prompts[0][:8], SamplingParams(temperature=0, max_tokens=2))
    while engine.has_unfinished_requests():  # builds / loads the ops outside the timed region
        engine.step()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    total, kv = engine.get_stats()["kv_pages_total"], engine.scheduler.kv_cache_manager
    tokens, series, peaks, counting, ends = {}, {"x": [], "running": [], "pages": []}, [0, 0], 0.0, []
    start = last_log = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs.token_ids
        t0 = time.perf_counter()  # this script's bookkeeping: kept out of the timed region
        ends.append(t0 - start - counting)
        for r in engine.scheduler.running:  # the most pages one request holds, any step / once decoding
            held = sum(kv.held_pages_per_slot(r.request_id))
            peaks = [max(peaks[0], held), max(peaks[1], held if r.num_computed_tokens > r.num_prompt_tokens else 0)]
        s = engine.get_stats()
        series["x"].append(len(series["x"]) + 1)
        series["running"].append(s["num_requests_running"])
        series["pages"].append(total - s["kv_pages_free"])
        counting += time.perf_counter() - t0
        if time.perf_counter() - last_log > 5:
            last_log = time.perf_counter()
            log(f"[{'on' if recycle else 'off'}] {len(tokens)}/{len(prompts)} done, running {series['running'][-1]}")
    elapsed = time.perf_counter() - start - counting
    s = engine.get_stats()
    # Time-averaged pages in use: each step's pages weighted by how long that step took.
    avg_pages = sum(used * (t - prev) for used, t, prev in zip(series["pages"], ends, [0.0] + ends)) / elapsed
    return {"throughput": sum(map(len, tokens.values())) / elapsed, "elapsed_s": elapsed, "avg_pages": avg_pages,
            "peak_running": max(series["running"]), "peak_pages": max(series["pages"]), "pages_total": total,
            "steps": len(series["x"]), "peak_pages_per_request": peaks[0], "peak_pages_per_decoding_request": peaks[1],
            "swa_pages_recycled": s["swa_pages_recycled_total"], "preemptions": s["num_preemptions_total"],
            "recomputed_tokens": s["recomputed_tokens_total"],
            "spec_decode": {k: v for k, v in s.items() if k.startswith("spec_decode_")},
            "tokens": [tokens[str(i)] for i in range(len(prompts))], "series": series}


def run_offline(args) -> dict:
    model = args.model[0]
    pred = prediction(args, model, args.kv_cache_quant_types[0])
    cfg = engine_config(args, model, True, args.kv_cache_quant_types[0])
    rng = np.random.default_rng(args.seed or 0)
    prompts = [rng.integers(3, cfg.model_config.vocab_size, args.input_len).tolist() for _ in range(args.num_prompts)]
    spec = swa_spec(args, model)
    if spec is not None and isinstance(spec, dict):  # the JSON's args say what ran
        args.window, args.sink, args.swa_heads = spec["sliding_window"], spec["sink_size"], spec["swa_kv_heads"]
    log(f"{args.num_prompts} prompts x (in {args.input_len}, out {args.output_len}); slots {cfg.slot_layout.describe()}; "
        f"{cfg.cache_config.num_gpu_blocks} blocks; predicted running off={pred['running_off']} on={pred['running_on']}")
    off, on = (offline_arm(args, recycle, prompts) for recycle in (False, True))
    identical = off.pop("tokens") == on.pop("tokens")
    result = summary(off, on, pred, identical_tokens=identical, admission_policy=cfg.admission_policy,
                     slot_layout=cfg.slot_layout.describe(), off_arm="1-D" if flag_off_arm(args, model)
                     else "head-wise, recycle off", args=vars(args))
    print(f"identical tokens in both arms: {identical}")
    if args.plot:
        plot(args.plot, f"{model or 'the tiny preset'}: {args.num_prompts} requests of {args.input_len} + "
                        f"{args.output_len} tokens, {off['pages_total']} pages in both arms",
             [(f"recycle {n.upper()}: {r['steps']} steps", *r["series"].values()) for n, r in (("off", off), ("on", on))],
             off["pages_total"], "engine step")
    for r in (off, on):
        del r["series"]
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        if args.engine == "sim":
            from serving_sim.cli import run_sim

            return run_sim(args)
        if args.engine == "server":
            from recycling_server import run_server

            result = run_server(args)
        else:
            result = (run_dry if args.engine == "dry" else run_offline)(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "gain" in result:
        print_summary(result, "(tok/step)" if args.engine == "dry" else "(tok/s)")
    write_json(args.json, result)
    return 1 if result.get("identical_tokens") is False or result.get("failed_on") or result.get("failed_off") else 0


if __name__ == "__main__":
    sys.exit(main())
