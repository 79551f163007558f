"""Prefix caching off vs on, head-wise KV with SWA recycling on: hit rate, TTFT, throughput.

Two workloads on the offline engine (tiny preset: 4 KV heads, head 0 SWA window 128 / sink 16,
block size 16), each run once with --no-enable-prefix-caching and once with it:

- shared-prefix: `--prefixes` system prompts of `--prefix-len` tokens, shared round-robin by
  `--requests` requests, each with its own `--suffix-len`-token question (default: the issue's
  16 x 1k prompts shared by 256 requests; it fits a few minutes on 2 CPU cores because the tiny
  preset is small and outputs are short, `--output-len` 16). It runs twice: with room for every
  prefix (`--num-blocks`) and with a cache too small to keep them all (`--tight-blocks`), where
  eviction decides what survives;
- multi-turn: `--chats` conversations of `--turns` turns; turn k's prompt is turn k-1's prompt,
  its answer and a new `--message-len`-token message. A turn is submitted when the previous one ends.

TTFT is measured inside the engine loop: first-token time minus the time the request was added.
Greedy tokens of both arms are compared (they must be identical).

    python benchmarks/bench_prefix_caching.py --json out.json
    python benchmarks/bench_prefix_caching.py --prefixes 4 --prefix-len 256 --requests 32   # quick
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np
from ab_harness import print_table, run_requests, take_turns, write_json

from fastdeploy import LLM, SamplingParams


def tokens(n: int, seed: int) -> list:
    return [3 + (i * 37 + seed * 101 + (i * i + seed) % 23) % 250 for i in range(n)]


def make_llm(args, caching: bool, num_blocks: int) -> LLM:
    os.environ.update(FD_HEAD_WISE_KV_CACHE="1", FD_HEAD_WISE_SWA_RECYCLE="1", FD_ATTENTION_BACKEND="APPEND_ATTN",
                      FD_LOG_INTERVAL="0")
    return LLM(block_size=16, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               num_gpu_blocks_override=num_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
               enable_prefix_caching=caching)


def drive(llm: LLM, batches: list, params: SamplingParams) -> dict:
    """Run batches of (rid, prompt) one after another (each may depend on the last); collect metrics."""
    engine = llm.engine
    # Warm up (first op calls, allocator) on tokens no workload shares, then measure deltas.
    llm.generate([tokens(40, 99999)], params, use_tqdm=False)
    base = engine.get_stats()
    outputs, ttft, out_tokens, prompt_tokens = {}, [], 0, 0
    t0 = time.perf_counter()
    for batch in batches:
        batch = dict(batch(outputs) if callable(batch) else batch)
        prompt_tokens += sum(map(len, batch.values()))
        for out in run_requests(engine, batch, params)["outputs"]:
            outputs[out.request_id] = out.outputs.token_ids
            out_tokens += len(out.outputs.token_ids)
            ttft.append(out.metrics["first_token_time"] - out.metrics["arrival_time"])
    wall = time.perf_counter() - t0
    end = engine.get_stats()
    s = {k: end[k] - base[k] for k in ("prefix_cache_query_tokens_total", "prefix_cache_hit_tokens_total",
                                       "prefix_cache_evictions_total", "num_preemptions_total",
                                       "swa_pages_recycled_total")}
    query = s["prefix_cache_query_tokens_total"] or prompt_tokens
    return {
        "wall_s": wall, "output_tok_s": out_tokens / wall, "total_tok_s": (out_tokens + prompt_tokens) / wall,
        "ttft_mean_ms": 1e3 * statistics.mean(ttft), "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_p90_ms": 1e3 * float(np.percentile(ttft, 90)),
        "hit_rate": s["prefix_cache_hit_tokens_total"] / query,
        "hit_tokens": s["prefix_cache_hit_tokens_total"], "query_tokens": query,
        "evictions": s["prefix_cache_evictions_total"], "preemptions": s["num_preemptions_total"],
        "swa_pages_recycled": s["swa_pages_recycled_total"], "outputs": outputs,
    }


def shared_prefix(args) -> list:
    systems = [tokens(args.prefix_len, 1000 + p) for p in range(args.prefixes)]
    reqs = [(f"sp{i}", systems[i % args.prefixes] + tokens(args.suffix_len, i)) for i in range(args.requests)]
    return [reqs]


def multi_turn(args) -> list:
    def turn(k):
        def build(outputs):
            out = []
            for c in range(args.chats):
                if k == 0:
                    prompt = tokens(args.message_len * 2, 5000 + c)
                else:
                    prev = state[c]
                    prompt = prev + outputs[f"chat{c}-t{k - 1}"] + tokens(args.message_len, 7000 + 31 * c + k)
                state[c] = prompt
                out.append((f"chat{c}-t{k}", prompt))
            return out
        return build

    state = {}
    return [turn(k) for k in range(args.turns)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefixes", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--chats", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--message-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-blocks", type=int, default=2048, help="KV blocks (4 pages each)")
    p.add_argument("--tight-blocks", type=int, default=1280, help="KV blocks of the tight shared-prefix run")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--json", type=str, default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rows = []
    for name, workload, blocks in (("shared-prefix", shared_prefix, args.num_blocks),
                                   ("shared-tight", shared_prefix, args.tight_blocks),
                                   ("multi-turn", multi_turn, args.num_blocks)):
        def run(caching):
            print(f"[bench_prefix_caching] {name} ({blocks} blocks), prefix caching {'on' if caching else 'off'}...",
                  file=sys.stderr, flush=True)
            return drive(make_llm(args, caching, blocks), workload(args), params)

        (off,), (on,) = take_turns((False, True), 1, run).values()  # one fresh engine each: no rounds to pair
        rows.append({"workload": name, "num_blocks": blocks,
                     "identical_tokens": off.pop("outputs") == on.pop("outputs"), "off": off, "on": on,
                     "throughput_gain": on["output_tok_s"] / off["output_tok_s"],
                     "ttft_speedup": off["ttft_mean_ms"] / on["ttft_mean_ms"]})
    print_table([{"workload": r["workload"], "arm": arm, **r[arm]} for r in rows for arm in ("off", "on")],
                [("workload", "workload", ""), ("arm", "arm", ""), ("hit rate", "hit_rate", ".1%"),
                 ("TTFT mean ms", "ttft_mean_ms", ".1f"), ("p50", "ttft_p50_ms", ".1f"), ("p90", "ttft_p90_ms", ".1f"),
                 ("out tok/s", "output_tok_s", ".1f"), ("tok/s", "total_tok_s", ".1f"), ("evict", "evictions", ""),
                 ("wall s", "wall_s", ".2f")],
                title="prefix caching off vs on: head-wise KV, SWA recycling on, tiny preset, block 16")
    for r in rows:
        print(f"{r['workload']}: throughput x{r['throughput_gain']:.2f}, TTFT x{r['ttft_speedup']:.2f} faster, "
              f"identical tokens: {r['identical_tokens']}")
    write_json(args.json, {"args": vars(args), "results": rows})
    return 0 if all(r["identical_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
