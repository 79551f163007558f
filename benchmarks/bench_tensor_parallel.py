"""Offline TP=1 vs TP=N on the tiny preset: output tok/s, mean engine-step time, identical tokens.

TP=N runs one worker process per rank (paddle.distributed, gloo on CPU); each step pays the
engine -> worker message and two all-reduces per layer. On a small CPU machine this measures the
overhead of the process model, not a speed-up.

    python benchmarks/bench_tensor_parallel.py
    python benchmarks/bench_tensor_parallel.py --tp 1 2 4 --num-prompts 64 --json tp.json
"""

from __future__ import annotations

import argparse
import os

from ab_harness import print_table, run_requests, take_turns, write_json


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
        got = run_requests(engine, {f"r{i}": p for i, p in enumerate(prompts)}, params)
    finally:
        engine.close()
    tokens, elapsed, steps = [o.outputs.token_ids for o in got["outputs"]], got["end"] - got["start"], got["steps"]
    return {"tp": tp, "output_tok_s": sum(map(len, tokens)) / elapsed, "mean_step_ms": 1000 * elapsed / steps,
            "steps": steps, "tokens": tokens}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["FD_HEAD_WISE_KV_CACHE"] = str(args.head_wise)
    os.environ.setdefault("FD_LOG_INTERVAL", "0")
    prompts = [[3 + (i * 31 + n * 7) % 250 for i in range(args.input_len)] for n in range(args.num_prompts)]
    runs = take_turns(args.tp, 1, lambda tp: run(tp, args, prompts))  # one engine per TP, in turn
    rows = [got for tp_runs in runs.values() for got in tp_runs]
    print(f"{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, max_num_seqs "
          f"{args.max_num_seqs}, head-wise={args.head_wise}")
    print_table(rows, [("TP", "tp", ""), ("out tok/s", "output_tok_s", ".0f"), ("mean step ms", "mean_step_ms", ".1f"),
                       ("steps", "steps", ""), ("tokens = TP 1", lambda r: r["tokens"] == rows[0]["tokens"], "")],
                markdown=True)
    write_json(args.json, [{k: v for k, v in r.items() if k != "tokens"} for r in rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
