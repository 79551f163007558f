"""This engine next to transformers' `generate` on the same model file, in one run, and both next to
this machine's limits measured in the same run.

Both sides read the same GGUF file (default: the named model smollm2-135m-instruct) at float32 and
get the same random prompts. The engine runs twice: as it ships (its dense layers keep the file's
quantized blocks and rebuild each float32 weight in registers: the same numbers, ~5x fewer bytes;
FD_CPU_GGUF_BLOCKS=1) and with float32 copies of the weights (FD_CPU_GGUF_BLOCKS=0, "engine f32";
`--no-float32-engine` skips it); all three must give the same tokens. The engine runs `LLM.generate`
with greedy sampling and `ignore_eos`; transformers runs one `generate` call per case: the whole batch
at once, left padding with an attention mask, `min_new_tokens = max_new_tokens`, `do_sample=False`,
torch on `--torch-threads` threads. Cases: N concurrent requests of `--input-len` random prompt tokens
and `--output-len` output tokens for each N of `--concurrency`, then a prefill-heavy case
(`--prefill-prompts` prompts of `--prefill-len` tokens, `--prefill-output-len` output tokens).

Each case runs `--rounds` times, the sides taking turns (engine, engine f32, transformers, engine,
...: ab_harness.py says why); a side's numbers are from its median-time round, and each engine's
per-round ratio to transformers is printed as a range next to the median one.

The machine's limits, measured before the cases run:
  - GEMM peak: numpy float32 2048 x 2048 x 2048 matmul, GFLOP/s (best of a few);
  - memory read bandwidth: a streaming read of a 1 GiB buffer by every core, each reading its share,
    GB/s (best of a few; fastdeploy/model_executor/layers/cpu_kernels.py);
  - the CPU and the kernels the engine's ops chose on it (AVX-512, AVX2 or portable; FD_CPU_LINEAR_ISA
    caps them, so `FD_CPU_LINEAR_ISA=avx2` measures the AVX2 kernels on an AVX-512 machine).
Fractions reached:
  - every case: model FLOPs / time / GEMM peak, where model FLOPs = processed tokens x 2 x the
    decoder's matmul parameters + output tokens x 2 x the lm_head's (attention scores excluded);
  - N = 1: weight bytes read per output token (every matmul weight once, as that side holds it:
    float32 for transformers and engine f32, the blocks' bytes for the engine) x output tok/s /
    bandwidth (the time includes the prompt's prefill, so this slightly understates decode).
With `--llama-batched-bench PATH` (llama.cpp's bench, built from the source llama-cpp-python's
source distribution carries: docs/benchmarks.md), llama.cpp is a side too: the same shapes on the same
file, 2 threads, its own prompt tokens (so no token comparison); its time is the whole run's.
Decode alone is printed too: llama.cpp's S_TG, and for the engine the tokens after each request's
first over the time from the last first token to the end (for one request: its decode exactly),
with each engine's per-round ratio to llama.cpp. `--int8-activations` adds "engine int8", the engine
with FD_CPU_INT8_ACTIVATIONS=1 (opt-in, not exact: its same-tokens share is reported on its own).

    python benchmarks/bench_vs_transformers.py --json results/vs_transformers.json
    python benchmarks/bench_vs_transformers.py --quick
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when imported as benchmarks.<this>
from ab_harness import log, median, print_table, ratio_range, round_ratios, take_turns, timed, write_json  # noqa: E402

# Random prompt ids start here: the special tokens of the models served sit below it.
FIRST_PROMPT_ID = 256


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a named model or a .gguf path")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="requests at once, per case")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefill-prompts", type=int, default=4, help="0 skips the prefill-heavy case")
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--prefill-output-len", type=int, default=4)
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=3, help="runs of every case by every side, taking turns")
    p.add_argument("--quick", action="store_true",
                   help="a short run that proves the script works: N = 1, 4; 32 in / 8 out; prefill 2 x 256")
    p.add_argument("--no-float32-engine", action="store_true",
                   help="skip the engine run on float32 weight copies (FD_CPU_GGUF_BLOCKS=0)")
    p.add_argument("--int8-activations", action="store_true",
                   help="add the engine with FD_CPU_INT8_ACTIVATIONS=1 (opt-in, not exact) as a side, 'engine int8'")
    p.add_argument("--llama-batched-bench", default=None, metavar="PATH",
                   help="llama.cpp's llama-batched-bench binary: run every case with it too, taking turns")
    p.add_argument("--json", default=None, help="write machine limits, parameters and every case here")
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.input_len, args.output_len = [1, 4], 32, 8
        args.prefill_prompts, args.prefill_len, args.prefill_output_len = 2, 256, 2
        args.rounds = 1
    bad = [f"--{k.replace('_', '-')}" for k in ("input_len", "output_len", "prefill_len", "prefill_output_len",
                                                  "torch_threads", "rounds") if getattr(args, k) < 1]
    bad += ["--concurrency"] if min(args.concurrency) < 1 else []
    bad += ["--prefill-prompts"] if args.prefill_prompts < 0 else []
    if bad:
        p.error(f"{', '.join(bad)} must be positive")
    return args


# ----------------------------------------------------------------------------- machine limits


def gemm_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    a @ b  # first call: thread pool start-up and page faults of the output
    best = min(timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


# ----------------------------------------------------------------------------- the two engines


def gguf_path(model: str) -> str:
    from fastdeploy.model_executor.models.named_models import NAMED_MODELS, resolve

    if model in NAMED_MODELS:
        return resolve(model)
    if not os.path.isfile(model):
        raise ValueError(f"--model {model!r} is neither a named model ({', '.join(NAMED_MODELS)}) nor a file")
    return model


def load_transformers(path: str, threads: int):
    """transformers' own GGUF loader, float32, on `threads` torch threads."""
    import importlib.metadata

    import torch
    import transformers

    try:
        importlib.metadata.version("torchcodec")
    except importlib.metadata.PackageNotFoundError:
        # PaddleFormers' paddlecodec installs a `torchcodec` import package without torchcodec's
        # metadata, which transformers then fails to read; nothing here decodes audio or video.
        import transformers.utils
        import transformers.utils.import_utils as import_utils

        import_utils.is_torchcodec_available = transformers.utils.is_torchcodec_available = lambda: False
    torch.set_num_threads(threads)
    folder, name = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval()


