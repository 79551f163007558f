"""Time ResourceManagerV1.schedule() per decode step: 1-D vs head-wise with SWA recycling on.

Both arms run in one process, interleaved round by round, so machine noise hits them alike.
A fake model step marks the scheduled tokens computed and samples a fixed token.

    python benchmarks/bench_scheduler.py                 # 256 running requests, 4 and 8 KV heads
    python benchmarks/bench_scheduler.py --gemma3        # + a row of Gemma 3 270M's slot layout
    python benchmarks/bench_scheduler.py --kv-heads 3 --smollm2-global --smollm2-one-lane  # uneven per-layer heads
    python benchmarks/bench_scheduler.py --json out.json

The Gemma 3 row is a model with sliding *layers* (18 layers, 1 KV head, layers 5/11/17 global, no
head-wise SWA): 3 lanes of 6 slots per block, 5 of them sliding (cache_manager/slots.py).

The SmolLM2 rows have SmolLM2-135M's attention shape (30 layers, 3 KV heads) and uneven per-layer SWA
heads: `smollm2-global` is the head finder's global ranking (calibrated/smollm2-135m-instruct.json,
`global_ranking`: 30 sliding (layer, head) pairs, W 512 + S 64), which the slot layout packs into 10 lanes
of 3 layers, 9 slots per block (3 sliding). `smollm2-one-lane` drops the ranking's last sliding head: 29
sliding pairs balance over no lane count but one, so all 30 layers share one lane of 90 slots (29 sliding,
61 full) -- the "90 slots per request" case, with 61 slots that have nothing to recycle.
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


def smollm2_shape_dir(root: str) -> str:
    """Config-only: SmolLM2-135M's attention shape (30 layers, 9 query heads, 3 KV heads)."""
    path = os.path.join(root, "smollm2_shape")
    os.makedirs(path, exist_ok=True)
    cfg = dict(TINY_PRESET_CONFIG, num_key_value_heads=3, num_attention_heads=9, num_hidden_layers=30,
               max_position_embeddings=65536)
    cfg.pop("head_wise_swa")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def smollm2_global_ranking(one_lane: bool = False) -> dict:
    """The head finder's global ranking for SmolLM2 (its head_wise_swa section); `one_lane` drops the last
    sliding head of the last layer that has one, which leaves 29 sliding pairs: only one lane balances them."""
    from fastdeploy.model_executor.models.named_models import CALIBRATED_DIR

    with open(os.path.join(CALIBRATED_DIR, "smollm2-135m-instruct.json"), encoding="utf-8") as f:
        spec = json.load(f)["global_ranking"]["head_wise_swa"]
    if one_lane:
        layer = max(i for i, heads in enumerate(spec["swa_kv_heads"]) if heads)
        spec["swa_kv_heads"][layer] = spec["swa_kv_heads"][layer][:-1]
    return spec


def build(args, head_wise: bool, kv_heads, root: str) -> ResourceManagerV1:
    """kv_heads: a KV-head count (head-wise SWA head 0), "gemma3" (sliding layers), or "smollm2-global" /
    "smollm2-one-lane" (uneven per-layer SWA heads)."""
    gemma3 = kv_heads == "gemma3"
    smollm2 = str(kv_heads).startswith("smollm2")
    os.environ["FD_HEAD_WISE_KV_CACHE"] = "1" if head_wise else "0"
    os.environ["FD_HEAD_WISE_SWA_RECYCLE"] = "1"
    # Early requests decode while later ones prefill: give every request room for that too.
    max_tokens = args.decode_steps + args.running * args.context // args.max_num_batched_tokens + 8
    blocks_per_req = -(-(args.context + max_tokens) // args.block_size)
    if gemma3:
        model, swa = gemma3_shape_dir(root, args.window), None
    elif smollm2:
        model, swa = smollm2_shape_dir(root), smollm2_global_ranking(kv_heads == "smollm2-one-lane")
    else:
        model, swa = model_dir(kv_heads, root), {"sliding_window": args.window, "sink_size": args.sink,
                                                 "swa_kv_heads": [0]}
    cfg = EngineArgs(
        model=model,
        max_model_len=args.context + max_tokens,
        block_size=args.block_size, num_gpu_blocks_override=args.running * blocks_per_req + 16,
        max_num_seqs=args.running, max_num_batched_tokens=args.max_num_batched_tokens,
        head_wise_swa_config=swa,
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


def parse_args(argv=None) -> argparse.Namespace:
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
    p.add_argument("--smollm2-global", action="store_true",
                   help="add a row of SmolLM2's shape with the head finder's global ranking (10 lanes, 9 slots)")
    p.add_argument("--smollm2-one-lane", action="store_true",
                   help="add a row of the same ranking less one sliding head (1 lane, 90 slots, 29 sliding)")
    p.add_argument("--json", type=str, default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    rows = []
    with tempfile.TemporaryDirectory() as root:
        extra = [name for name, on in (("gemma3", args.gemma3), ("smollm2-global", args.smollm2_global),
                                       ("smollm2-one-lane", args.smollm2_one_lane)) if on]
        for kv_heads in args.kv_heads + extra:
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
                   "sliding_slots": len(slots.sliding_slots),
                   "running": args.running, "context": args.context,
                   "one_d_ms": med["1-D"], "head_wise_ms": med["head-wise"],
                   "ratio": med["head-wise"] / med["1-D"],
                   "pages_recycled": arms["head-wise"].kv_cache_manager.swa_pages_recycled_total}
            rows.append(row)

    print(f"\nschedule() per decode step, median of {args.decode_steps} steps "
          f"(block {args.block_size}, SWA head 0: W={args.window}, S={args.sink})")
    print(f"{'KV heads':>16} {'slots':>6} {'sliding':>8} {'lanes':>6} {'running':>8} {'context':>8} {'1-D ms':>8} "
          f"{'head-wise ms':>13} {'ratio':>6}")
    for r in rows:
        print(f"{r['kv_heads']:>16} {r['slots']:>6} {r['sliding_slots']:>8} {r['lanes']:>6} {r['running']:>8} "
              f"{r['context']:>8} {r['one_d_ms']:>8.3f} {r['head_wise_ms']:>13.3f} {r['ratio']:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
