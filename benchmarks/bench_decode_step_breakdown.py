"""Where one request's decode step goes: host (Python, op dispatch, step input, sampling, output
handling) vs the dense products (the weights' read) vs attention vs norms and activation, per step.

    python benchmarks/bench_decode_step_breakdown.py [--model smollm2-135m-instruct] [--steps 100]
    python benchmarks/bench_decode_step_breakdown.py --clock cpu      # CPU time: robust on a shared machine
    FD_CPU_INT8_ACTIVATIONS=1 python benchmarks/bench_decode_step_breakdown.py   # the opt-in path

One engine, one request of `--input-len` random prompt tokens, greedy; once its prompt is in, `--steps`
decode steps are timed, each split by wrapping the engine's parts (schedule, step input, buffer fill,
the forward pass, argmax, update, detokenize, output) and every Paddle custom-op call (by op name).
"dense" is every op that multiplies by the weights (linear_blocks*, linear_packed, and the fused layer
ops, which include their norms and activation); with every layer in one op (the default,
FD_CPU_FUSED_LAYERS=2) that op is its own line, and FD_CPU_FUSED_LAYERS=1 splits it into dense and
attention; "host" is the step's time outside any custom op. The
wrapping adds ~1 us per op call. With `--clock cpu` the main thread's CPU time is counted (the op's
helper thread works in parallel and is not), which a busy machine disturbs least; compare runs of
one clock only.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DENSE_OPS = ("linear_blocks", "linear_blocks_int8", "linear_packed", "linear_sgemm", "norm_qkv_blocks", "mlp_blocks")
NORM_OPS = ("rms_norm_rows", "add_rms_norm_rows", "gated_activation")
# Every layer in one op (FD_CPU_FUSED_LAYERS=2, the default): its dense products, attention and norms
# together; FD_CPU_FUSED_LAYERS=1 splits them (two op calls a layer around the attention op).
STACK_OPS = ("decoder_stack_forward",)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a named model or a .gguf path")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=100, help="decode steps timed")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall time, or the main thread's CPU time (pin to one core to count all the work)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    from bench_vs_transformers import gguf_path
    from paddle import _C_ops

    from fastdeploy import LLM, SamplingParams

    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    llm = LLM(model=gguf_path(args.model), max_num_seqs=4, max_model_len=args.input_len + args.steps + 64,
              block_size=64, enable_prefix_caching=False)
    engine = llm.engine
    spent = collections.defaultdict(float)

    def wrap(obj, name, label):
        inner = getattr(obj, name)

        def timed(*a, **k):
            t0 = clock()
            try:
                return inner(*a, **k)
            finally:
                spent[label] += clock() - t0

        setattr(obj, name, timed)

    runner = engine.runner
    wrap(engine.scheduler, "schedule", "host: schedule")
    wrap(engine.scheduler, "update_from_output", "host: update")
    wrap(runner, "build_step_input", "host: step input")
    wrap(runner.ranks, "build_forward_meta", "host: buffer fill")
    wrap(engine.tokenizer, "decode_incremental", "host: detokenize")
    wrap(engine, "_output", "host: output")
    wrap(runner.ranks.model, "forward", "forward")
    run_op = _C_ops._run_custom_op

    def timed_op(name, *a):
        t0 = clock()
        try:
            return run_op(name, *a)
        finally:
            spent["op:" + name] += clock() - t0

    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 49000, args.input_len).tolist()
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=args.steps + 16, ignore_eos=True))
    while any(r.num_computed_tokens <= r.num_prompt_tokens for r in engine.scheduler.running):
        engine.step()
    for _ in range(5):
        engine.step()
    spent.clear()
    steps = []
    _C_ops._run_custom_op = timed_op
    try:
        for _ in range(args.steps):
            t0 = clock()
            engine.step()
            steps.append(clock() - t0)
    finally:
        _C_ops._run_custom_op = run_op
    n = len(steps)
    per = {k: v / n * 1e3 for k, v in spent.items()}
    ops = {k[3:]: v for k, v in per.items() if k.startswith("op:")}
    dense = sum(v for k, v in ops.items() if k in DENSE_OPS)
    attention = sum(v for k, v in ops.items() if "attention" in k)
    norms = sum(v for k, v in ops.items() if k in NORM_OPS)
    stack = sum(v for k, v in ops.items() if k in STACK_OPS)
    other_ops = sum(ops.values()) - dense - attention - norms - stack
    step = float(np.mean(steps)) * 1e3
    host = step - sum(ops.values())
    flags = {k: os.environ[k] for k in ("FD_CPU_INT8_ACTIVATIONS", "FD_CPU_FUSED_LAYERS", "FD_CPU_GGUF_BLOCKS")
             if k in os.environ}
    print(f"{args.model}, 1 request, {args.input_len} prompt tokens, {n} decode steps, clock {args.clock}, "
          f"flags {flags or 'default'}, load average {os.getloadavg()[0]:.1f}")
    print(f"step mean {step:.2f} ms (median {np.median(steps) * 1e3:.2f} ms, {1e3 / step:.1f} tok/s)")
    if stack:
        print(f"  every layer in one op (dense products, attention, norms) {stack:6.2f} ms")
    print(f"  dense products (weights) {dense:6.2f} ms   attention {attention:6.2f} ms   norms + activation "
          f"{norms:6.2f} ms   other ops {other_ops:6.2f} ms")
    print(f"  host (outside ops)       {host:6.2f} ms, of which: "
          + ", ".join(f"{k[6:]} {v:.2f}" for k, v in sorted(per.items()) if k.startswith("host: "))
          + f"; forward's Python {per.get('forward', 0) - sum(ops.values()):.2f}")
    print("  ops per step: " + ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