def matmul_parameters(model) -> tuple:
    """(decoder matmul parameters, lm_head parameters) of a transformers model."""
    import torch

    head = model.get_output_embeddings()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return body, head.weight.numel()


def run_transformers(model, prompts: list, output_len: int) -> tuple:
    """One batched greedy `generate` (left padding + mask); (seconds, output ids per prompt, None)."""
    import torch

    pad = model.generation_config.pad_token_id
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, (list, tuple)) else (eos if eos is not None else 0)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, pad_token_id=pad,
                             temperature=None, top_p=None, top_k=None)
        elapsed = time.perf_counter() - start
    return elapsed, out[:, width:].tolist(), None


def run_engine(llm, prompts: list, output_len: int) -> tuple:
    """(seconds, output ids per prompt, decode-only tok/s)."""
    from fastdeploy import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    end_wall = time.time()  # the clock of the requests' first_token_time
    tokens = [list(o.outputs.token_ids) for o in outs]
    # Decode alone, as llama.cpp's S_TG: the tokens after each request's first, over the time from the
    # last first token to the end (one request: its decode exactly).
    decode_seconds = end_wall - max(o.metrics["first_token_time"] for o in outs)
    return elapsed, tokens, sum(len(t) - 1 for t in tokens) / decode_seconds


def run_llama_cpp(binary: str, path: str, prompts: list, output_len: int) -> tuple:
    """llama-batched-bench on the case's shape; (seconds, placeholder outputs of the right length, its S_TG)."""
    from llama_cpp_bench import batched_bench

    result = batched_bench(binary, path, len(prompts[0]), output_len, len(prompts))
    return result["seconds"], [[0] * output_len for _ in prompts], result["decode_tok_s"]


