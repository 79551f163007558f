"""Serving simulator: what head-wise SWA page recycling buys on a real model, GPU and workload.

Drives the engine's real ResourceManagerV1 and PrefixCacheManager on a virtual clock; each step's
duration comes from a roofline model of the model's shapes on the chosen GPU. Both arms use the
head-wise cache with identical settings: recycle OFF (FD_HEAD_WISE_SWA_RECYCLE=0) and ON.

    python benchmarks/simulate_serving.py                      # the README report table
    python benchmarks/simulate_serving.py --hardware H200 --swa-heads 1 --num-prompts 256 \\
        --json out.json --plot out.png                         # one scenario
    python benchmarks/simulate_serving.py --scenario seed-t53 --windows 1024,4096,8192 --decision \\
        --json cells.json                    # the Hackathon PR1 table: fit on one cell, predict the rest
    python benchmarks/simulate_serving.py --scenario sliding-layers   # Gemma-3-27B and gpt-oss-20b shapes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serving_sim import report, seed_t53  # noqa: E402
from serving_sim.hardware import PRESETS, get_hardware  # noqa: E402
from serving_sim.simulator import ADMISSIONS, Scenario, arm_metrics, run_scenarios  # noqa: E402
from serving_sim.step_model import ATTENTION_READS  # noqa: E402
from serving_sim.workload import Workload  # noqa: E402

# Options that describe one scenario; giving any of them switches from the table to that scenario.
SCENARIO_DEFAULTS = {
    "model_config": report.MODEL_CONFIG, "hardware": "A800-80GB", "num_prompts": 128,
    "request_rate": report.REQUEST_RATE, "input_len": report.INPUT_LEN, "output_len": report.OUTPUT_LEN,
    "range_ratio": 0.0, "seed": 0, "swa_heads": 4, "window": 4096, "sink": 64, "block_size": 64,
    "num_gpu_blocks_override": None, "gpu_memory_utilization": 0.9, "max_num_seqs": report.MAX_NUM_SEQS,
    "max_num_batched_tokens": None, "max_model_len": None, "bw_efficiency": 1.0, "flops_efficiency": 1.0,
    "tensor_parallel_size": 1, "balance_swa_heads": False,
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("scenario (any of these: simulate one scenario instead of the table)")
    s.add_argument("--model-config", help="config.json (or a model directory holding one); default ERNIE-4.5-21B-A3B")
    s.add_argument("--hardware", choices=sorted(PRESETS))
    s.add_argument("--num-prompts", type=int)
    s.add_argument("--request-rate", type=float, help="Poisson arrivals per second; inf = every request at t=0")
    s.add_argument("--input-len", type=int)
    s.add_argument("--output-len", type=int)
    s.add_argument("--range-ratio", type=float, help="sample lengths uniformly in len*(1 +- ratio); 0 = fixed")
    s.add_argument("--seed", type=int)
    s.add_argument("--swa-heads", type=int, help="how many KV heads slide (the first N); default 4, or none for a "
                                                 "model with its own sliding layers (then OFF = 1-D)")
    s.add_argument("--window", type=int)
    s.add_argument("--sink", type=int)
    s.add_argument("--block-size", type=int)
    s.add_argument("--num-gpu-blocks-override", type=int, help="KV blocks; default from the memory budget")
    s.add_argument("--gpu-memory-utilization", type=float)
    s.add_argument("--max-num-seqs", type=int)
    s.add_argument("--max-num-batched-tokens", type=int)
    s.add_argument("--max-model-len", type=int)
    s.add_argument("--bw-efficiency", type=float, help="fraction of peak HBM bandwidth kernels reach (1.0)")
    s.add_argument("--flops-efficiency", type=float, help="fraction of peak bf16 FLOP/s kernels reach (1.0)")
    t = p.add_argument_group("--scenario seed-t53: the Hackathon No.53 PR1 measurement, fitted on one cell")
    t.add_argument("--scenario", choices=["seed-t53", "sliding-layers"],
                   help="seed-t53: A800, ERNIE-4.5-21B-A3B, 10.6k/4k tokens, 8 req/s, seed 42, 4/4 SWA, S 0, "
                        "max_num_batched_tokens 32768, on-demand admission, masked attention; fit one parameter on "
                        "recycle OFF at 128 prompts, predict OFF/ON at 128 and 1024 and the TTFT change; --json "
                        "writes one row per measured cell. sliding-layers: the shape rows of models trained with "
                        "sliding layers (Gemma-3-27B, gpt-oss-20b) on A800 and H200, OFF = 1-D, ON = slots + "
                        "recycling, the table's workload (--admission, default projected)")
    t.add_argument("--windows", default="4096", type=lambda text: tuple(int(w) for w in text.split(",")),
                   help="comma-separated windows to calibrate and predict at (the submission's is not stated)")
    t.add_argument("--fit", choices=seed_t53.FIT_PARAMETERS, default="efficiency",
                   help="the one fitted parameter: kernel efficiency (overhead kept) or per-step overhead "
                        "(efficiency 1)")
    t.add_argument("--scale", type=int, default=1,
                   help="divide token counts, KV pool and prompt counts by this (a fast, smaller run)")
    t.add_argument("--pool-blocks", type=int,
                   help="KV blocks of the seed-t53 server (default: 90%% of HBM minus weights; PR1's real pool, "
                        "after activations, is not reported)")
    t.add_argument("--decision", action="store_true",
                   help="also run the calibrated model with our skip kernel vs masked, each admission policy "
                        "(--admission, default every one this scheduler has), 1/4 vs 4/4 SWA heads")
    t.add_argument("--decision-json", help="write the decision rows (a JSON list) here")
    s.add_argument("--tensor-parallel-size", type=int, help="ranks, one GPU each, each with its own page pool (1)")
    s.add_argument("--balance-swa-heads", action="store_const", const=True,
                   help="spread the SWA heads over the ranks (the engine's --balance-swa-heads)")
    g = p.add_argument_group("both modes")
    g.add_argument("--overhead-ms", type=float, default=3.0, help="fixed per-step overhead (default 3 ms)")
    g.add_argument("--admission", default=None, type=_admissions,
                   help="comma-separated admission policies, one row each: reserve (peak pages at admission, "
                        "no preemption), on-demand (upstream-like, preempts), projected (needs a scheduler that "
                        "reads FD_ADMISSION_POLICY); 'both' = reserve,on-demand; 'all' = every policy. "
                        "Default: reserve for one scenario; reserve,on-demand for the table (on-demand rows only "
                        "for A800 / sink 64 / 128 prompts).")
    g.add_argument("--attention", choices=ATTENTION_READS, default="skip",
                   help="keys a SWA head's kernel reads: skip (ours: sink + window only) or masked (upstream's "
                        "1-D kernel and the Hackathon PR1: every key up to the query, masked)")
    g.add_argument("--max-sim-prompts", type=int, default=report.DEFAULT_MAX_SIM_PROMPTS,
                   help="simulate at most max(this, 2.5 x predicted concurrency) prompts and extrapolate the "
                        "saturated steady state to the rest; 0 = simulate every prompt")
    g.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    g.add_argument("--json", help="write the result rows (a JSON list) here")
    g.add_argument("--calibrate-offline", metavar="AB_JSON",
                   help="instead of simulating: fit the per-step overhead to the OFF arm of a "
                        "benchmarks/bench_offline.py --json result (tiny preset, this CPU) and report how well "
                        "the model then predicts the ON arm and the gain")
    g.add_argument("--plot", help="PNG of running requests and pages in use over time, OFF vs ON")
    return p.parse_args(argv)


def _admissions(text: str) -> tuple:
    names = {"both": ("reserve", "on-demand"), "all": ADMISSIONS}.get(text) or tuple(text.split(","))
    unknown = [a for a in names if a not in ADMISSIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown admission {', '.join(unknown)}; choose from "
                                         f"{', '.join(ADMISSIONS)}, both, all")
    return names


def scenarios_from(args: argparse.Namespace) -> tuple:
    """(scenarios, table_mode)."""
    if all(getattr(args, k) is None for k in SCENARIO_DEFAULTS):
        table_admissions = args.admission or ("reserve", "on-demand")
        return report.table_scenarios(args.overhead_ms, args.max_sim_prompts, table_admissions,
                                      attention=args.attention), True
    admissions = args.admission or ("reserve",)
    v = {k: (d if getattr(args, k) is None else getattr(args, k)) for k, d in SCENARIO_DEFAULTS.items()}
    if args.swa_heads is None and model_slides_layers(v["model_config"]):
        v["swa_heads"] = None  # its own sliding layers: OFF = 1-D, ON = slots + recycling
    hw = get_hardware(v["hardware"]).scaled(v["bw_efficiency"], v["flops_efficiency"])
    workload = Workload(v["num_prompts"], v["input_len"], v["output_len"], v["request_rate"], v["range_ratio"],
                        v["seed"])
    out = []
    for admission in admissions:
        out.append(Scenario(
            name=(f"{hw.name} swa{v['swa_heads']} W{v['window']} S{v['sink']}" if v["swa_heads"] is not None
                  else f"{hw.name} sliding layers") + f" n{v['num_prompts']} {admission}"
                 + ("" if args.attention == "skip" else f" {args.attention}")
                 + (f" tp{v['tensor_parallel_size']}{' balanced' if v['balance_swa_heads'] else ''}"
                    if v["tensor_parallel_size"] > 1 else ""),
            model_config=v["model_config"], hardware=hw, workload=workload, swa_heads=v["swa_heads"],
            window=v["window"], sink=v["sink"], block_size=v["block_size"],
            num_gpu_blocks_override=v["num_gpu_blocks_override"],
            gpu_memory_utilization=v["gpu_memory_utilization"], max_num_seqs=v["max_num_seqs"],
            max_num_batched_tokens=v["max_num_batched_tokens"], max_model_len=v["max_model_len"],
            overhead_ms=args.overhead_ms, admission=admission, attention=args.attention,
            max_sim_prompts=args.max_sim_prompts, tensor_parallel_size=v["tensor_parallel_size"],
            balance_swa_heads=v["balance_swa_heads"]))
    return out, False


def model_slides_layers(model_config: str) -> bool:
    """The model config declares sliding layers of its own (Gemma 3's pattern, layer_types)."""
    from fastdeploy.config import ModelConfig
    from serving_sim.simulator import model_dir_for

    return ModelConfig.create(model_dir_for(model_config), None, None).layer_sliding_window is not None


def calibrate(args) -> int:
    from serving_sim.hardware import measure_cpu
    from serving_sim.simulator import calibrate_overhead, tiny_preset_model_dir

    with open(args.calibrate_offline) as f:
        ab = json.load(f)
    cpu = measure_cpu()
    print(f"[calibrate] this CPU: {cpu.bf16_flops_per_s / 1e9:.1f} GFLOP/s (fp32 matmul), "
          f"{cpu.hbm_bytes_per_s / 1e9:.1f} GB/s (copy)", file=sys.stderr)
    try:
        res = calibrate_overhead(ab, tiny_preset_model_dir(), cpu)
    except ValueError as exc:
        print(f"simulate_serving: {exc}", file=sys.stderr)
        return 2
    print(f"fitted per-step overhead: {res['overhead_ms']:.3f} ms (on the OFF arm)")
    print(f"{'':<22}{'measured':>10}{'predicted':>11}{'error':>8}")
    print(f"{'throughput OFF tok/s':<22}{res['measured_throughput_off']:>10.1f}{res['predicted_throughput_off']:>11.1f}"
          f"{'(fit)':>8}")
    print(f"{'throughput ON tok/s':<22}{res['measured_throughput_on']:>10.1f}{res['predicted_throughput_on']:>11.1f}"
          f"{res['error_throughput_on']:>+8.1%}")
    print(f"{'gain ON/OFF':<22}{res['measured_gain']:>10.3f}{res['predicted_gain']:>11.3f}{res['error_gain']:>+8.1%}")
    print(f"peak running OFF/ON: measured {res['peak_running']['measured']}, simulated {res['peak_running']['simulated']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def run_seed_t53(args) -> int:
    t0 = time.perf_counter()
    base = seed_t53.Setup(scale=args.scale, overhead_ms=args.overhead_ms, pool_blocks=args.pool_blocks)
    print(seed_t53.describe(base) + "\n")
    rows, fitted_by_window = [], {}
    for window in args.windows:
        fitted, pred = seed_t53.calibrate_and_predict(window, args.fit, args.scale, base, args.jobs)
        fitted_by_window[window] = fitted
        rows += pred["rows"]
        ttft = pred["mean_ttft_s"]
        print(f"W {window}: {seed_t53.fitted_text(fitted, args.fit)}; mean TTFT at 1024 prompts OFF "
              f"{ttft['off']:.0f} s (measured {seed_t53.MEASURED_TTFT_S['off']:.0f}), ON {ttft['on']:.0f} s "
              f"(measured {seed_t53.MEASURED_TTFT_S['on']:.0f})")
        for (arm, n), outcome in pred["arms"].items():
            r = outcome.result
            print(f"  {arm.upper():>3} n{outcome.num_prompts}: {outcome.output_throughput:.1f} tok/s, running peak "
                  f"{r.peak_running} mean {r.mean_running:.1f}, pages in use peak "
                  f"{r.peak_pages_used / r.pages_total:.0%} "
                  f"mean {r.mean_pages_used / r.pages_total:.0%}, preemptions {r.preemptions}, recomputed tokens "
                  f"{r.recomputed_tokens:,}")
    print("\n" + seed_t53.markdown_cells(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if args.decision:
        fitted = fitted_by_window.get(4096) or next(iter(fitted_by_window.values()))
        decision = seed_t53.decision_rows(fitted, args.admission, jobs=args.jobs)
        print(f"\nSame calibrated model (W {fitted.window}), recycle OFF vs ON:\n")
        print(seed_t53.markdown_decision(decision))
        if args.decision_json:
            with open(args.decision_json, "w") as f:
                json.dump(decision, f, indent=2)
    print(f"\n[simulate_serving] seed-t53 in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


def run_sliding_layers(args) -> int:
    scenarios = report.sliding_layer_scenarios(args.overhead_ms, args.max_sim_prompts,
                                               args.admission or ("projected",), attention=args.attention)
    t0 = time.perf_counter()
    results = run_scenarios(scenarios, args.jobs)
    rows = [row for row, _, _ in results]
    print(report.markdown_sliding_layers(rows))
    print(f"\n[simulate_serving] sliding layers: {len(scenarios)} scenario(s) in {time.perf_counter() - t0:.1f} s "
          f"({args.jobs} job(s))", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.calibrate_offline:
        return calibrate(args)
    if args.scenario == "seed-t53":
        try:
            return run_seed_t53(args)
        except ValueError as exc:
            print(f"simulate_serving: {exc}", file=sys.stderr)
            return 2
    if args.scenario == "sliding-layers":
        return run_sliding_layers(args)
    try:
        scenarios, table = scenarios_from(args)
    except ValueError as exc:
        print(f"simulate_serving: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results = run_scenarios(scenarios, args.jobs)
    elapsed = time.perf_counter() - t0
    rows = [row for row, _, _ in results]
    if table:
        print(report.table_preamble(rows) + "\n")
        print(report.markdown_table(rows))
    else:
        for row, off, on in results:
            print(f"\n==== {row['name']} ====")
            print(report.arm_summary("recycle OFF", arm_metrics(off)))
            print(report.arm_summary("recycle ON", arm_metrics(on)))
            print(f"gain (ON/OFF output throughput): {row['gain']:.3f}   ceiling: {row['ceiling']:.3f}   "
                  f"predicted running OFF/ON: {row['predicted_running_off']}/{row['predicted_running_on']}")
        layers = [r for r in rows if r["swa_heads"] is None]
        heads = [r for r in rows if r["swa_heads"] is not None]
        print("\n" + "\n\n".join(([report.markdown_table(heads)] if heads else [])
                                  + ([report.markdown_sliding_layers(layers)] if layers else [])))
    print(f"\n[simulate_serving] {len(scenarios)} scenario(s), {2 * len(scenarios)} arms in {elapsed:.1f} s "
          f"({args.jobs} job(s))", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if args.plot:
        pick = _plot_pick(results, table)
        row, off, on = pick
        report.plot_arms(args.plot, row["name"] + f"  (gain {row['gain']:.2f}x, ceiling {row['ceiling']:.2f}x)",
                         off, on)
    return 0


def _plot_pick(results: list, table: bool):
    """The scenario to plot: the table's headline (A800, every head SWA, sink 64, 128 prompts) or the first."""
    if table:
        for item in results:
            r = item[0]
            if (r["hardware"], r["swa_heads"], r["sink"], r["num_prompts"], r["admission"]) == \
                    ("A800-80GB", r["num_kv_heads"], 64, 128, "reserve"):
                return item
    return results[0]


if __name__ == "__main__":
    sys.exit(main())
