"""Offline TP=1 vs TP=N on the tiny preset: output tok/s, mean engine-step time, identical tokens.

TP=N runs one worker process per rank (paddle.distributed, gloo on CPU); each step pays the
engine -> worker message and two all-reduces per layer. On a small CPU machine this measures the
overhead of the process model, not a speed-up.

    python benchmarks/bench_tensor_parallel.py
    python benchmarks/bench_tensor_parallel.py --tp 1 2 4 --num-prompts 64 --json tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--head-wise", type=int, choices=[0, 1], default=1, help="FD_HEAD_WISE_KV_CACHE")
    p.add_argument("--json", type=str, default=None)
    return p.parse_args(argv)


def run(tp: int, args, prompts) -> dict:
    from fastdeploy.engine.args_utils import EngineArgs
    from fastdeploy.engine.engine import LLMEngine
    from fastdeploy.engine.request import SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(
        tensor_parallel_size=tp, block_size=16, max_num_seqs=args.max_num_seqs, num_gpu_blocks_override=1024,
        max_model_len=args.input_len + args.output_len + 16))
    try:
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        tokens, steps, start = {}, 0, time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = out.outputs.token_ids
            steps += 1
        elapsed = time.perf_counter() - start
    finally:
        engine.close()
    out_tokens = sum(len(t) for t in tokens.values())
    return {"tp": tp, "output_tok_s": out_tokens / elapsed, "mean_step_ms": 1000 * elapsed / steps, "steps": steps,
            "tokens": [tokens[f"r{i}"] for i in range(len(prompts))]}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["FD_HEAD_WISE_KV_CACHE"] = str(args.head_wise)
    os.environ.setdefault("FD_LOG_INTERVAL", "0")
    prompts = [[3 + (i * 31 + n * 7) % 250 for i in range(args.input_len)] for n in range(args.num_prompts)]
    rows = [run(tp, args, prompts) for tp in args.tp]
    print(f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, max_num_seqs "
          f"{args.max_num_seqs}, head-wise={args.head_wise}")
    print("| TP | out tok/s | mean step ms | steps | tokens = TP 1 |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        same = r["tokens"] == rows[0]["tokens"]
        print(f"| {r['tp']} | {r['output_tok_s']:.0f} | {r['mean_step_ms']:.1f} | {r['steps']} | {same} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "tokens"} for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