def engine_kwargs(args, cases: list) -> dict:
    """Room for the largest case at once: memory, not the KV budget, must never hold a case back."""
    block_size = 64
    longest = max(c["input_len"] + c["output_len"] for c in cases)
    blocks = max(c["requests"] * -(-(c["input_len"] + c["output_len"]) // block_size) for c in cases)
    # Prefix caching off: every case's prompts are fresh, and a cache hit would skip real prefill work.
    return dict(max_num_seqs=max(c["requests"] for c in cases), max_model_len=longest + block_size,
                block_size=block_size, num_gpu_blocks_override=blocks + 1, enable_prefix_caching=False)


# ----------------------------------------------------------------------------- cases and report


def make_cases(args, vocab_size: int) -> list:
    rng = np.random.default_rng(args.seed)
    shapes = [(f"decode N={n}", n, args.input_len, args.output_len) for n in args.concurrency]
    if args.prefill_prompts:
        shapes.append((f"prefill {args.prefill_prompts}x{args.prefill_len}", args.prefill_prompts,
                       args.prefill_len, args.prefill_output_len))
    return [{"name": name, "requests": n, "input_len": i, "output_len": o,
             "prompts": rng.integers(FIRST_PROMPT_ID, vocab_size, (n, i)).tolist()} for name, n, i, o in shapes]


def side_metrics(seconds: float, outputs: list, case: dict, limits: dict, params: tuple,
                 weight_bytes: int) -> dict:
    body, head = params
    out_tokens = sum(len(o) for o in outputs)
    in_tokens = case["requests"] * case["input_len"]
    flops = (in_tokens + out_tokens) * 2 * body + out_tokens * 2 * head
    m = {"seconds": seconds, "output_tokens": out_tokens, "output_tok_s": out_tokens / seconds,
         "total_tok_s": (in_tokens + out_tokens) / seconds,
         "gemm_fraction": flops / seconds / (limits["gemm_peak_gflops"] * 1e9)}
    if case["requests"] == 1:
        m["bandwidth_fraction"] = weight_bytes * m["output_tok_s"] / (limits["read_bandwidth_gbs"] * 1e9)
    return m


def rounds_summary(seconds: dict) -> tuple:
    """seconds: side -> one time per round. (median-round seconds per side, per-round ratios of each
    engine's speed to transformers' — the same tokens on both sides, so the inverse time ratio)."""
    return ({side: median(times, lower=True) for side, times in seconds.items()},
            {side: round_ratios(seconds, "transformers", side) for side in seconds if side != "transformers"})


def agreement(a: list, b: list) -> float:
    """Share of requests whose greedy tokens are identical on both sides."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


SHORT = {"engine": "engine", "engine f32": "eng f32", "engine int8": "eng i8", "transformers": "hf",
         "llama.cpp": "llama"}


def print_tables(results: list, limits: dict, sides: list) -> None:
    """Per case: tok/s of each side, each engine's ratio to transformers (median round, range of the
    rounds), the fractions of the machine's limits; then decode alone next to llama.cpp's S_TG."""
    engines = [s for s in sides if s != "transformers"]
    key = lambda r: "total_tok_s" if r["name"].startswith("prefill") else "output_tok_s"  # noqa: E731

    def to_hf(r, s):
        return (f"{r[s][key(r)] / r['transformers'][key(r)]:.2f}x "
                f"({min(r['round_ratios ' + s]):.2f}-{max(r['round_ratios ' + s]):.2f})")

    def bandwidth(r, s):
        return f"{r[s]['bandwidth_fraction']:.1%}" if "bandwidth_fraction" in r[s] else "-"

    columns = [("case", "name", "")] + [(s, lambda r, s=s: r[s][key(r)], ".1f") for s in sides]
    columns += [(f"x {SHORT[s]} (rounds)", functools.partial(to_hf, s=s), "") for s in engines]
    columns += [(f"%GEMM {SHORT[s]}", lambda r, s=s: r[s]["gemm_fraction"], ".1%") for s in sides]
    columns += [(f"%BW {SHORT[s]}", functools.partial(bandwidth, s=s), "") for s in sides]
    print_table(results, columns + [("same tokens", "same_tokens", ".0%")],
                title=f"machine: float32 GEMM 2048^3 {limits['gemm_peak_gflops']:.1f} GFLOP/s, memory read "
                      f"{limits['read_bandwidth_gbs']:.1f} GB/s; tok/s of each side and its ratio to transformers "
                      "(decode rows: output tok/s; prefill row: prompt + output tok/s)")
    columns = [("case", "name", "")] + [(s, lambda r, s=s: r[s].get("decode_tok_s", float("nan")), ".1f")
                                        for s in engines]
    columns += [(f"{SHORT[s]} / llama (rounds)", lambda r, s=s: ratio_range(r[f"round_decode_ratios {s} vs llama.cpp"]),
                 "") for s in engines if s != "llama.cpp" and "llama.cpp" in sides]
    print_table([r for r in results if not r["name"].startswith("prefill")], columns,
                title="decode-only tok/s (median of rounds; engine: after each request's first token; llama.cpp: S_TG)")


def main(argv=None) -> int:
    args = parse_args(argv)
    # torch (and transformers with it) before anything imports PaddleFormers, which can hide torch.
    import torch  # noqa: F401

    try:
        path = gguf_path(args.model)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    # As the user set them, before Paddle's import writes OMP_NUM_THREADS=1 into the environment.
    thread_env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    capped = {k: v for k, v in thread_env.items() if v is not None and v.isdigit() and int(v) < (os.cpu_count() or 1)}
    if capped:
        log(f"warning: {capped} caps the BLAS below the {os.cpu_count()} cores: the GEMM peak is not the machine's")
    load_before = os.getloadavg()[0]
    if load_before > 0.5 * (os.cpu_count() or 1):
        # Measured on 2 shared cores at load ~10: torch on 2 threads took 16 ms for a [1, 576] x [576, 1536]
        # product that takes 0.5 ms on 1 thread (its OpenMP barrier waits for a descheduled peer).
        log(f"warning: load average {load_before:.1f} on {os.cpu_count()} cores: multi-threaded code stalls "
            f"on a busy machine and the comparison means little; run it on a quiet one")
    log("measuring this machine's limits")
    from fastdeploy.model_executor.layers import cpu_kernels

    limits = {"gemm_peak_gflops": gemm_peak_gflops(), "read_bandwidth_gbs": cpu_kernels.memory_read_gbs(),
              "cpu": cpu_kernels.cpu_name(), "kernels": cpu_kernels.kernel_isas()}
    log(f"GEMM peak {limits['gemm_peak_gflops']:.1f} GFLOP/s, read bandwidth {limits['read_bandwidth_gbs']:.1f} GB/s; "
        f"{cpu_kernels.describe()}")

    log(f"loading transformers' reference from {path}")
    hf = load_transformers(path, args.torch_threads)
    params = matmul_parameters(hf)
    cases = make_cases(args, hf.config.vocab_size)

    from fastdeploy import LLM, envs

    engines = {}
    for side, blocks, int8 in (("engine", 1, 0), ("engine f32", 0, 0), ("engine int8", 1, 1)):
        if (side == "engine f32" and args.no_float32_engine) or (side == "engine int8" and not args.int8_activations):
            continue
        log(f"loading the {side} (FD_CPU_GGUF_BLOCKS={blocks}, FD_CPU_INT8_ACTIVATIONS={int8})")
        with envs.override(FD_CPU_GGUF_BLOCKS=blocks, FD_CPU_INT8_ACTIVATIONS=int8):  # read when the model loads
            engines[side] = LLM(model=path, **engine_kwargs(args, cases))
    weight_bytes = {side: llm.engine.runner.model.dense_layer_bytes() for side, llm in engines.items()}
    weight_bytes["transformers"] = 4 * (params[0] + params[1])
    weight_bytes["llama.cpp"] = os.path.getsize(path)  # every tensor of the file, as llama.cpp holds them
    warm = [cases[0]["prompts"][0][:8]]
    for llm in engines.values():
        run_engine(llm, warm, 2)  # op build/load and first-call costs stay out of the timed cases
    run_transformers(hf, warm, 2)

    sides = [*engines, "transformers"] + (["llama.cpp"] if args.llama_batched_bench else [])
    runners = {"transformers": lambda prompts, n: run_transformers(hf, prompts, n),
               "llama.cpp": lambda prompts, n: run_llama_cpp(args.llama_batched_bench, path, prompts, n),
               **{side: functools.partial(run_engine, llm) for side, llm in engines.items()}}
    results = []
    for case in cases:
        def run_side(side):
            log(f"{case['name']}: {side} ({case['requests']} x {case['input_len']} in / {case['output_len']} out)")
            got = runners[side](case["prompts"], case["output_len"])
            log(f"{case['name']}: {side} {sum(len(o) for o in got[1])} output tokens in {got[0]:.1f} s")
            return got

        runs = take_turns(sides, args.rounds, run_side,
                          between=lambda r, _: log(f"{case['name']}: round {r + 1}/{args.rounds} done"))
        results.append(case_row(case, runs, list(engines), limits, params, weight_bytes))
    print_tables(results, limits, sides)
    write_json(args.json, {"model": path, "limits": limits, "matmul_parameters": params[0] + params[1],
                           "weight_bytes": weight_bytes, "lm_head_parameters": params[1],
                           "torch_threads": args.torch_threads, "thread_env": thread_env, "cpu_count": os.cpu_count(),
                           "load_average_before": load_before, "load_average_after": os.getloadavg()[0],
                           "cases": results, "args": vars(args)})
    if args.json:
        log(f"wrote {args.json}")
    return 0


def case_row(case: dict, runs: dict, engines: list, limits: dict, params: tuple, weight_bytes: dict) -> dict:
    """One case's report from side -> [(seconds, outputs, decode tok/s or None) of every round]."""
    seconds = {side: [g[0] for g in got] for side, got in runs.items()}
    decode = {side: [g[2] for g in got if g[2] is not None] for side, got in runs.items()}
    outputs = {side: got[0][1] for side, got in runs.items()}
    for side, got in runs.items():
        if any(g[1] != outputs[side] for g in got):
            log(f"warning: {side} gave other tokens in a later round than in round 1")
    row = {k: case[k] for k in ("name", "requests", "input_len", "output_len")}
    median_s, ratios = rounds_summary(seconds)
    for side in runs:
        row[side] = side_metrics(median_s[side], outputs[side], case, limits, params, weight_bytes[side])
        row[side]["round_seconds"] = seconds[side]
        if decode[side]:  # decode-only tok/s, every round and the median
            row[side].update(round_decode_tok_s=decode[side], decode_tok_s=median(decode[side]))
    for side in ratios:  # the engines and llama.cpp, each against transformers
        row[f"ratio_output_tok_s {side}"] = row[side]["output_tok_s"] / row["transformers"]["output_tok_s"]
        row[f"round_ratios {side}"] = ratios[side]
    row["same_tokens"] = min(agreement(outputs[side], outputs["transformers"]) for side in engines
                             if side != "engine int8")
    if "engine int8" in engines:  # not exact: how many requests kept transformers' every token
        row["same_tokens engine int8"] = agreement(outputs["engine int8"], outputs["transformers"])
    if "llama.cpp" in runs:
        row["ratio_output_tok_s engine vs llama.cpp"] = row["engine"]["output_tok_s"] / row["llama.cpp"]["output_tok_s"]
        row["round_ratios engine vs llama.cpp"] = round_ratios(seconds, "llama.cpp", "engine")
        for side in engines:  # decode alone, per round (the sides of a round ran back to back)
            row[f"round_decode_ratios {side} vs llama.cpp"] = round_ratios(decode, side, "llama.cpp")
    return row


if __name__ == "__main__":
    sys.exit(main())
