"""The engine's host work per decode step, 1-D vs head-wise with recycling, at each running-request count.

A step's host work is what the engine does around the model: schedule() (the recycle step, table growth,
admission), the step input of the persistent batch (the changed table entries), the worker packing it into
the step buffers, and update_from_output() (progress, prefix-cache registration). Both arms run in one
process, taking turns step by step, so machine noise hits them alike; no model runs (a fixed token).

    python benchmarks/bench_scheduler.py                                  # 1, 32 and 256 running, 4 and 8 KV heads
    python benchmarks/bench_scheduler.py --kv-heads 4 --gemma3 --smollm2-global --smollm2-one-lane --running 256

The Gemma 3 row is a model with sliding *layers* (18 layers, 1 KV head, layers 5/11/17 global): 3 lanes of 6
slots per block, 5 sliding. The SmolLM2 rows have SmolLM2-135M's attention shape (30 layers, 3 KV heads) and
the head finder's global ranking (30 sliding (layer, head) pairs, W 512 + S 64: 10 lanes x 9 slots), or that
ranking less one head (29 pairs balance over one lane only: 90 slots, 29 sliding).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from ab_harness import print_table, write_json
from fastdeploy import envs
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.engine.persistent_batch import PersistentBatch
from fastdeploy.engine.request import Request, SamplingParams
from fastdeploy.engine.sched.driver import fake_step
from fastdeploy.engine.sched.resource_manager_v1 import ResourceManagerV1
from fastdeploy.model_executor.models.tiny_preset import TINY_PRESET_CONFIG
from fastdeploy.worker.step_buffers import HostStepBuffer, StepBufferLayout


def model_dir(root: str, name: str, **shape) -> str:
    """A config-only model directory (the scheduler never loads weights)."""
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    cfg = {k: v for k, v in dict(TINY_PRESET_CONFIG, max_position_embeddings=65536, **shape).items() if v is not None}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def shape(kv_heads, root: str, args) -> tuple:
    """(model directory, head-wise SWA spec) of a row: a KV-head count (head 0 slides), or a named shape."""
    if kv_heads == "gemma3":
        windows = [None if layer % 6 == 5 else args.window for layer in range(18)]
        return model_dir(root, kv_heads, num_key_value_heads=1, num_attention_heads=4, num_hidden_layers=18,
                         layer_sliding_window=windows, head_wise_swa=None), None
    if str(kv_heads).startswith("smollm2"):
        from fastdeploy.model_executor.models.named_models import CALIBRATED_DIR

        with open(os.path.join(CALIBRATED_DIR, "smollm2-135m-instruct.json"), encoding="utf-8") as f:
            spec = json.load(f)["global_ranking"]["head_wise_swa"]
        if kv_heads == "smollm2-one-lane":  # drop the last sliding head: only one lane balances 29 pairs
            layer = max(i for i, heads in enumerate(spec["swa_kv_heads"]) if heads)
            spec["swa_kv_heads"][layer] = spec["swa_kv_heads"][layer][:-1]
        return model_dir(root, "smollm2_shape", num_key_value_heads=3, num_attention_heads=9, num_hidden_layers=30,
                         head_wise_swa=None), spec
    spec = {"sliding_window": args.window, "sink_size": args.sink, "swa_kv_heads": [0]}
    return model_dir(root, f"kv{kv_heads}", num_key_value_heads=kv_heads, num_attention_heads=2 * kv_heads), spec


class Arm:
    """One engine configuration, every request decoding: its host step, timed part by part."""

    def __init__(self, args, running: int, head_wise: bool, model: str, spec):
        max_tokens = args.decode_steps + running * args.context // args.max_num_batched_tokens + 8
        blocks = -(-(args.context + max_tokens) // args.block_size)
        with envs.override(FD_HEAD_WISE_KV_CACHE=int(head_wise), FD_HEAD_WISE_SWA_RECYCLE=1):
            self.cfg = EngineArgs(model=model, max_model_len=args.context + max_tokens, block_size=args.block_size,
                                  num_gpu_blocks_override=running * blocks + 16, max_num_seqs=running,
                                  max_num_batched_tokens=args.max_num_batched_tokens, head_wise_swa_config=spec,
                                  enable_prefix_caching=args.enable_prefix_caching).create_engine_config()
        self.rm = ResourceManagerV1(self.cfg)
        self.batch = PersistentBatch(self.cfg, self.rm.kv_cache_manager)
        self.host = HostStepBuffer(StepBufferLayout.from_config(self.cfg, self.cfg.table_rows_per_rank))
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        for i in range(running):  # the same prompt for all only with prefix caching (then it is a hit)
            prompt = [5 + (0 if args.enable_prefix_caching else i * 7 + j) % 300 for j in range(args.context)]
            self.rm.add_request(Request(f"r{i}", prompt, params, eos_token_id=2))
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in self.rm.requests.values()):
            fake_step(self.rm)  # prefill everyone (early ones decode meanwhile) until all are decoding
        self.times = {"schedule": [], "step input": [], "update": []}

    def step(self) -> None:
        t0 = time.perf_counter()
        batch = self.rm.schedule()
        t1 = time.perf_counter()
        self.host.pack(self.batch.step_input(batch)[0])  # the engine's step input, the worker's buffers
        t2 = time.perf_counter()
        self.rm.update_from_output(batch, [9 if s.samples else None for s in batch.requests])
        t3 = time.perf_counter()
        for part, dt in zip(self.times, (t1 - t0, t2 - t1, t3 - t2)):
            self.times[part].append(dt)

    def medians_ms(self) -> dict:
        parts = {part: statistics.median(t) * 1e3 for part, t in self.times.items()}
        return {**parts, "host step": statistics.median(map(sum, zip(*self.times.values()))) * 1e3}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--decode-steps", type=int, default=200)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--kv-heads", type=int, nargs="+", default=[4, 8])
    p.add_argument("--enable-prefix-caching", action="store_true",
                   help="measure with prefix caching on (every request shares one prompt then)")
    p.add_argument("--gemma3", action="store_true", help="add a row of Gemma 3 270M's slot layout (6 slots)")
    p.add_argument("--smollm2-global", action="store_true", help="add SmolLM2's shape, global ranking (9 slots)")
    p.add_argument("--smollm2-one-lane", action="store_true", help="add the same ranking less one head (90 slots)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    extra = [name for name, on in (("gemma3", args.gemma3), ("smollm2-global", args.smollm2_global),
                                   ("smollm2-one-lane", args.smollm2_one_lane)) if on]
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for kv_heads in args.kv_heads + extra:
            model, spec = shape(kv_heads, root, args)
            for running in args.running:
                print(f"[bench_scheduler] {kv_heads}: {running} requests of {args.context} tokens...", file=sys.stderr,
                      flush=True)
                arms = {"1-D": Arm(args, running, False, model, spec), "head-wise": Arm(args, running, True, model, spec)}
                for _ in range(args.decode_steps):
                    for arm in arms.values():
                        arm.step()
                slots = arms["head-wise"].cfg.slot_layout
                rows.append({"kv_heads": kv_heads, "running": running, "context": args.context,
                             "slots": slots.slots_per_rank, "lanes": slots.num_lanes,
                             "sliding_slots": len(slots.sliding_slots),
                             "one_d_ms": arms["1-D"].medians_ms(), "head_wise_ms": arms["head-wise"].medians_ms(),
                             "pages_recycled": arms["head-wise"].rm.kv_cache_manager.swa_pages_recycled_total})
    def cell(m: dict) -> str:
        return f"{m['host step']:.3f} ({m['schedule']:.3f}+{m['step input']:.3f}+{m['update']:.3f})"

    print_table(rows, [("shape", "kv_heads", ""), ("slots", "slots", ""), ("lanes", "lanes", ""),
                       ("running", "running", ""), ("1-D", lambda r: cell(r["one_d_ms"]), ""),
                       ("head-wise", lambda r: cell(r["head_wise_ms"]), ""),
                       ("ratio", lambda r: r["head_wise_ms"]["host step"] / r["one_d_ms"]["host step"], ".2f")],
                title=f"host work per decode step, ms (median of {args.decode_steps} steps; block {args.block_size}; "
                      f"SWA head 0 W={args.window}, S={args.sink}): schedule + step input (persistent batch, packed) "
                      "+ update")
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
