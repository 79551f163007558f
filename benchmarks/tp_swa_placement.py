"""TP degree x SWA-head placement: what recycling can buy when every rank has its own page pool.

Exact page arithmetic of the engine (`predicted_concurrency` / `rank_ceilings`, the functions the
scheduler's admission uses), no timing: for each tensor-parallel degree, number of SWA KV heads and
placement (load order vs `--balance-swa-heads`), the requests that fit at once with recycling OFF
and ON, and the ceiling (ON / OFF). The KV heads are ERNIE-4.5-21B-A3B's four; the workload is the
simulator's seed workload (10.6k in / 4k out, window 4096, sink 64, block 64, chunk 2048). Each
rank gets the same number of blocks, sized so OFF fits `--concurrency-off` requests on every TP.

    python benchmarks/tp_swa_placement.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-len", type=int, default=10600)
    p.add_argument("--output-len", type=int, default=4096)
    p.add_argument("--window", type=int, default=4096)
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--concurrency-off", type=int, default=39, help="requests recycle-OFF fits (A800 seed row)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def row(args, tp: int, swa_heads: list, balance: bool) -> dict:
    from fastdeploy.cache_manager.head_wise import predicted_concurrency, rank_ceilings
    from fastdeploy.engine.args_utils import EngineArgs

    max_len = args.input_len + args.output_len + args.block_size
    blocks = args.concurrency_off * math.ceil((args.input_len + args.output_len - 1) / args.block_size)
    cfg = EngineArgs(tensor_parallel_size=tp, balance_swa_heads=balance, block_size=args.block_size,
                     num_gpu_blocks_override=blocks, max_model_len=max_len, max_num_seqs=4096,
                     max_num_batched_tokens=args.max_num_batched_tokens,
                     head_wise_swa_config={"sliding_window": args.window, "sink_size": args.sink,
                                           "swa_kv_heads": swa_heads}).create_engine_config()
    pred = predicted_concurrency(cfg, args.input_len, args.output_len)
    ranks = rank_ceilings(cfg, args.input_len, args.output_len)
    return {"tp": tp, "swa_heads": f"{len(swa_heads)}/4", "balanced": balance,
            "swa_heads_per_rank": ranks["swa_heads_per_rank"], "running_off": pred["running_off"],
            "running_on": pred["running_on"], "ceiling": pred["ceiling"],
            "per_rank_ceiling": [round(c, 3) for c in ranks["per_rank"]]}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["FD_HEAD_WISE_KV_CACHE"] = "1"
    rows = []
    for tp in args.tp:
        for swa in ([0], [0, 1]):
            for balance in (False, True):
                if balance and tp == 1:
                    continue  # one rank: nothing to place
                rows.append(row(args, tp, swa, balance))
    print(f"{args.input_len} in / {args.output_len} out, window {args.window}, sink {args.sink}, "
          f"block {args.block_size}, chunk {args.max_num_batched_tokens}, 4 KV heads")
    print("| TP | SWA heads | placement | SWA heads per rank | running OFF→ON | ceiling | per-rank ceiling |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        placement = "balanced" if r["balanced"] else "load order"
        print(f"| {r['tp']} | {r['swa_heads']} | {placement} | {r['swa_heads_per_rank']} | "
              f"{r['running_off']}→{r['running_on']} | {r['ceiling']:.2f} | "
              f"{', '.join(f'{c:.2f}' for c in r['per_rank_ceiling'])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
