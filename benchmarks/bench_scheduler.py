"""Time ResourceManagerV1.schedule() per decode step: 1-D vs head-wise with SWA recycling on.

Both arms run in one process, interleaved round by round, so machine noise hits them alike.
A fake model step marks the scheduled tokens computed and samples a fixed token.

    python benchmarks/bench_scheduler.py                 # 256 running requests, 4 and 8 KV heads
    python benchmarks/bench_scheduler.py --gemma3        # + a row of Gemma 3 270M's slot layout
    python benchmarks/bench_scheduler.py --json out.json

The Gemma 3 row is a model with sliding *layers* (18 layers, 1 KV head, layers 5/11/17 global, no
head-wise SWA): 3 lanes of 6 slots per block, 5 of them sliding (cache_manager/slots.py).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1
from fastdeploy.model_executor.models.tiny_preset import TINY_PRESET_CONFIG


def model_dir(kv_heads: int, root: str) -> str:
    """A config-only model directory with `kv_heads` KV heads (the scheduler never loads weights)."""
    path = os.path.join(root, f"kv{kv_heads}")
    os.makedirs(path, exist_ok=True)
    cfg = dict(TINY_PRESET_CONFIG, num_key_value_heads=kv_heads, num_attention_heads=kv_heads * 2,
               max_position_embeddings=65536)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def gemma3_shape_dir(root: str, window: int) -> str:
    """Config-only: Gemma 3 270M's attention shape (18 layers, 1 KV head, 5 sliding : 1 global)."""
    path = os.path.join(root, "gemma3_shape")
    os.makedirs(path, exist_ok=True)
    cfg = dict(TINY_PRESET_CONFIG, num_key_value_heads=1, num_attention_heads=4, num_hidden_layers=18,
               max_position_embeddings=65536,
               layer_sliding_window=[None if layer % 6 == 5 else window for layer in range(18)])
    cfg.pop("head_wise_swa")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def build(args, head_wise: bool, kv_heads, root: str) -> ResourceManagerV1:
    """kv_heads: a KV-head count (head-wise SWA head 0), or "gemma3" (sliding layers)."""
    gemma3 = kv_heads == "gemma3"
    os.environ["FD_HEAD_WISE_KV_CACHE"] = "1" if head_wise else "0"
    os.environ["FD_HEAD_WISE_SWA_RECYCLE"] = "1"
    # Early requests decode while later ones prefill: give every request room for that too.
    max_tokens = args.decode_steps + args.running * args.context // args.max_num_batched_tokens + 8
    blocks_per_req = -(-(args.context + max_tokens) // args.block_size)
    cfg = EngineArgs(
        model=gemma3_shape_dir(root, args.window) if gemma3 else model_dir(kv_heads, root),
        max_model_len=args.context + max_tokens,
        block_size=args.block_size, num_gpu_blocks_override=args.running * blocks_per_req + 16,
        max_num_seqs=args.running, max_num_batched_tokens=args.max_num_batched_tokens,
        head_wise_swa_config=None if gemma3 else {"sliding_window": args.window, "sink_size": args.sink,
                                                  "swa_kv_heads": [0]},
        enable_prefix_caching=args.enable_prefix_caching,
    ).create_engine_config()
    rm = ResourceManagerV1(cfg)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(args.running):
        rm.add_request(Request(f"r{i}", [5] * args.context, params, eos_token_id=2))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in rm.requests.values()):
        fake_step(rm)  # prefill everyone (and let early ones decode) until all are in decode
    return rm


def fake_step(rm: ResourceManagerV1) -> float:
    t0 = time.perf_counter()
    batch = rm.schedule()
    elapsed = time.perf_counter() - t0
    rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
    return elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, default=256)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--decode-steps", type=int, default=200)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--kv-heads", type=int, nargs="+", default=[4, 8])
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="measure with prefix caching on (every request shares the same prompt then)")
    p.add_argument("--gemma3", action="store_true", help="add a row of Gemma 3 270M's slot layout (6 slots)")
    p.add_argument("--json", type=str, default=None)
    args = p.parse_args()

    rows = []
    with tempfile.TemporaryDirectory() as root:
        for kv_heads in args.kv_heads + (["gemma3"] if args.gemma3 else []):
            print(f"[bench_scheduler] {kv_heads} KV heads: prefilling {args.running} requests of "
                  f"{args.context} tokens (fake steps)...", file=sys.stderr, flush=True)
            arms = {"1-D": build(args, False, kv_heads, root), "head-wise": build(args, True, kv_heads, root)}
            times = {name: [] for name in arms}
            for _ in range(args.decode_steps):
                for name, rm in arms.items():
                    assert len(rm.running) == args.running
                    times[name].append(fake_step(rm))
            med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            slots = arms["head-wise"].fd_config.slot_layout
            row = {"kv_heads": kv_heads, "slots": slots.slots_per_rank, "lanes": slots.num_lanes,
                   "running": args.running, "context": args.context,
                   "one_d_ms": med["1-D"], "head_wise_ms": med["head-wise"],
                   "ratio": med["head-wise"] / med["1-D"],
                   "pages_recycled": arms["head-wise"].swa_pages_recycled_total}
            rows.append(row)

    print(f"\nschedule() per decode step, median of {args.decode_steps} steps "
          f"(block {args.block_size}, SWA head 0: W={args.window}, S={args.sink})")
    print(f"{'KV heads':>8} {'slots':>6} {'running':>8} {'context':>8} {'1-D ms':>8} {'head-wise ms':>13} {'ratio':>6}")
    for r in rows:
        print(f"{r['kv_heads']:>8} {r['slots']:>6} {r['running']:>8} {r['context']:>8} {r['one_d_ms']:>8.3f} "
              f"{r['head_wise_ms']:>13.3f} {r['ratio']:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
