"""`bench_recycling.py --engine sim`: the simulator's scenarios from the command line.

One scenario from the options given (defaults: report.py's table workload, ERNIE-4.5-21B-A3B on A800),
`--table` (the report table) or `--sliding-layers` (models trained with sliding layers, OFF = 1-D).
"""

from __future__ import annotations

import argparse
import sys
import time

from . import report
from .hardware import get_hardware
from .simulator import ADMISSIONS, Scenario, arm_metrics, model_dir_for, run_scenarios
from .workload import Workload
from bench_recycling import model_slides_layers, write_json  # noqa: I001  (the tool's; benchmarks/ is on sys.path)

# One scenario's defaults where an option is not given.
SCENARIO = {"model_config": report.MODEL_CONFIG, "hardware": "A800-80GB", "num_prompts": 128,
            "request_rate": report.REQUEST_RATE, "input_len": report.INPUT_LEN, "output_len": report.OUTPUT_LEN,
            "range_ratio": 0.0, "seed": 0, "swa_heads": 4, "window": 4096, "sink": 64, "block_size": 64,
            "num_gpu_blocks_override": None, "gpu_memory_utilization": 0.9, "max_num_seqs": report.MAX_NUM_SEQS,
            "max_num_batched_tokens": None, "max_model_len": None, "bw_efficiency": 1.0, "flops_efficiency": 1.0,
            "tensor_parallel_size": 1, "balance_swa_heads": False}


def admissions(text) -> tuple:
    """'reserve,on-demand', 'both' or 'all' -> policy names (the simulator's, with a dash)."""
    if not text:
        return ()
    names = {"both": ("reserve", "on-demand"), "all": ADMISSIONS}.get(text) or \
        tuple(a.replace("_", "-") for a in text.split(","))
    unknown = [a for a in names if a not in ADMISSIONS]
    if unknown:
        raise ValueError(f"unknown admission {', '.join(unknown)}; choose from {', '.join(ADMISSIONS)}, both, all")
    return names


def scenarios(args: argparse.Namespace) -> list:
    v = {k: getattr(args, k, None) for k in SCENARIO}
    v["model_config"] = args.model_config or (args.model[0] if args.model and args.model[0] else None)
    v = {k: SCENARIO[k] if value is None else value for k, value in v.items()}
    if args.swa_heads is None and model_slides_layers(model_dir_for(v["model_config"])):
        v["swa_heads"] = None  # its own sliding layers: OFF = 1-D, ON = slots + recycling
    elif args.swa_heads is not None:
        v["swa_heads"] = args.swa_heads[0]
    hw = get_hardware(v["hardware"]).scaled(v["bw_efficiency"], v["flops_efficiency"])
    workload = Workload(v["num_prompts"], v["input_len"], v["output_len"], v["request_rate"], v["range_ratio"], v["seed"])
    out = []
    for admission in admissions(args.admission_policy) or ("reserve",):
        name = (f"{hw.name} swa{v['swa_heads']} W{v['window']} S{v['sink']}" if v["swa_heads"] is not None
                else f"{hw.name} sliding layers") + f" n{v['num_prompts']} {admission}"
        name += "" if args.attention == "skip" else f" {args.attention}"
        if v["tensor_parallel_size"] > 1:
            name += f" tp{v['tensor_parallel_size']}{' balanced' if v['balance_swa_heads'] else ''}"
        out.append(Scenario(
            name=name, model_config=v["model_config"], hardware=hw, workload=workload, swa_heads=v["swa_heads"],
            window=v["window"], sink=v["sink"], block_size=v["block_size"],
            num_gpu_blocks_override=v["num_gpu_blocks_override"], gpu_memory_utilization=v["gpu_memory_utilization"],
            max_num_seqs=v["max_num_seqs"], max_num_batched_tokens=v["max_num_batched_tokens"],
            max_model_len=v["max_model_len"], overhead_ms=args.overhead_ms, admission=admission,
            attention=args.attention, max_sim_prompts=args.max_sim_prompts,
            tensor_parallel_size=v["tensor_parallel_size"], balance_swa_heads=v["balance_swa_heads"]))
    return out


def run_sim(args) -> int:

    try:
        policies = admissions(args.admission_policy)
        if args.table:
            chosen = report.table_scenarios(args.overhead_ms, args.max_sim_prompts, policies or ("reserve", "on-demand"),
                                            attention=args.attention)
        elif args.sliding_layers:
            chosen = report.sliding_layer_scenarios(args.overhead_ms, args.max_sim_prompts, policies or ("projected",),
                                                    attention=args.attention)
        else:
            chosen = scenarios(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results = run_scenarios(chosen, args.jobs)
    rows = [row for row, _, _ in results]
    if args.table:
        print(report.table_preamble(rows) + "\n\n" + report.markdown_table(rows))
    elif args.sliding_layers:
        print(report.markdown_sliding_layers(rows))
    else:
        for row, off, on in results:
            print(f"\n==== {row['name']} ====\n" + report.arm_summary("recycle OFF", arm_metrics(off)) + "\n"
                  + report.arm_summary("recycle ON", arm_metrics(on)))
            print(f"gain (ON/OFF output throughput): {row['gain']:.3f}   ceiling: {row['ceiling']:.3f}   "
                  f"predicted running OFF/ON: {row['predicted_running_off']}/{row['predicted_running_on']}")
        layers, heads = [r for r in rows if r["swa_heads"] is None], [r for r in rows if r["swa_heads"] is not None]
        print("\n" + "\n\n".join(([report.markdown_table(heads)] if heads else [])
                                  + ([report.markdown_sliding_layers(layers)] if layers else [])))
    print(f"\n[bench_recycling sim] {len(chosen)} scenario(s), {2 * len(chosen)} arms in {time.perf_counter() - t0:.1f} s "
          f"({args.jobs} job(s))", file=sys.stderr)
    write_json(args.json, rows)
    if args.plot:
        row, off, on = _headline(results) if args.table else results[0]
        report.plot_arms(args.plot, row["name"] + f"  (gain {row['gain']:.2f}x, ceiling {row['ceiling']:.2f}x)",
                         off, on)
    return 0


def _headline(results: list):
    """The table's headline row to plot (A800, every head SWA, sink 64, 128 prompts, reserve), else the first."""
    for item in results:
        r = item[0]
        if (r["hardware"], r["swa_heads"], r["sink"], r["num_prompts"], r["admission"]) == \
                ("A800-80GB", r["num_kv_heads"], 64, 128, "reserve"):
            return item
    return results[0]
